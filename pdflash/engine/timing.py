"""Compute-busy and stall timing for the regime metrics of docs/design.md §6.

On CUDA, CUDA events recorded on the compute stream bracket every forward
(compute-busy = forward time - stall time - host wait) and every wait of the
compute stream on expert copies (stall = exposed fetch) or on the host CPU's
expert outputs (host wait, hybrid miss service). On the CPU the forwards run
synchronously, so ``time.perf_counter`` brackets measure the same things on
the host (the host backend blocks the caller in ``wait``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from pdflash.cache.expert_cache import acquire_and_wait
from pdflash.protocols import TicketState

#: what a forward's wait on expert copies waited for, in the order it waits:
#: ``inflight`` (copies issued ahead of any access, prefetches not landed yet,
#: whose copy had started when the forward asked), ``queued`` (such copies
#: still queued then, no chunk started: the ones another path could still
#: have taken off the link; waited for next, so only the extra time counts),
#: ``miss`` (copies a cache access issued on demand for a missing expert:
#: waited for last, the extra time); ``inflight_unsplit`` (prefetches where
#: the issuer cannot tell queued from started), ``unclassified`` where the
#: cache cannot tell misses from prefetches
STALL_KINDS = ("miss", "inflight", "queued", "inflight_unsplit", "unclassified")

_QUEUED = int(TicketState.QUEUED)


class _Span:
    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.host_s = 0.0
        self.pairs: list[tuple[Any, Any]] = []
        self.count = 0

    @contextmanager
    def measure(self) -> Iterator[None]:
        self.count += 1
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            try:
                yield
            finally:
                end.record()
                self.pairs.append((start, end))
        else:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self.host_s += time.perf_counter() - t0

    def total_s(self) -> float:
        if self.pairs:
            torch.cuda.synchronize()
            self.host_s += sum(a.elapsed_time(b) for a, b in self.pairs) / 1000.0
            self.pairs.clear()
        return self.host_s

    def ready_s(self) -> float:
        """:meth:`total_s` without waiting on the device: only spans whose end
        event has completed are added (the rest by a later call). The spans
        are recorded on one stream, so they complete in order."""
        done = 0
        for start, end in self.pairs:
            if not end.query():
                break
            self.host_s += start.elapsed_time(end) / 1000.0
            done += 1
        del self.pairs[:done]
        return self.host_s


class ComputeTimer:
    """Accumulates forward time and compute-stream stalls on copies."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._depth = 0
        #: bumped by every :meth:`reset` and every wait :meth:`stall` starts:
        #: while it is unchanged, no wait was recorded since a reading of
        #: :meth:`stall_s_ready` (a later reading adds only the waits then
        #: still running on the device)
        self.stall_version = -1
        self.reset()

    def reset(self) -> None:
        """Zero the accumulated times (e.g. after a warm-up)."""
        self.stall_version += 1
        self._forward = _Span(self.cuda)
        self._stalls: dict[str, _Span] = {}  # by STALL_KINDS
        self._host_wait = _Span(self.cuda)
        self._kinds: dict[str, _Span] = {}
        self._regions: dict[tuple[str, str], _Span] = {}
        self._kind: str | None = None

    @property
    def method(self) -> str:
        return "cuda_events" if self.cuda else "host_perf_counter"

    @contextmanager
    def forward(self, kind: str = "forward") -> Iterator[None]:
        """Time one forward; ``kind`` (``prefill``/``draft``/``verify``) also
        accumulates separately (:meth:`kind_s`)."""
        # NOTE: nested forwards (none today) would double count; time the outermost only
        if self._depth:
            yield
            return
        self._depth += 1
        self._kind = kind
        span = self._kinds.setdefault(kind, _Span(self.cuda))
        try:
            with self._forward.measure(), span.measure():
                yield
        finally:
            self._depth -= 1
            self._kind = None

    @contextmanager
    def region(self, name: str) -> Iterator[None]:
        """Time a part of the current forward (e.g. ``attention``, ``router``,
        ``experts`` of each layer); accumulated per (forward kind, name).
        Outside a forward nothing is timed."""
        if self._kind is None:
            yield
            return
        span = self._regions.setdefault((self._kind, name), _Span(self.cuda))
        with span.measure():
            yield

    def kind_count(self, kind: str) -> int:
        """How many ``kind`` forwards were timed."""
        span = self._kinds.get(kind)
        return 0 if span is None else span.count

    def region_s(self, kind: str, name: str) -> float | None:
        """Seconds in region ``name`` of ``kind`` forwards; None if never timed."""
        span = self._regions.get((kind, name))
        return None if span is None else span.total_s()

    def kind_s(self, kind: str) -> float:
        span = self._kinds.get(kind)
        return 0.0 if span is None else span.total_s()

    def kind_s_ready(self, kind: str) -> float:
        """:meth:`kind_s` without a device synchronize (as
        :meth:`stall_s_ready`: spans still running count at a later call)."""
        span = self._kinds.get(kind)
        return 0.0 if span is None else span.ready_s()

    def stall(self, kind: str) -> Any:
        """Time a wait of the compute stream on expert copies, as ``kind``
        (:data:`STALL_KINDS`)."""
        if kind not in STALL_KINDS:
            raise ValueError(f"stall kind must be one of {STALL_KINDS}, got {kind!r}")
        self.stall_version += 1
        return self._stalls.setdefault(kind, _Span(self.cuda)).measure()

    def stall_kind_s(self, kind: str) -> float:
        """:meth:`stall_s` of the waits timed as ``kind`` (0 where none was)."""
        span = self._stalls.get(kind)
        return 0.0 if span is None else span.total_s()

    def host_wait(self) -> Any:
        """Time a forward waits for the host CPU's expert outputs (hybrid
        miss service): on CUDA the compute stream's gap until the copy back."""
        return self._host_wait.measure()

    def host_wait_s(self) -> float:
        return self._host_wait.total_s()

    def host_wait_s_ready(self) -> float:
        """:meth:`host_wait_s` without a device synchronize (as
        :meth:`stall_s_ready`)."""
        return self._host_wait.ready_s()

    def forward_s(self) -> float:
        return self._forward.total_s()

    def stall_s(self) -> float:
        return sum(span.total_s() for span in self._stalls.values())

    def stall_s_ready(self) -> float:
        """:meth:`stall_s` so far, without a device synchronize (which would
        also wait for the prefetch copies in flight): stalls still running
        on the device count at a later call."""
        return sum(span.ready_s() for span in self._stalls.values())

    def compute_busy_s(self) -> float:
        return max(0.0, self.forward_s() - self.stall_s() - self.host_wait_s())


