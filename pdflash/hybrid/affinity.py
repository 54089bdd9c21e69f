"""Where the hybrid host's threads run (``--host-affinity off|auto``).

The HOST path's compute threads (the executor's pool threads and the native
kernel's team) spin while they work and for a short while after. With as
many of them as the machine has cores but two, the engine's forward
(launching) thread and the H2D issuer's thread share cores with them
whenever the scheduler puts them there, and every kernel launch or copy the
forward thread issues then waits behind a spinning worker.

``auto`` splits the cores this process may use into two sets: the first
:data:`ENGINE_CORES` physical cores (SMT siblings kept together where the OS
shows them) for the engine (the thread that builds the host service, the
one that runs the forward, and the issuer's thread), the rest for the host
pool. It applies only where it can keep both sets non-empty (at least
``ENGINE_CORES + 1`` cores) and the OS has ``sched_setaffinity`` (Linux);
elsewhere it records why it did nothing. ``off`` makes no affinity call at
all. ``auto`` is the default (:data:`DEFAULT_HOST_AFFINITY`; the GPU
measurement behind it is in the README's H200 results).

What it cannot do: on a virtual machine whose vCPUs are hyperthreads of the
host but shown as one thread per core, two "cores" may share one physical
core, and no placement inside the guest separates them.

:class:`ThreadPinner` remembers each thread's mask before it pinned it, so
closing the service gives every thread it touched its mask back.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

#: ``--host-affinity`` values
HOST_AFFINITY_CHOICES: tuple[str, ...] = ("off", "auto")
#: the setting a host service uses unless told otherwise
DEFAULT_HOST_AFFINITY = "auto"
#: physical cores ``auto`` keeps for the engine: its forward thread and the issuer's
ENGINE_CORES = 2


def affinity_supported() -> bool:
    """Whether this OS lets a thread be placed on cores (Linux)."""
    return hasattr(os, "sched_setaffinity") and hasattr(os, "sched_getaffinity")


def smt_siblings(cpu: int) -> frozenset[int]:
    """``cpu``'s SMT siblings, itself included, as the OS shows them (just
    ``{cpu}`` where it shows none)."""
    path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
    try:
        return frozenset(_parse_cpu_list(path.read_text())) | {cpu}
    except (OSError, ValueError):
        return frozenset({cpu})


def _parse_cpu_list(text: str) -> list[int]:
    """``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]``."""
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


@dataclass(frozen=True)
class HostPlacement:
    """Where the host pool and the engine run (empty sets: not placed)."""

    mode: str
    engine_cpus: tuple[int, ...] = ()
    host_cpus: tuple[int, ...] = ()
    #: why ``auto`` placed nothing (None: it placed, or the mode is off)
    reason: str | None = None

    @property
    def applied(self) -> bool:
        return bool(self.host_cpus)

    def describe(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "applied": self.applied,
            "engine_cpus": list(self.engine_cpus),
            "host_cpus": list(self.host_cpus),
            "reason": self.reason,
        }


def plan_placement(
    mode: str,
    *,
    allowed: Iterable[int] | None = None,
    siblings: Callable[[int], frozenset[int]] = smt_siblings,
    engine_cores: int = ENGINE_CORES,
) -> HostPlacement:
    """The placement ``mode`` gives on this machine.

    ``allowed``: the CPUs the placement may use (default: the calling
    thread's mask; one of several ranks on a host: its :func:`rank_cpus`);
    ``siblings``: a CPU's SMT siblings (default: what the OS shows). The
    engine gets the ``engine_cores`` lowest-numbered physical cores, the
    host pool the rest."""
    if mode not in HOST_AFFINITY_CHOICES:
        raise ValueError(f"host_affinity must be one of {HOST_AFFINITY_CHOICES}, got {mode!r}")
    if engine_cores < 1:
        raise ValueError(f"engine_cores must be >= 1, got {engine_cores}")
    if mode == "off":
        return HostPlacement("off")
    if not affinity_supported():
        return HostPlacement(mode, reason="this OS has no sched_setaffinity")
    if allowed is None:
        allowed = os.sched_getaffinity(0)
    cores = physical_cores(allowed, siblings)
    if len(cores) <= engine_cores:
        return HostPlacement(
            mode,
            reason=f"{len(cores)} cores: too few to keep {engine_cores} for the engine "
            "and the rest for the host pool",
        )
    engine = tuple(sorted(c for group in cores[:engine_cores] for c in group))
    host = tuple(sorted(c for group in cores[engine_cores:] for c in group))
    return HostPlacement(mode, engine_cpus=engine, host_cpus=host)


def physical_cores(
    cpus: Iterable[int], siblings: Callable[[int], frozenset[int]] = smt_siblings
) -> list[tuple[int, ...]]:
    """``cpus`` grouped by physical core (each group the core's SMT siblings
    among ``cpus``), in order of their lowest CPU."""
    wanted = sorted({int(c) for c in cpus})
    if any(c < 0 for c in wanted):
        raise ValueError(f"CPU numbers must be >= 0, got {wanted}")
    cores: list[tuple[int, ...]] = []
    seen: set[int] = set()
    for cpu in wanted:
        if cpu in seen:
            continue
        group = tuple(sorted(set(siblings(cpu)) & set(wanted) | {cpu}))
        seen.update(group)
        cores.append(group)
    return cores


def rank_cpus(
    rank: int,
    world: int,
    *,
    allowed: Iterable[int] | None = None,
    siblings: Callable[[int], frozenset[int]] = smt_siblings,
) -> tuple[int, ...]:
    """Rank ``rank``'s share of ``allowed`` (default: this process's CPUs)
    when ``world`` processes of one host split it: whole physical cores, in
    contiguous blocks whose sizes differ by at most one core, rank 0 first.
    With fewer cores than ranks, rank ``r`` gets core ``r mod cores`` (ranks
    then share cores). Each rank's hybrid host service plans its threads
    inside its share, so N ranks' pools do not all land on the same cores."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    if allowed is None:
        allowed = os.sched_getaffinity(0) if affinity_supported() else range(os.cpu_count() or 1)
    cores = physical_cores(allowed, siblings)
    if not cores:
        raise ValueError("no CPUs to share")
    if len(cores) < world:
        return tuple(sorted(cores[rank % len(cores)]))
    base, extra = divmod(len(cores), world)
    start = rank * base + min(rank, extra)
    mine = cores[start : start + base + (1 if rank < extra else 0)]
    return tuple(sorted(c for core in mine for c in core))


