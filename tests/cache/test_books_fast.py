"""The expert cache's fast book-keeping paths against their plain references:
``sorted_unique`` vs ``np.unique`` and ``_available`` (a count) vs the free
slots plus the listed evictable ones, under random traffic."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from pdflash.cache import CacheTooSmallError, ExpertCache
from pdflash.cache.eviction import LayerCyclicPolicy, LRUPolicy
from pdflash.cache.expert_cache import first_occurrences, sorted_unique
from pdflash.protocols import Band

NBYTES = 32


class _Source:
    def __init__(self, layers: int = 3, experts: int = 4) -> None:
        self.num_layers, self.num_experts, self.expert_nbytes = layers, experts, NBYTES
        self.buffer = torch.zeros(layers * experts * NBYTES, dtype=torch.uint8)

    def host_ptrs(self, flat_ids: Any) -> np.ndarray:
        return self.buffer.data_ptr() + np.asarray(flat_ids, dtype=np.int64) * NBYTES


@given(st.lists(st.integers(-5, 40), max_size=12), st.booleans())
def test_sorted_unique_equals_np_unique(values: list[int], presort: bool) -> None:
    ids = np.asarray(sorted(set(values)) if presort else values, dtype=np.int64)
    got = sorted_unique(ids)
    assert got.dtype == np.int64 and np.array_equal(got, np.unique(ids))


def _reference_available(cache: ExpertCache, exclude: np.ndarray) -> int:
    return int((cache.expert_of < 0).sum()) + int(cache._evictable_slots(exclude).size)


@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["use", "prefetch", "complete", "release"]),
            st.lists(st.integers(0, 11), min_size=1, max_size=4, unique=True),
        ),
        max_size=30,
    ),
    slots=st.integers(4, 8),
)
def test_available_counts_what_the_evictable_listing_finds(
    fake_issuer_cls: Any, ops: list[Any], slots: int
) -> None:
    issuer = fake_issuer_cls()
    cache = ExpertCache(_Source(), issuer, num_slots=slots, top_k=2, max_batch_tokens=1)
    pinned: list[list[int]] = []
    for op, ids in ops:
        if op == "use":
            try:
                cache.acquire(ids)
                pinned.append(ids)
            except CacheTooSmallError:
                pass
        elif op == "prefetch":
            cache.prefetch(ids, Band.ROUTE_AHEAD)
        elif op == "complete":
            issuer.wait(list(issuer.queue))
        elif pinned:
            cache.release(pinned.pop(0))
        for exclude in (np.zeros(0, dtype=np.int64), np.asarray(ids, dtype=np.int64)):
            assert cache._available(exclude) == _reference_available(cache, exclude)


@given(st.lists(st.integers(0, 40), max_size=16), st.booleans())
def test_first_occurrences_equals_the_unique_sort(values: list[int], distinct: bool) -> None:
    if distinct:
        values = list(dict.fromkeys(values))
    ids = np.asarray(values, dtype=np.int64)
    distinct_ids, first = np.unique(ids, return_index=True)
    want = distinct_ids[np.argsort(first)]
    got = first_occurrences(ids)
    assert got.dtype == np.int64 and np.array_equal(got, want)


class _PlainLRU(LRUPolicy):
    """LRU seen as any base policy (the layer-cyclic policy's general path)."""


@given(
    layers=st.integers(1, 4),
    experts=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    n=st.integers(0, 30),
)
def test_layer_cyclic_lru_fast_path_equals_the_general_rank(
    layers: int, experts: int, seed: int, n: int
) -> None:
    rng = np.random.default_rng(seed)
    fast = LayerCyclicPolicy(layers, experts)
    slow = LayerCyclicPolicy(layers, experts, base=_PlainLRU())
    num_ids = layers * experts
    for policy in (fast, slow):
        policy.reset(num_ids)
    for _ in range(int(rng.integers(0, 8))):
        ids = rng.choice(num_ids, int(rng.integers(1, num_ids + 1)), replace=False)
        clock = int(rng.integers(0, 5))  # few clocks: many last-use ties
        for policy in (fast, slow):
            policy.on_access(ids, clock)
    predicted = rng.choice(num_ids, int(rng.integers(0, num_ids + 1)), replace=False)
    layer = int(rng.integers(0, layers))
    for policy in (fast, slow):
        policy.set_predicted(predicted)
        policy.before_layer(layer)
    cand = rng.choice(num_ids, int(rng.integers(0, num_ids + 1)), replace=False).astype(np.int64)
    assert np.array_equal(fast.victims(cand, n), slow.victims(cand, n))
