"""The expert cache's pooled slot events on the CPU (fake events): over
random records and evictions, every slot's event was last recorded by the
very record that guarded that slot (the one a fresh event per record would
hold), so an eviction waits for the right kernels and never for a later
record; evictions get exactly the distinct records of their slots; the
pool stays within the slot count. A pool that frees an event still held by
another slot is caught by the same check."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from pdflash.cache.slot_events import SlotEvents


class _Event:
    def __init__(self) -> None:
        self.last: int | None = None  # the record (op number) it now stands for

    def record(self, stream: Any = None) -> None:
        self.last = stream

    def synchronize(self) -> None:
        pass


class _EagerReuse(SlotEvents):
    """The bug: the least recently recorded event re-recorded even while a
    slot still holds it."""

    def _pick(self) -> int:
        if len(self._pool) < 2:
            return super()._pick()
        i = self._cursor
        self._cursor = (i + 1) % len(self._pool)
        return i


def _run(cls: type[SlotEvents], slots: int, ops: int, seed: int) -> tuple[SlotEvents, int]:
    """Random records/evictions against a fresh-event-per-record model;
    returns the pool and the count of mismatches."""
    rng = np.random.default_rng(seed)
    pool = cls(slots, new_event=_Event)
    model: list[int | None] = [None] * slots  # per slot: the record guarding it
    bad = 0
    for op in range(ops):
        chosen = rng.choice(slots, int(rng.integers(0, slots + 1)), replace=False).astype(np.int64)
        if rng.random() < 0.7:
            pool.record(chosen, stream=op)  # the fake stream: the record's number
            for s in chosen.tolist():
                model[s] = op
        else:
            got = sorted(ev.last for ev in pool.take(chosen))  # type: ignore[attr-defined]
            want = sorted({model[s] for s in chosen.tolist()} - {None})
            bad += got != want
            for s in chosen.tolist():
                model[s] = None
        for s in range(slots):
            ev = pool.events[s]
            bad += (None if ev is None else ev.last) != model[s]
    return pool, bad


@pytest.mark.parametrize("slots", [1, 3, 8, 40])
def test_each_slot_waits_for_its_own_record(slots: int) -> None:
    pool, bad = _run(SlotEvents, slots, 300, seed=slots)
    assert bad == 0
    assert 0 < pool.created <= slots < pool.recorded  # reused, never past the slot count


@pytest.mark.parametrize("slots", [3, 8, 40])
def test_the_check_catches_an_event_freed_while_held(slots: int) -> None:
    _, bad = _run(_EagerReuse, slots, 300, seed=slots)
    assert bad > 0


def test_empty_records_and_takes() -> None:
    pool = SlotEvents(4, new_event=_Event)
    none = np.zeros(0, dtype=np.int64)
    pool.record(none, stream=0)
    assert pool.created == 0 and pool.take(np.arange(4)) == []
    pool.record(np.array([1, 2]), stream=1)
    pool.record(np.array([2, 3]), stream=2)
    assert pool.created == 2
    pool.record(np.array([1]), stream=3)  # record 1's event is free again: reused
    assert pool.created == 2
    assert sorted(e.last for e in pool.take(np.arange(4))) == [2, 3]  # type: ignore[attr-defined]
    assert all(e is None for e in pool.events) and pool.take(np.arange(4)) == []
    assert pool.created == 2  # never more events than slots held at once
