"""RouteAheadStats: the typed snapshot, its ratios and JSON."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdflash.metrics import NotMeasured, is_measured
from pdflash.routeahead import (
    RouteAheadStats,
    pack_masks,
    routed_bitsets_from_topk,
    unpack_bitsets,
)


def test_empty_stats_report_not_measured_never_a_number() -> None:
    snap = RouteAheadStats(3, 8, 100).snapshot()
    assert snap.coverage == NotMeasured("no routed experts observed")
    assert snap.precision == NotMeasured("no predicted experts observed")
    assert snap.copies.prefetch_use_rate == NotMeasured("no prefetches issued")
    out = snap.to_json()
    json.dumps(out)  # serialisable
    assert out["request"]["coverage"] is None
    assert out["request"]["not_measured"]["coverage"] == "no routed experts observed"
    assert out["batch_layers"][2]["precision"] is None


def test_snapshot_counts_and_ratios() -> None:
    stats = RouteAheadStats(2, 4, np.array([[1, 2, 3, 4], [10, 20, 30, 40]]))
    predicted = np.array([[1, 1, 0, 0], [0, 0, 0, 0]], dtype=bool)
    routed = np.array([[1, 0, 1, 0], [0, 0, 0, 0]], dtype=bool)
    stats.update(predicted, routed)
    snap = stats.snapshot()
    assert (snap.steps, snap.requests) == (1, 1)
    assert snap.request.hits == 1 and snap.request.wasted == 1 and snap.request.missed == 1
    assert snap.request.hits_bytes == 1 and snap.request.routed_bytes == 1 + 3
    assert snap.coverage == 0.5 and snap.precision == 0.5
    assert snap.request.coverage_bytes == 0.25
    assert snap.request.precision_bytes == pytest.approx(1 / 3)
    # layer 1 saw nothing: its ratios are not measured, layer 0's are
    assert isinstance(snap.request_layers[1].coverage, NotMeasured)
    assert snap.request_layers[0].coverage == 0.5
    assert snap.copies.prefetch_issued == 2 and snap.copies.demand_loads == 1
    assert snap.copies.prefetch_use_rate == pytest.approx(1 / 3)
    assert stats.to_json()["request"]["coverage"] == 0.5


@given(
    st.integers(1, 3),
    st.integers(1, 70),
    st.integers(0, 4),
    st.integers(0, 2**32 - 1),
)
def test_ratios_in_unit_interval_or_not_measured(
    layers: int, experts: int, requests: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    stats = RouteAheadStats(layers, experts, 7)
    shape = (requests, layers, experts)
    stats.update(rng.random(shape) < 0.3, rng.random(shape) < 0.3, rng.random(shape[1:]) < 0.5)
    snap = stats.snapshot()
    for counts in (snap.request, snap.batch, *snap.request_layers, *snap.batch_layers):
        for value, denom in (
            (counts.coverage, counts.routed),
            (counts.precision, counts.predicted),
            (counts.coverage_bytes, counts.routed_bytes),
            (counts.precision_bytes, counts.predicted_bytes),
        ):
            if denom == 0:
                assert isinstance(value, NotMeasured)
            else:
                assert is_measured(value) and 0.0 <= float(value) <= 1.0


def test_reset_and_monotone_through_the_wrapper() -> None:
    stats = RouteAheadStats(1, 4, 1)
    m = np.array([[1, 1, 0, 0]], dtype=bool)
    stats.update(m, m)
    first = stats.snapshot()
    stats.update(m, ~m)
    second = stats.snapshot()
    assert second.request.predicted == 2 * first.request.predicted
    assert second.request.hits == first.request.hits
    stats.reset()
    assert stats.snapshot().request.predicted == 0 and stats.steps == 0
    assert isinstance(stats.snapshot().coverage, NotMeasured)


def test_bitset_and_topk_paths_agree_with_masks() -> None:
    rng = np.random.default_rng(3)
    layers, experts, tokens, k, requests = 3, 100, 12, 4, 3
    topk = np.stack(
        [
            np.stack([rng.choice(experts, k, replace=False) for _ in range(tokens)])
            for _ in range(layers)
        ]
    ).astype(np.int64)
    owner = rng.integers(-1, requests, tokens).astype(np.int64)
    routed_bits = routed_bitsets_from_topk(topk, owner, requests, experts)
    routed = np.zeros((requests, layers, experts), dtype=bool)
    for t in range(tokens):
        if owner[t] >= 0:
            for layer in range(layers):
                routed[owner[t], layer, topk[layer, t]] = True
    predicted = rng.random(routed.shape) < 0.2
    a, b = RouteAheadStats(layers, experts, 5), RouteAheadStats(layers, experts, 5)
    a.update(predicted, routed)
    b.update_bitsets(pack_masks(predicted), routed_bits)
    assert a.snapshot() == b.snapshot()
    # a list of per-request bitsets is a batch too
    c = RouteAheadStats(layers, experts, 5)
    c.update_bitsets(list(pack_masks(predicted)), list(routed_bits))
    assert c.snapshot() == a.snapshot()


def test_frequency_and_pending_exposed() -> None:
    stats = RouteAheadStats(1, 3, 1, decay=1.0)
    stats.update(np.array([[1, 0, 0]], bool), np.array([[0, 1, 0]], bool))
    assert stats.frequency().dtype == np.float32
    np.testing.assert_array_equal(stats.frequency(), [[0, 1, 0]])
    np.testing.assert_array_equal(stats.pending_prefetch(), [[True, False, False]])
    assert stats.record_eviction([0]) == 1
    assert stats.snapshot().copies.evicted_before_use_bytes == 1


@given(st.integers(1, 200), st.integers(0, 2**32 - 1))
def test_unpack_inverts_pack(experts: int, seed: int) -> None:
    masks = np.random.default_rng(seed).random((3, 2, experts)) < 0.4
    np.testing.assert_array_equal(unpack_bitsets(pack_masks(masks), experts), masks)


def test_unpack_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="end in 2 words for 70 experts"):
        unpack_bitsets(np.zeros((2, 1), np.uint64), 70)
    with pytest.raises(TypeError, match="uint64"):
        unpack_bitsets(np.zeros((2, 2), np.int64), 70)
