"""Eviction policies for :class:`pdflash.cache.ExpertCache`.

A policy only ranks; the cache decides what may be evicted (never a pinned
expert, never one whose copy is still in flight) and hands the policy the
evictable candidates. Policies see flat expert ids and a logical clock (one
tick per cache call), never wall time, so runs are deterministic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from pdflash._native import load_native
from pdflash.protocols import checked_flat_ids

if TYPE_CHECKING:
    from pdflash_native import _cachebooks
else:
    _cachebooks = load_native("_cachebooks")

IdArray = npt.NDArray[np.int64]


@runtime_checkable
class EvictionPolicy(Protocol):
    """Chooses which resident experts to evict."""

    name: str

    def reset(self, num_ids: int) -> None:
        """Forget everything; ids are ``0 <= g < num_ids``."""
        ...

    def on_access(self, flat_ids: IdArray, clock: int) -> None:
        """The forward used these (resident) experts at ``clock``."""
        ...

    def on_insert(self, flat_ids: IdArray, clock: int) -> None:
        """These experts were given slots (a copy was submitted) at ``clock``."""
        ...

    def on_evict(self, flat_ids: IdArray) -> None:
        """These experts lost their slots."""
        ...

    def victims(self, candidates: IdArray, n: int) -> IdArray:
        """``n`` of ``candidates`` (all evictable, ``n <= len``) to evict, best victim first."""
        ...


def _rank_take(keys: tuple[npt.NDArray[Any], ...], candidates: IdArray, n: int) -> IdArray:
    # np.lexsort sorts by the LAST key first; ids break ties deterministically.
    order = np.lexsort((candidates, *keys))
    return candidates[order[:n]]


class LRUPolicy:
    """Least recently used (insertion counts as a use)."""

    name = "lru"

    def __init__(self) -> None:
        self.last_use = np.zeros(0, dtype=np.int64)

    def reset(self, num_ids: int) -> None:
        self.last_use = np.full(num_ids, -1, dtype=np.int64)

    def on_access(self, flat_ids: IdArray, clock: int) -> None:
        self.last_use[flat_ids] = clock

    def on_insert(self, flat_ids: IdArray, clock: int) -> None:
        self.last_use[flat_ids] = clock

    def on_evict(self, flat_ids: IdArray) -> None:
        pass

    def victims(self, candidates: IdArray, n: int) -> IdArray:
        return _rank_take((self.last_use[candidates],), candidates, n)


class LFUPolicy(LRUPolicy):
    """Least frequently used: accesses counted over the whole run (an expert
    keeps its count across evictions, so a popular expert that was evicted
    once is not treated as new); ties go to the least recently used (LRU's
    books, kept as LRU keeps them)."""

    name = "lfu"

    def __init__(self) -> None:
        super().__init__()
        self.count = np.zeros(0, dtype=np.int64)

    def reset(self, num_ids: int) -> None:
        super().reset(num_ids)
        self.count = np.zeros(num_ids, dtype=np.int64)

    def on_access(self, flat_ids: IdArray, clock: int) -> None:
        np.add.at(self.count, flat_ids, 1)
        super().on_access(flat_ids, clock)

    def victims(self, candidates: IdArray, n: int) -> IdArray:
        # lexsort: primary key is the last one (count), then last use, then id
        return _rank_take((self.last_use[candidates], self.count[candidates]), candidates, n)


class RouteAheadPolicy:
    """Protects the experts route-ahead predicted for the coming verify.

    Victims come from unpredicted experts first (in the base policy's order);
    a predicted expert is evicted only when nothing else is evictable.
    ``set_predicted`` replaces the protected set (call it per verify round);
    an expert stays protected until the next ``set_predicted``/``clear``.
    """

    name = "route_ahead"

    def __init__(self, base: EvictionPolicy | None = None) -> None:
        self.base: EvictionPolicy = base if base is not None else LRUPolicy()
        self.predicted = np.zeros(0, dtype=np.bool_)

    def reset(self, num_ids: int) -> None:
        self.base.reset(num_ids)
        self.predicted = np.zeros(num_ids, dtype=np.bool_)

    def set_predicted(self, flat_ids: npt.ArrayLike) -> None:
        ids = checked_flat_ids(flat_ids, self.predicted.size)
        self.predicted[:] = False
        self.predicted[ids] = True

    def clear(self) -> None:
        self.predicted[:] = False

    def on_access(self, flat_ids: IdArray, clock: int) -> None:
        self.base.on_access(flat_ids, clock)

    def on_insert(self, flat_ids: IdArray, clock: int) -> None:
        self.base.on_insert(flat_ids, clock)

    def on_evict(self, flat_ids: IdArray) -> None:
        self.base.on_evict(flat_ids)

    def victims(self, candidates: IdArray, n: int) -> IdArray:
        prot = self.predicted[candidates]
        free = candidates[~prot]
        if free.size >= n:
            return self.base.victims(free, n)
        rest = self.base.victims(candidates[prot], n - free.size)
        return np.concatenate([self.base.victims(free, free.size), rest])


POLICIES: dict[str, type] = {"lru": LRUPolicy, "lfu": LFUPolicy, "route_ahead": RouteAheadPolicy}


def make_policy(name: str) -> EvictionPolicy:
    """A shipped policy by name: ``lru``, ``lfu`` or ``route_ahead``."""
    try:
        policy: EvictionPolicy = POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; choose from {sorted(POLICIES)}"
        ) from None
    return policy


class LayerCyclicPolicy:
    """Belady at layer granularity for the layer-cyclic access of forwards.

    Every target forward visits the MoE layers in order 0, 1, ..., L-1, forward
    after forward, so the next use of an expert of layer ``j``, seen from the
    layer ``cur`` being computed, is ``j - cur`` layers away if ``j > cur`` and
    ``L - cur + j`` layers away otherwise (``L`` for the current layer itself:
    its experts are next needed in the next forward). Evicting the largest
    distance first is Belady's rule for this access order, at layer
    granularity. Under LRU the same cyclic sweep is the worst case (the least
    recently used experts are exactly the ones the next forward needs first).

    Within a layer, experts route-ahead predicted for the coming verify
    (``set_predicted``) are evicted last, then the base policy (LRU) decides.
    The engine tells the policy which layer is about to run
    (:meth:`before_layer`); between forwards the last layer stays current, so
    prefetches for the next verify's first layers evict the last layers' experts.
    """

    name = "layer_cyclic"

    def __init__(
        self, num_layers: int, num_experts: int, base: EvictionPolicy | None = None
    ) -> None:
        if num_layers < 1 or num_experts < 1:
            raise ValueError(
                f"num_layers and num_experts must be >= 1, got {num_layers}, {num_experts}"
            )
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.base: EvictionPolicy = base if base is not None else LRUPolicy()
        self.current_layer = num_layers - 1
        self.predicted = np.zeros(0, dtype=np.bool_)

    def reset(self, num_ids: int) -> None:
        if num_ids != self.num_layers * self.num_experts:
            raise ValueError(
                f"policy is for {self.num_layers}x{self.num_experts} experts, cache has {num_ids}"
            )
        self.base.reset(num_ids)
        self.predicted = np.zeros(num_ids, dtype=np.bool_)
        self.current_layer = self.num_layers - 1

    def before_layer(self, layer: int) -> None:
        """The forward is about to run ``layer``'s experts."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.num_layers})")
        self.current_layer = layer

    def set_predicted(self, flat_ids: npt.ArrayLike) -> None:
        ids = checked_flat_ids(flat_ids, self.predicted.size)
        self.predicted[:] = False
        self.predicted[ids] = True

    def on_access(self, flat_ids: IdArray, clock: int) -> None:
        self.base.on_access(flat_ids, clock)

    def on_insert(self, flat_ids: IdArray, clock: int) -> None:
        self.base.on_insert(flat_ids, clock)

    def on_evict(self, flat_ids: IdArray) -> None:
        self.base.on_evict(flat_ids)

    def next_use_distance(self, flat_ids: IdArray) -> npt.NDArray[np.int64]:
        """Layers until each expert's layer runs again."""
        layer = np.asarray(flat_ids, dtype=np.int64) // self.num_experts
        cur = self.current_layer
        return np.where(layer > cur, layer - cur, self.num_layers - cur + layer)

    def victims(self, candidates: IdArray, n: int) -> IdArray:
        cand = np.asarray(candidates, dtype=np.int64)
        base = self.base
        if type(base) is LRUPolicy:
            # the LRU order is (last use, id): ranked by those keys directly
            # in one native call (the same order as the rank within
            # base.victims below; reference:
            # pdflash._reference.cachebooks.layer_cyclic_lru_victims)
            return _cachebooks.layer_cyclic_lru_victims(
                cand,
                base.last_use,
                self.predicted,
                self.num_layers,
                self.num_experts,
                self.current_layer,
                n,
            )
        if n <= 0 or cand.size == 0:
            return cand[:0]
        dist = self.next_use_distance(cand)
        pred = self.predicted[cand] if self.predicted.size else np.zeros(cand.size, dtype=np.bool_)
        base_order = np.asarray(base.victims(cand, cand.size), dtype=np.int64)
        # rank[i] = position of cand[i] in the base order (vectorised: this
        # runs on every eviction, over every evictable slot)
        sorter = np.argsort(base_order, kind="stable")
        rank = sorter[np.searchsorted(base_order, cand, sorter=sorter)].astype(np.int64)
        # lexsort: last key is primary -> farthest next use, then unpredicted, then base order
        order = np.lexsort((rank, pred, -dist))
        return cand[order[:n]]
