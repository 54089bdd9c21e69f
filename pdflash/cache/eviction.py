"""Eviction policies for :class:`pdflash.cache.ExpertCache`.

A policy only ranks; the cache decides what may be evicted (never a pinned
expert, never one whose copy is still in flight) and hands the policy the
evictable candidates. Policies see flat expert ids and a logical clock (one
tick per cache call), never wall time, so runs are deterministic.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

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


class LFUPolicy:
    """Least frequently used: accesses counted over the whole run (an expert
    keeps its count across evictions, so a popular expert that was evicted
    once is not treated as new); ties go to the least recently used."""

    name = "lfu"

    def __init__(self) -> None:
        self.count = np.zeros(0, dtype=np.int64)
        self.last_use = np.zeros(0, dtype=np.int64)

    def reset(self, num_ids: int) -> None:
        self.count = np.zeros(num_ids, dtype=np.int64)
        self.last_use = np.full(num_ids, -1, dtype=np.int64)

    def on_access(self, flat_ids: IdArray, clock: int) -> None:
        np.add.at(self.count, flat_ids, 1)
        self.last_use[flat_ids] = clock

    def on_insert(self, flat_ids: IdArray, clock: int) -> None:
        self.last_use[flat_ids] = clock

    def on_evict(self, flat_ids: IdArray) -> None:
        pass

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
        ids = np.asarray(flat_ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.predicted.size):
            bad = ids[(ids < 0) | (ids >= self.predicted.size)][0]
            raise ValueError(f"expert id {int(bad)} out of range [0, {self.predicted.size})")
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