class StallTimedCache:
    """Delegates to an expert cache and times the calls where a forward waits
    for copies (``wait_ready``; ``ensure_resident`` for callers that use it)
    as compute stalls, split by what was waited for.

    NOTE: this wraps the object the offloaded MoE runtime holds; everything
    else passes through unchanged. ``ensure_resident`` is the cache's
    ``acquire`` then this ``wait_ready`` (so its wait is split too), with the
    cache's undo on a failed wait.
    """

    def __init__(self, cache: Any, timer: ComputeTimer) -> None:
        object.__setattr__(self, "_cache", cache)
        object.__setattr__(self, "_timer", timer)
        # looked up once: every forward layer's copy wait passes through here
        object.__setattr__(self, "_miss_copies", getattr(cache, "miss_copies", None))
        issuer = getattr(cache, "issuer", None)
        object.__setattr__(self, "_states", getattr(issuer, "states", None))

    @property
    def wrapped(self) -> Any:
        return self._cache

    def wait_ready(self, tickets: Any) -> None:
        miss_copies = self._miss_copies
        if miss_copies is None:
            with self._timer.stall("unclassified"):
                self._cache.wait_ready(tickets)
            return
        t = np.asarray(tickets, dtype=np.int64).reshape(-1)
        t = t[t >= 0]
        miss = miss_copies(t)
        ahead = t[~miss]
        parts: tuple[tuple[str, Any], ...] = ()
        if self._states is None:
            parts = (("inflight_unsplit", ahead),)
        elif ahead.size:
            queued = np.asarray(self._states(ahead)) == _QUEUED
            parts = (("inflight", ahead[~queued]), ("queued", ahead[queued]))
        # NOTE: the started prefetches first, then the queued ones, then the
        # misses: waits in a row end when the latest copy lands, as one wait
        # would, and each later part times only its extra
        for kind, part in (*parts, ("miss", t[miss])):
            if part.size:
                with self._timer.stall(kind):
                    self._cache.wait_ready(part)

    def ensure_resident(self, flat_ids: Any) -> Any:
        if self._miss_copies is None:
            with self._timer.stall("unclassified"):
                return self._cache.ensure_resident(flat_ids)
        # as ExpertCache.ensure_resident, with this wait (split by kind)
        return acquire_and_wait(self._cache, flat_ids, self.wait_ready)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._cache, name, value)
