"""The engine's stall timer splits a forward's wait on expert copies by what
it waited for: prefetches whose copy had started, prefetches still queued
when the forward asked, then copies issued on demand for misses (each part
waited for in that order, so a later part times only its extra)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

from pdflash.engine.timing import ComputeTimer, StallTimedCache
from pdflash.protocols import TicketState


class _Issuer:
    def __init__(self, states: dict[int, TicketState]) -> None:
        self._states = states

    def states(self, tickets: npt.ArrayLike) -> npt.NDArray[np.uint8]:
        return np.array([int(self._states[int(t)]) for t in np.asarray(tickets)], dtype=np.uint8)


class _Cache:
    """Tickets 1-3 are prefetches (1 started, 2 and 3 queued), 7 a miss copy;
    every wait takes 10 ms and records the tickets it waited for."""

    def __init__(self, issuer: Any) -> None:
        self.issuer = issuer
        self.waits: list[list[int]] = []
        self.fail_waits = False
        self.aborted: list[list[int]] = []

    def miss_copies(self, tickets: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        return np.asarray(tickets) == 7

    def wait_ready(self, tickets: npt.ArrayLike) -> None:
        self.waits.append(sorted(int(t) for t in np.asarray(tickets)))
        if self.fail_waits:
            raise RuntimeError("copy failed")
        time.sleep(0.01)

    def acquire(
        self, flat_ids: npt.ArrayLike
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        # expert g's copy is ticket g (experts 4 and 5 resident: ticket -1)
        ids = np.asarray(flat_ids, dtype=np.int64)
        return ids + 100, np.where(np.isin(ids, [4, 5]), -1, ids)

    def abort(self, flat_ids: npt.ArrayLike) -> None:
        self.aborted.append(sorted(int(g) for g in np.asarray(flat_ids)))


def _states() -> dict[int, TicketState]:
    return {
        1: TicketState.RUNNING,
        2: TicketState.QUEUED,
        3: TicketState.QUEUED,
        7: TicketState.QUEUED,
    }


def test_started_prefetches_then_queued_ones_then_misses() -> None:
    cache = _Cache(_Issuer(_states()))
    timer = ComputeTimer(torch.device("cpu"))
    wrapped = StallTimedCache(cache, timer)
    wrapped.wait_ready(np.array([7, 3, -1, 1, 2]))
    assert cache.waits == [[1], [2, 3], [7]]
    for kind in ("inflight", "queued", "miss"):
        assert timer.stall_kind_s(kind) >= 0.009, kind
    assert timer.stall_kind_s("inflight_unsplit") == 0.0
    # a wait on started prefetches alone times no queued part
    cache.waits.clear()
    queued_before = timer.stall_kind_s("queued")
    wrapped.wait_ready([1])
    assert cache.waits == [[1]] and timer.stall_kind_s("queued") == queued_before
    # misses alone: no states asked for an empty set of prefetches
    cache.waits.clear()
    wrapped.wait_ready([7])
    assert cache.waits == [[7]]


def test_an_issuer_without_ticket_states_leaves_the_prefetches_unsplit() -> None:
    cache = _Cache(object())
    timer = ComputeTimer(torch.device("cpu"))
    StallTimedCache(cache, timer).wait_ready([1, 2, 7])
    assert cache.waits == [[1, 2], [7]]
    assert timer.stall_kind_s("inflight_unsplit") >= 0.009
    assert timer.stall_kind_s("inflight") == timer.stall_kind_s("queued") == 0.0


def test_ensure_resident_splits_its_wait_and_undoes_a_failed_one() -> None:
    """ensure_resident = acquire, then the split wait (started prefetch 1,
    queued 2, miss 7; resident 4 waits for nothing); a failed wait aborts
    the acquire and raises."""
    cache = _Cache(_Issuer(_states()))
    timer = ComputeTimer(torch.device("cpu"))
    wrapped = StallTimedCache(cache, timer)
    slots = wrapped.ensure_resident([7, 2, 4, 1])
    assert slots.tolist() == [107, 102, 104, 101]
    assert cache.waits == [[1], [2], [7]]
    for kind in ("inflight", "queued", "miss"):
        assert timer.stall_kind_s(kind) >= 0.009, kind
    assert timer.stall_kind_s("unclassified") == 0.0
    cache.fail_waits = True
    with pytest.raises(RuntimeError, match="copy failed"):
        wrapped.ensure_resident([7])
    assert cache.aborted == [[7]]
