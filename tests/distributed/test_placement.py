"""Expert placements and the per-rank byte cost (no processes)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from pdflash.distributed import (
    BusiestRankByteCost,
    ExpertPlacement,
    FrequencyBalancedPlacement,
    RoundRobinPlacement,
    frequency_from_topk,
    owned_mask,
    placement_for,
    shard_bounds,
)


@pytest.mark.parametrize(
    ("layers", "experts", "ranks"), [(3, 8, 2), (4, 7, 3), (2, 5, 4), (1, 4, 1)]
)
def test_round_robin_partitions_evenly(layers: int, experts: int, ranks: int) -> None:
    p = RoundRobinPlacement(layers, experts, ranks)
    assert isinstance(p, ExpertPlacement)
    table = p.owner_table()
    assert table.shape == (layers, experts)
    masks = [owned_mask(p, r) for r in range(ranks)]
    assert np.array_equal(np.sum(masks, axis=0), np.ones((layers, experts)))  # a partition
    per_layer = np.array([[int(m[layer].sum()) for m in masks] for layer in range(layers)])
    assert per_layer.max() - per_layer.min() <= 1  # within one expert per layer
    p.owner_table()[0, 0] = 99  # a copy: the placement cannot be changed from outside
    assert p.owner_table()[0, 0] == table[0, 0]


def test_frequency_balanced_spreads_hot_experts() -> None:
    # layer 0: two hot experts (0 and 1) that round robin (e % 2) would split
    # anyway; layer 1: the hot ones are 0 and 2, which round robin (e + 1) % 2
    # would put on the same rank
    freq = np.array([[100, 90, 1, 1, 1, 1], [100, 1, 90, 1, 1, 1]], dtype=np.float64)
    rr = RoundRobinPlacement(2, 6, 2).owner_table()
    assert rr[1, 0] == rr[1, 2]
    p = FrequencyBalancedPlacement(freq, 2)
    table = p.owner_table()
    assert table[0, 0] != table[0, 1] and table[1, 0] != table[1, 2]
    for layer in range(2):  # equal expert counts per rank (cap ceil(E / N))
        assert np.bincount(table[layer], minlength=2).tolist() == [3, 3]
    load = p.rank_load()
    assert load.sum() == freq.sum()
    assert load.max() / load.min() < 1.05
    rr_load = np.bincount(rr.reshape(-1), weights=freq.reshape(-1), minlength=2)
    assert load.max() < rr_load.max()  # better balanced than round robin here


def test_frequency_balanced_is_deterministic_and_falls_back_on_empty_layers() -> None:
    rng = np.random.default_rng(0)
    freq = rng.random((3, 16))
    freq[1] = 0.0
    a = FrequencyBalancedPlacement(freq, 4).owner_table()
    b = FrequencyBalancedPlacement(freq.copy(), 4).owner_table()
    assert np.array_equal(a, b)
    assert np.array_equal(a[1], RoundRobinPlacement(3, 16, 4).owner_table()[1])
    for layer in range(3):
        assert np.bincount(a[layer], minlength=4).tolist() == [4, 4, 4, 4]


def test_placement_inputs_are_checked() -> None:
    with pytest.raises(ValueError, match="num_ranks"):
        RoundRobinPlacement(2, 4, 0)
    with pytest.raises(TypeError, match="num_ranks"):
        RoundRobinPlacement(2, 4, 2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-negative"):
        FrequencyBalancedPlacement(np.array([[1.0, -1.0]]), 2)
    with pytest.raises(ValueError, match="layers, experts"):
        FrequencyBalancedPlacement(np.ones(4), 2)
    with pytest.raises(ValueError, match="rank 2 out of range"):
        owned_mask(RoundRobinPlacement(1, 4, 2), 2)
    with pytest.raises(ValueError, match="unknown placement"):
        placement_for("hash", 1, 4, 2)
    with pytest.raises(ValueError, match="frequency shape"):
        placement_for("frequency", 2, 4, 2, np.ones((2, 3)))
    # nothing measured: the uniform fallback, under its own name
    assert isinstance(placement_for("frequency", 2, 4, 2, None), RoundRobinPlacement)


def test_frequency_from_topk_counts_routed_rows() -> None:
    topk = np.array([[[0, 1], [2, 3]], [[1, 0], [3, 1]]])  # [tokens=2, layers=2, k=2]
    freq = frequency_from_topk(topk, 4)
    assert freq.tolist() == [[2, 2, 0, 0], [0, 1, 1, 2]]
    with pytest.raises(ValueError, match="outside"):
        frequency_from_topk(np.array([[[4]]]), 4)


def test_busiest_rank_cost_is_the_max_not_the_sum() -> None:
    p = RoundRobinPlacement(2, 4, 2)  # layer 0: e % 2; layer 1: (e + 1) % 2
    cost = BusiestRankByteCost(p, 10)
    # layer 0 experts 0, 2 (rank 0) and layer 1 expert 0 (rank 1); a duplicate
    ids = np.array([0, 2, 4, 0])
    assert cost.per_rank(ids).tolist() == [20, 10]
    assert cost.cost(ids) == 20  # the total would be 30
    assert cost.per_rank(np.zeros(0, dtype=np.int64)).tolist() == [0, 0]
    assert cost.cost(np.zeros(0, dtype=np.int64)) == 0
    balanced = np.array([0, 1, 4, 5])  # two per rank
    assert cost.cost(balanced) == 20 and int(cost.per_rank(balanced).sum()) == 40
    with pytest.raises(ValueError):
        cost.per_rank(np.array([8]))


@pytest.mark.parametrize(("tokens", "world"), [(0, 2), (1, 2), (5, 2), (7, 3), (16, 4)])
def test_shards_cover_the_tokens_in_order(tokens: int, world: int) -> None:
    bounds = [shard_bounds(tokens, world, r) for r in range(world)]
    assert bounds[0][0] == 0 and bounds[-1][1] == tokens
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    sizes = [hi - lo for lo, hi in bounds]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
