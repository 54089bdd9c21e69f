"""Giving back queued copies (``ExpertCache.give_back_unstarted``) on the
real issuer (host backend), driven by a hypothesis state machine.

PD+host's ``host_queued`` path cancels route-ahead copies the link has not
started and frees their slots, while forwards pin experts, prefetches queue
more copies and the link runs or is held. The machine interleaves those
calls and checks after every step that the cache's maps stay inverse, that
only the pending forward's experts are pinned, that the byte books count
exactly the copies that were asked for and not given back, and that a
given-back expert was in flight, unpinned and queued; whenever the link
drains, every resident expert's slot must hold that expert's bytes (a
cancelled copy wrote nothing, a reused slot was copied anew)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from hypothesis_budget import scaled
from issuer_fixtures import PatternExperts, expert_byte

from pdflash.cache import CacheTooSmallError, ExpertCache
from pdflash.protocols import Band

pytestmark = pytest.mark.native

LAYERS, EXPERTS, NBYTES, SLOTS = 3, 4, 64, 6
NUM_IDS = LAYERS * EXPERTS


ids_st = st.lists(st.integers(0, NUM_IDS - 1), min_size=1, max_size=SLOTS)


class GiveBackMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        from pdflash.h2d import H2DIssuer

        self.src = PatternExperts(LAYERS, EXPERTS, NBYTES)
        # one chunk in flight at a time: later copies stay queued while it is held
        self.issuer = H2DIssuer(backend="host", chunk_bytes=NBYTES, window_bytes=NBYTES)
        self.issuer.register_source(self.src.buffer.data_ptr(), self.src.buffer.numel())
        self.cache = ExpertCache(
            self.src, self.issuer, num_slots=SLOTS, top_k=2, max_batch_tokens=1
        )
        self.held = False
        self._hold(True)  # start with the link busy: copies queue behind one held chunk
        self.pending: np.ndarray | None = None  # the forward's pinned experts
        self.pending_tickets: np.ndarray | None = None
        # the model of the byte books: copies asked for and not given back
        self.copies = 0
        self.prefetch_copies = 0
        self.given_back = 0
        self.copy_kind: dict[int, str] = {}  # expert -> "prefetch" | "miss" of its copy

    def _hold(self, on: bool) -> None:
        if on != self.held:
            self.issuer._native.test_hold_link(on)
            self.held = on

    def _present(self) -> set[int]:
        return {int(g) for g in np.flatnonzero(self.cache.slot_of >= 0)}

    def _book_new(self, before: set[int], kind: str) -> None:
        new = self._present() - before
        self.copies += len(new)
        if kind == "prefetch":
            self.prefetch_copies += len(new)
        for g in new:
            self.copy_kind[g] = kind

    def _check_bytes(self, ids: Any) -> None:
        for g in np.unique(np.asarray(ids)).tolist():
            slot = int(self.cache.slot_of[g])
            assert slot >= 0, g
            assert torch.all(self.cache.slot_tensor(slot) == expert_byte(g)), g

    @rule(on=st.booleans())
    def hold(self, on: bool) -> None:
        self._hold(on)

    @rule(ids=ids_st, band=st.sampled_from([Band.ROUTE_AHEAD, Band.BACKGROUND]))
    def prefetch(self, ids: list[int], band: Band) -> None:
        before = self._present()
        tickets = self.cache.prefetch(ids, band)
        self._book_new(before, "prefetch")
        slots = self.cache.slot_of[ids]
        expect = np.where(slots >= 0, self.cache.ticket[np.maximum(slots, 0)], -1)
        assert np.array_equal(tickets, expect)

    @precondition(lambda self: self.pending is None)
    @rule(ids=st.lists(st.integers(0, NUM_IDS - 1), min_size=1, max_size=2))
    def forward_pins(self, ids: list[int]) -> None:
        before = self._present()
        slot_of, pins = self.cache.slot_of.copy(), self.cache.pins.copy()
        try:
            _, tickets = self.cache.acquire(ids)
        except CacheTooSmallError:
            # too many slots in flight: nothing changed; once they land it fits
            # (so whether the forward is pending never depends on the copies' pace)
            assert np.array_equal(self.cache.slot_of, slot_of)
            assert np.array_equal(self.cache.pins, pins)
            self._hold(False)
            self.cache.drain_inflight()
            _, tickets = self.cache.acquire(ids)
        self._book_new(before, "miss")
        self.pending, self.pending_tickets = np.asarray(ids), tickets

    @precondition(lambda self: self.pending is not None)
    @rule()
    def forward_reads(self) -> None:
        assert self.pending is not None and self.pending_tickets is not None
        self._hold(False)
        self.cache.wait_ready(self.pending_tickets)
        self._check_bytes(self.pending)
        self.cache.release(self.pending)
        self.pending = self.pending_tickets = None

    @rule(ids=st.lists(st.integers(0, NUM_IDS - 1), max_size=SLOTS))
    def give_back(self, ids: list[int]) -> None:
        cache = self.cache
        queued = cache.unstarted_copies(ids)
        slots_before = cache.slot_of[ids].copy()
        pins_before = cache.pins[np.maximum(slots_before, 0)].copy()
        out = cache.give_back_unstarted(ids)
        arr = np.asarray(ids, dtype=np.int64)
        gone = {int(g) for g in arr[out]}
        # each expert is given back once, whatever the duplicates
        assert int(out.sum()) == len(gone)
        # only copies queued when asked (a queued copy may start, never the reverse)
        assert gone <= {int(g) for g in arr[queued]}
        for g in gone:
            i = ids.index(g)
            assert slots_before[i] >= 0 and pins_before[i] == 0
            assert cache.slot_of[g] == -1
            self.copies -= 1
            if self.copy_kind.pop(g) == "prefetch":
                self.prefetch_copies -= 1
        self.given_back += len(gone)

    @rule()
    def drain(self) -> None:
        if self.pending is not None:
            self.forward_reads()
        self._hold(False)
        self.cache.drain_inflight()
        assert not (self.cache.ticket >= 0).any()
        self._check_bytes(sorted(self._present()))

    @invariant()
    def books_agree(self) -> None:
        cache = self.cache
        held = np.flatnonzero(cache.expert_of >= 0)
        assert np.array_equal(cache.slot_of[cache.expert_of[held]], held)
        assert int((cache.slot_of >= 0).sum()) == held.size
        assert not (cache.ticket[cache.expert_of < 0] >= 0).any()
        pinned = {int(cache.expert_of[s]) for s in np.flatnonzero(cache.pins > 0)}
        assert pinned == (set() if self.pending is None else set(self.pending.tolist()))
        assert (cache.copies, cache.given_back) == (self.copies, self.given_back)
        assert cache.bytes_in == self.copies * NBYTES
        assert cache.prefetch_bytes_in == self.prefetch_copies * NBYTES

    def teardown(self) -> None:
        try:
            self.drain()
            assert self.cache.failed_copies == 0
        finally:
            self._hold(False)
            self.issuer.close()


GiveBackMachine.TestCase.settings = settings(
    max_examples=scaled(60),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_give_back_keeps_the_books_and_the_bytes = GiveBackMachine.TestCase
