"""The pure-Python (numpy) reference of the expert cache's books.

:class:`CacheBooks` mirrors :class:`pdflash_native._cachebooks.CacheBooks`
method by method: each method is one step of
:class:`pdflash.cache.ExpertCache`'s bookkeeping (a lookup, a pin update, an
eviction's or a load's array writes), written as the numpy code the cache
ran before the native core. Both work in place on the cache's own arrays.
For the differential tests only (``ExpertCache(..., books=CacheBooks)``);
never used at run time.

Contracts both sides keep: a method that raises changes nothing; an id or
slot listed twice in one call is handled as numpy's fancy indexing handles
it (this module's code is the spec).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

I64 = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]


def _check_slots(slots: I64, num_slots: int, what: str) -> None:
    if slots.size and (int(slots.min()) < 0 or int(slots.max()) >= num_slots):
        bad = int(slots[(slots < 0) | (slots >= num_slots)][0])
        raise IndexError(f"{what} {bad} out of range [0, {num_slots})")


class CacheBooks:
    """The books over an :class:`~pdflash.cache.ExpertCache`'s arrays (see
    :mod:`pdflash.cache.expert_cache` for what each array holds)."""

    def __init__(
        self,
        slot_of: I64,
        expert_of: I64,
        pins: npt.NDArray[np.int32],
        ticket: I64,
        key: I64,
        band: I64,
        used: Bools,
        counted: Bools,
        by_prefetch: Bools,
        num_experts: int,
    ) -> None:
        self.slot_of = slot_of
        self.expert_of = expert_of
        self.pins = pins
        self.ticket = ticket
        self.key = key
        self.band = band
        self.used = used
        self.counted = counted
        self.by_prefetch = by_prefetch
        self.num_ids = int(slot_of.size)
        self.num_slots = int(expert_of.size)
        self.num_experts = int(num_experts)

    # -- ids ---------------------------------------------------------------

    def first_bad_id(self, ids: I64) -> int:
        """Position of the first id outside ``[0, num_ids)``; -1 if none."""
        bad = np.flatnonzero((ids < 0) | (ids >= self.num_ids))
        return int(bad[0]) if bad.size else -1

    @staticmethod
    def strictly_increasing(ids: I64) -> bool:
        return ids.size < 2 or bool((ids[1:] > ids[:-1]).all())

    # -- copies in flight --------------------------------------------------

    def inflight(self) -> tuple[I64, I64]:
        """The slots whose copy is in flight and their tickets."""
        busy = np.flatnonzero(self.ticket >= 0)
        return busy, self.ticket[busy]

    def settle(self, busy: I64, states: npt.NDArray[np.uint8], done_code: int) -> I64:
        """Clear the tickets of ``busy`` slots whose state is ``done_code``;
        return the unpinned ones whose state is past it (failed/cancelled)."""
        if states.shape != busy.shape:
            raise ValueError(f"{states.size} states for {busy.size} slots")
        _check_slots(busy, self.num_slots, "slot")
        self.ticket[busy[states == done_code]] = -1
        bad: I64 = busy[(states > done_code) & (self.pins[busy] == 0)]
        return bad

    # -- capacity ----------------------------------------------------------

    def _evictable_mask(self, exclude: I64) -> Bools:
        ok: Bools = (self.expert_of >= 0) & (self.pins == 0) & (self.ticket < 0)
        if exclude.size:
            held = self.slot_of[exclude]
            ok[held[held >= 0]] = False
        return ok

    def available(self, exclude: I64) -> int:
        """Free slots plus evictable ones (held, unpinned, no copy in
        flight), not counting the slots of ``exclude`` ids."""
        held = int(np.count_nonzero(self.expert_of >= 0))
        return self.num_slots - held + int(np.count_nonzero(self._evictable_mask(exclude)))

    def evictable(self, exclude: I64) -> I64:
        """The evictable slots (see :meth:`available`), ascending."""
        out: I64 = np.flatnonzero(self._evictable_mask(exclude))
        return out

    def evictable_ids(self, exclude: I64) -> I64:
        """The experts of :meth:`evictable`'s slots, in that order."""
        out: I64 = self.expert_of[self.evictable(exclude)]
        return out

    def copy_args(self, slots: I64, first_key: int, base: int, nbytes: int) -> tuple[I64, I64, I64]:
        """The issuer's arguments for copies into ``slots`` (range-checked):
        ``(keys first_key.., destinations base + slot * nbytes, sizes)``."""
        _check_slots(slots, self.num_slots, "slot")
        keys = np.arange(first_key, first_key + slots.size, dtype=np.int64)
        dst: I64 = base + slots * nbytes
        sizes = np.full(slots.size, nbytes, dtype=np.int64)
        return keys, dst, sizes

    def free_slots(self, n: int) -> I64:
        """Up to ``n`` free slots, ascending."""
        out: I64 = np.flatnonzero(self.expert_of < 0)[:n]
        return out

    # -- acquire -----------------------------------------------------------

    def all_held(self, ids: I64) -> bool:
        """Every id holds a slot (its copy may be in flight)."""
        return bool((self.slot_of[ids] >= 0).all())

    def split_present(self, ids: I64) -> tuple[I64, I64]:
        """``(slot_of[ids], the ids without a slot)``."""
        slots = self.slot_of[ids]
        missing: I64 = ids[slots < 0]
        return slots, missing

    def pin_present(self, slots: I64, delta: int) -> None:
        """Add ``delta`` to the pins of the slots ``>= 0`` of ``slots``."""
        held = slots[slots >= 0]
        _check_slots(held, self.num_slots, "slot")
        self.pins[held] += delta

    def commit_access(self, ids: I64, slots_before: I64) -> tuple[int, int]:
        """An acquire's access: ``(hits in flight, fresh slots)``; marks the
        slots of ``ids`` used. ``slots_before``: ``slot_of[ids]`` before the
        misses were loaded (-1 for them)."""
        present = slots_before[slots_before >= 0]
        inflight = int((self.ticket[present] >= 0).sum())
        all_slots = self.slot_of[ids]
        _check_slots(all_slots, self.num_slots, "slot")
        fresh = int((~self.used[all_slots] & self.counted[all_slots]).sum())
        self.used[all_slots] = True
        return inflight, fresh

    def out_tickets(self, ids: I64) -> tuple[I64, I64]:
        """``(slot_of[ids], their tickets)`` (a copy)."""
        slots = self.slot_of[ids]
        tickets: I64 = self.ticket[slots].copy()
        return slots, tickets

    # -- pins of whole layers and releases --------------------------------

    def pin_checked(self, ids: I64) -> tuple[int, I64]:
        """Pin every id's slot; if one holds none, pin nothing and return
        its position: ``(first bad position or -1, slot_of[ids])``."""
        slots = self.slot_of[ids]
        bad = np.flatnonzero(slots < 0)
        if bad.size:
            return int(bad[0]), slots
        self.pins[slots] += 1
        return -1, slots

    def unpin_checked(self, ids: I64) -> tuple[int, I64]:
        """Unpin every id's slot; if one holds no slot or no pin, change
        nothing and return its position."""
        slots = self.slot_of[ids]
        bad = np.flatnonzero((slots < 0) | (self.pins[np.maximum(slots, 0)] <= 0))
        if bad.size:
            return int(bad[0]), slots
        self.pins[slots] -= 1
        return -1, slots

    def promotable(self, slots: I64, band: int) -> I64:
        """The slots of ``slots`` (those ``< 0`` skipped) whose copy is in
        flight at a band after ``band``, in order."""
        slots = slots[slots >= 0]
        _check_slots(slots, self.num_slots, "slot")
        low: I64 = slots[(self.ticket[slots] >= 0) & (self.band[slots] > band)]
        return low

    # -- evictions and loads -----------------------------------------------

    def evict(self, slots: I64) -> tuple[I64, int, int]:
        """Empty ``slots``: ``(their ids, how many were loaded since the last
        reset and never used, how many of those were prefetched)``."""
        _check_slots(slots, self.num_slots, "slot")
        ids = self.expert_of[slots]
        _check_slots(ids, self.num_ids, "expert")
        unused = self.counted[slots] & ~self.used[slots]
        n_unused = int(unused.sum())
        n_prefetch = int((unused & self.by_prefetch[slots]).sum())
        self.slot_of[ids] = -1
        self.expert_of[slots] = -1
        return ids, n_unused, n_prefetch

    def load(
        self, ids: I64, slots: I64, tickets: I64, keys: I64, band: int, prefetched: bool
    ) -> None:
        """Give ``ids`` the free ``slots`` with their copies' tickets and keys."""
        n = ids.size
        if slots.size != n or tickets.size != n or keys.size != n:
            raise ValueError(
                f"{n} ids, {slots.size} slots, {tickets.size} tickets, {keys.size} keys"
            )
        _check_slots(ids, self.num_ids, "expert")
        _check_slots(slots, self.num_slots, "slot")
        self.slot_of[ids] = slots
        self.expert_of[slots] = ids
        self.ticket[slots] = tickets
        self.key[slots] = keys
        self.band[slots] = band
        self.used[slots] = False
        self.counted[slots] = True
        self.by_prefetch[slots] = prefetched

    # -- deferred accesses -------------------------------------------------

    def inflight_row(self, layer: int) -> Bools:
        """``[1, experts]``: per expert of ``layer``, its copy is in flight
        (a non-resident expert reads slot 0's state, as the numpy code
        always did)."""
        if not 0 <= layer < self.num_ids // self.num_experts:
            raise IndexError(f"layer {layer} out of range")
        base = layer * self.num_experts
        slots = self.slot_of[base : base + self.num_experts]
        out: Bools = (self.ticket[np.maximum(slots, 0)] >= 0)[None]
        return out

    def apply_access(self, layer: int, routed: I64, inflight: Bools) -> tuple[I64, int, int]:
        """One deferred access of ``layer`` (expert indices ``routed``, any
        order, repeats allowed): ``(the distinct routed ids still holding a
        slot, how many of them were in flight, fresh slots)``; marks their
        slots used."""
        if not 0 <= layer < self.num_ids // self.num_experts:
            raise IndexError(f"layer {layer} out of range")
        if routed.size and (int(routed.min()) < 0 or int(routed.max()) >= self.num_experts):
            bad = int(routed[(routed < 0) | (routed >= self.num_experts)][0])
            raise ValueError(f"routed expert {bad} out of range [0, {self.num_experts})")
        if inflight.size != self.num_experts:
            raise ValueError(f"{inflight.size} in-flight flags for {self.num_experts} experts")
        experts = np.flatnonzero(np.bincount(routed, minlength=self.num_experts))
        ids = experts.astype(np.int64) + layer * self.num_experts
        slots = self.slot_of[ids]
        held = slots >= 0  # an expert dropped since (failed copy) is not counted
        ids, slots = ids[held], slots[held]
        n_inflight = int(inflight[experts[held]].sum())
        fresh = int((~self.used[slots] & self.counted[slots]).sum())
        self.used[slots] = True
        return ids, n_inflight, fresh


def layer_cyclic_lru_victims(
    candidates: I64,
    last_use: I64,
    predicted: Bools,
    num_layers: int,
    num_experts: int,
    current_layer: int,
    n: int,
) -> I64:
    """:class:`pdflash.cache.eviction.LayerCyclicPolicy`'s victims over its
    LRU base (the numpy ranking the policy ran before its native fast
    path): the ``n`` candidates whose layer runs again farthest from
    ``current_layer``, then unpredicted first (``predicted``: bool per flat
    id, or empty), then least recently used, then the smaller id."""
    cand = np.asarray(candidates, dtype=np.int64)
    if n <= 0 or cand.size == 0:
        return cand[:0]
    layer = cand // num_experts
    cur = current_layer
    dist = np.where(layer > cur, layer - cur, num_layers - cur + layer)
    pred = predicted[cand] if predicted.size else np.zeros(cand.size, dtype=np.bool_)
    order = np.lexsort((cand, last_use[cand], pred, -dist))
    out: I64 = cand[order[:n]]
    return out
