"""Per-slot CUDA events guarding the expert cache's slab, from a pool.

After the kernels that read some slots, one event is recorded on the
compute stream and stored for each of those slots; an eviction of a slot
waits for its event (the only waiter). :class:`SlotEvents` keeps that
per-slot table and reuses the events instead of making one per record:
a pooled event is re-recorded only when no slot holds it any more (each
slot's hold ends when a later record covers the slot or an eviction takes
it). A free event has no reader left, so re-recording it cannot make a
wait see the wrong work. A new event is made only when none is free, and
each held event is held by at least one slot, so the pool never grows past
the slot count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from pdflash.cache.staging import StagingEvent, new_cuda_event


class SlotEvents:
    """``slots`` slots' guarding events (see the module doc).

    Books: :attr:`created` (events made), :attr:`recorded` (records)."""

    def __init__(self, slots: int, new_event: Callable[[], StagingEvent] = new_cuda_event) -> None:
        self._new_event = new_event
        self._index = np.full(slots, -1, dtype=np.int64)  # per slot: its pooled event
        self._pool: list[StagingEvent] = []
        self._cursor = 0  # the pooled event tried first: the least recently recorded
        self.created = 0
        self.recorded = 0

    @property
    def events(self) -> npt.NDArray[np.object_]:
        """Per slot, the event to wait for before reusing it, or None (a new
        object array: for inspection)."""
        out = np.full(self._index.size, None, dtype=object)
        for s in np.flatnonzero(self._index >= 0).tolist():
            out[s] = self._pool[int(self._index[s])]
        return out

    def record(self, slots: npt.NDArray[np.int64], stream: Any) -> None:
        """Record one event on ``stream`` guarding ``slots``, replacing each
        one's previous event."""
        if slots.size == 0:
            return  # nothing to guard
        index = self._index
        index[slots] = -1  # these slots drop their previous events first
        i = self._pick()
        self._pool[i].record(stream)
        self.recorded += 1
        index[slots] = i

    def _pick(self) -> int:
        """A pooled event no slot holds (the least recently recorded one when
        free, as in a steady cycle of records), else a new one."""
        pool, index = self._pool, self._index
        if pool:
            i = self._cursor
            if not (index == i).any():
                self._cursor = (i + 1) % len(pool)
                return i
            held = np.bincount(index[index >= 0], minlength=len(pool))
            free = np.flatnonzero(held == 0)
            if free.size:
                return int(free[0])
        pool.append(self._new_event())
        self.created += 1
        return len(pool) - 1

    def take(self, slots: npt.NDArray[np.int64]) -> list[StagingEvent]:
        """The distinct events guarding ``slots``, which then hold none:
        wait for each before reusing the slots."""
        held = self._index[slots]
        held = held[held >= 0]
        if held.size == 0:
            return []
        self._index[slots] = -1
        if held.size == 1 or bool((held == held[0]).all()):
            return [self._pool[int(held[0])]]
        return [self._pool[i] for i in np.unique(held).tolist()]