class ThreadPinner:
    """Pins threads (by kernel thread id) to CPU sets and gives each its
    previous mask back on :meth:`restore`. A thread that has exited is
    skipped (it has nothing to give back)."""

    def __init__(self) -> None:
        self._before: dict[int, frozenset[int]] = {}
        self._lock = threading.Lock()

    def pin(self, tid: int, cpus: Sequence[int]) -> bool:
        """Place thread ``tid`` on ``cpus``; False if it no longer exists."""
        if tid <= 0:
            raise ValueError(f"a thread id is > 0, got {tid}")
        if not cpus:
            raise ValueError("no CPUs to pin to")
        try:
            before = frozenset(os.sched_getaffinity(tid))
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:
            return False
        with self._lock:
            self._before.setdefault(tid, before)
        return True

    @property
    def pinned(self) -> list[int]:
        """The threads pinned and not yet given back."""
        with self._lock:
            return sorted(self._before)

    def restore(self) -> None:
        """Every pinned thread back on its mask from before; idempotent."""
        with self._lock:
            before, self._before = self._before, {}
        for tid, mask in before.items():
            with contextlib.suppress(ProcessLookupError):  # exited: nothing to give back
                os.sched_setaffinity(tid, mask)


@runtime_checkable
class ThreadedKernel(Protocol):
    """A host kernel with threads of its own (the native team)."""

    def thread_ids(self) -> list[int]: ...


class PlacedThreads:
    """A :class:`HostPlacement` applied to one host service's threads:
    what was pinned where, and the masks to give back on :meth:`restore`."""

    def __init__(self, placement: HostPlacement) -> None:
        self.placement = placement
        self._pinner = ThreadPinner()
        self.engine_threads: list[int] = []
        self.host_threads: list[int] = []

    def pin_host(self, tids: Iterable[int]) -> None:
        """Put the host pool's threads ``tids`` on the host CPUs."""
        if self.placement.applied:
            for tid in tids:
                if self._pinner.pin(int(tid), self.placement.host_cpus):
                    self.host_threads.append(int(tid))

    def pin_engine(self, tids: Iterable[int]) -> None:
        """Put the engine's threads ``tids`` (forward, issuer) on the engine CPUs."""
        if self.placement.applied:
            for tid in tids:
                if self._pinner.pin(int(tid), self.placement.engine_cpus):
                    self.engine_threads.append(int(tid))

    def restore(self) -> None:
        """Give every thread pinned here its mask back; idempotent."""
        self._pinner.restore()

    def describe(self, pool_threads: int = 0) -> dict[str, Any]:
        """The placement and the threads it placed (``pool_threads``: the
        executor's pool workers, which placed themselves where it applied)."""
        pool = int(pool_threads) if self.placement.applied else 0
        return {
            **self.placement.describe(),
            "engine_threads_pinned": len(self.engine_threads),
            "host_threads_pinned": len(self.host_threads) + pool,
        }


__all__ = [
    "DEFAULT_HOST_AFFINITY",
    "ENGINE_CORES",
    "HOST_AFFINITY_CHOICES",
    "HostPlacement",
    "PlacedThreads",
    "ThreadPinner",
    "ThreadedKernel",
    "affinity_supported",
    "physical_cores",
    "plan_placement",
    "rank_cpus",
    "smt_siblings",
]
