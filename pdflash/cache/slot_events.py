"""Per-slot CUDA events guarding the expert cache's slab, from a pool.

After the kernels that read some slots, one event is recorded on the
compute stream and stored for each of those slots; an eviction of a slot
waits for its event (the only waiter). :class:`SlotEvents` keeps that
per-slot table and reuses the events instead of making one per record:
each pooled event counts the slots that hold it, and goes back to the free
list when none does (overwritten by a later record or taken by an
eviction). A free event has no reader left, so re-recording it cannot make
a wait see the wrong work. At most one live event per slot, so the pool
never grows past the slot count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from pdflash.cache.staging import StagingEvent, _cuda_event


class SlotEvents:
    """``slots`` slots' guarding events (see the module doc).

    :attr:`events`: per slot, the event to wait for before reusing it, or
    None (an object array; read-only for callers). Books: :attr:`created`
    (events made), :attr:`recorded` (records)."""

    def __init__(self, slots: int, new_event: Callable[[], StagingEvent] = _cuda_event) -> None:
        self.events: npt.NDArray[np.object_] = np.full(slots, None, dtype=object)
        self._new_event = new_event
        self._index = np.full(slots, -1, dtype=np.int64)  # per slot: its pooled event
        self._refs = np.zeros(max(slots, 1), dtype=np.int64)  # per pooled event: its slots
        self._pool: list[StagingEvent] = []
        self._free: list[int] = []
        self.created = 0
        self.recorded = 0

    def record(self, slots: npt.NDArray[np.int64], stream: Any) -> None:
        """Record one event on ``stream`` guarding ``slots`` (distinct),
        replacing each one's previous event."""
        if slots.size == 0:
            return  # nothing to guard
        self._forget(self._index[slots])
        if self._free:
            i = self._free.pop()
        else:
            i = len(self._pool)
            self._pool.append(self._new_event())
            self.created += 1
        ev = self._pool[i]
        ev.record(stream)
        self.recorded += 1
        self._index[slots] = i
        self._refs[i] = slots.size
        self.events[slots] = ev

    def take(self, slots: npt.NDArray[np.int64]) -> list[StagingEvent]:
        """The distinct events guarding ``slots`` (distinct), which then hold
        none: wait for each before reusing the slots."""
        held = self._index[slots]
        held = held[held >= 0]
        if held.size == 0:
            return []
        out = [self._pool[i] for i in np.unique(held).tolist()]
        self._forget(held)
        self._index[slots] = -1
        self.events[slots] = None
        return out

    def _forget(self, held: npt.NDArray[np.int64]) -> None:
        """Drop one slot's hold on each entry of ``held`` (-1: none)."""
        held = held[held >= 0]
        if held.size == 0:
            return
        np.subtract.at(self._refs, held, 1)
        gone = held[self._refs[held] == 0]
        if gone.size:
            self._free.extend(np.unique(gone).tolist())
