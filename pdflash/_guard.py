"""A cheap single-thread guard for objects that are not thread-safe.

Like the native ``DeficitCore``'s "busy" flag: an object holds one
:class:`BusyGuard`; each entry point runs inside ``with guard.enter(name):``.
A second thread entering while the first is inside gets a clear
``RuntimeError`` at once (a non-blocking lock, never a wait), instead of two
threads corrupting the object's state. The thread already inside may enter
again (e.g. a stream callback calling ``abort``) unless the entry point says
it must not nest (``reentrant=False``: ``Engine.step`` from a callback).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class ConcurrentUseError(RuntimeError):
    """An object documented as single-threaded was used by two threads at once
    (or an entry point that must not nest was re-entered)."""


def _busy_error(g: BusyGuard, name: str, me: int) -> ConcurrentUseError:
    return ConcurrentUseError(
        f"{g.owner}.{name}() called from thread {me} while {g.owner}.{g.entry}() is "
        f"running in thread {g.holder}: {g.owner} is single-threaded; serialise calls "
        f"(one thread, or a lock around every call)"
    )


def exclusive(fn: F) -> F:
    """Method decorator: run under ``self._guard`` (a :class:`BusyGuard`),
    re-entrant in the thread already inside. The fast path (an uncontended
    non-blocking acquire) costs well under a microsecond."""
    name = fn.__name__

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        g: BusyGuard = self._guard
        if g.lock.acquire(False):
            g.holder = threading.get_ident()
            g.entry = name
            try:
                return fn(self, *args, **kwargs)
            finally:
                g.holder = None
                g.lock.release()
        me = threading.get_ident()
        if g.holder == me:  # nested call in the thread already inside
            return fn(self, *args, **kwargs)
        raise _busy_error(g, name, me)

    return wrapper  # type: ignore[return-value]


class _Entry:
    __slots__ = ("guard", "name", "owned", "reentrant")

    def __init__(self, guard: BusyGuard, name: str, reentrant: bool) -> None:
        self.guard = guard
        self.name = name
        self.reentrant = reentrant
        self.owned = False

    def __enter__(self) -> None:
        g = self.guard
        me = threading.get_ident()
        if g.holder == me:
            if not self.reentrant:
                raise ConcurrentUseError(
                    f"{g.owner}.{self.name}() called while {g.owner}.{g.entry}() is running in "
                    f"the same thread (e.g. from a callback); it is not re-entrant"
                )
            return
        if not g.lock.acquire(blocking=False):
            raise _busy_error(g, self.name, me)
        g.holder = me
        g.entry = self.name
        self.owned = True

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.owned:
            g = self.guard
            g.holder = None
            g.entry = ""
            g.lock.release()


class BusyGuard:
    """Raises :class:`ConcurrentUseError` on concurrent use (see module doc)."""

    __slots__ = ("entry", "holder", "lock", "owner")

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.lock = threading.Lock()
        self.holder: int | None = None
        self.entry = ""

    def enter(self, name: str, *, reentrant: bool = True) -> _Entry:
        return _Entry(self, name, reentrant)

    @property
    def busy(self) -> bool:
        return self.holder is not None
