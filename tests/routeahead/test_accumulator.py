"""The native route-ahead accumulator against the pure-Python reference, and
the invariants of its counters."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdflash._reference.routeahead import COUNTER_NAMES as REF_NAMES
from pdflash._reference.routeahead import RouteAheadReference
from pdflash_native import _routeahead as native

pytestmark = pytest.mark.native


@dataclass
class Step:
    predicted: npt.NDArray[np.uint8]  # (R, L, E), any nonzero byte = member
    routed: npt.NDArray[np.uint8]
    resident: npt.NDArray[np.bool_] | None
    evict: npt.NDArray[np.int64]
    as_bitsets: bool
    single: bool  # pass (L, E) instead of (1, L, E)


@dataclass
class Scenario:
    layers: int
    experts: int
    nbytes: int | npt.NDArray[np.int64]
    decay: float
    steps: list[Step]


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    layers = draw(st.integers(1, 4))
    experts = draw(st.sampled_from([1, 7, 63, 64, 65, 128, 130]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    nbytes: int | npt.NDArray[np.int64]
    if draw(st.booleans()):
        nbytes = draw(st.integers(0, 1 << 40))
    else:
        nbytes = rng.integers(0, 1 << 30, (layers, experts), dtype=np.int64)
        if draw(st.booleans()):  # uniform within each layer, different across
            nbytes[:] = nbytes[:, :1]
    decay = draw(st.sampled_from([1.0, 0.9, 0.5]))
    steps = []
    for _ in range(draw(st.integers(1, 4))):
        requests = draw(st.integers(0, 5))
        density_p, density_u = draw(st.floats(0, 1)), draw(st.floats(0, 1))
        shape = (requests, layers, experts)
        # nonzero bytes other than 1 must also count as members
        values = rng.integers(1, 256, shape, dtype=np.uint8)
        predicted = np.where(rng.random(shape) < density_p, values, 0).astype(np.uint8)
        routed = np.where(rng.random(shape) < density_u, values, 0).astype(np.uint8)
        resident = None if draw(st.booleans()) else rng.random((layers, experts)) < 0.5
        evict = rng.integers(0, layers * experts, draw(st.integers(0, 8)), dtype=np.int64)
        single = requests == 1 and draw(st.booleans())
        steps.append(Step(predicted, routed, resident, evict, draw(st.booleans()), single))
    return Scenario(layers, experts, nbytes, decay, steps)


def _feed(acc: native.RouteAheadAccumulator | RouteAheadReference, step: Step) -> int:
    p, u = step.predicted, step.routed
    if step.single:
        p, u = p[0], u[0]
    if step.as_bitsets:
        res = None if step.resident is None else native.pack_masks(step.resident)
        acc.update_bitsets(native.pack_masks(p), native.pack_masks(u), res)
    else:
        acc.update_masks(p, u, step.resident)
    return int(acc.record_eviction(step.evict))


def test_counter_names_agree() -> None:
    assert native.COUNTER_NAMES == REF_NAMES


def _check_against_reference(sc: Scenario) -> None:
    fast = native.RouteAheadAccumulator(sc.layers, sc.experts, sc.nbytes, sc.decay)
    slow = RouteAheadReference(sc.layers, sc.experts, sc.nbytes, sc.decay)
    for step in sc.steps:
        assert _feed(fast, step) == _feed(slow, step)
        np.testing.assert_array_equal(fast.counters(), slow.counters())
        np.testing.assert_array_equal(fast.pending(), slow.pending())
        # float32 (native) against float64 (reference) of the same recurrence
        np.testing.assert_allclose(fast.frequency(), slow.frequency(), rtol=1e-5, atol=1e-5)
        assert (fast.steps, fast.requests) == (slow.steps, slow.requests)


@given(scenarios())
def test_native_equals_reference(sc: Scenario) -> None:
    _check_against_reference(sc)


@given(scenarios())
def test_portable_popcount_equals_reference(sc: Scenario) -> None:
    """POPCNT is chosen at run time; the portable popcount (what a CPU
    without the instruction runs) must give the same counters."""
    detected = native.uses_popcnt_instruction()
    native._set_popcnt_instruction(False)
    try:
        assert not native.uses_popcnt_instruction()
        _check_against_reference(sc)
    finally:
        native._set_popcnt_instruction(True)
    assert native.uses_popcnt_instruction() == detected


def _table(acc: native.RouteAheadAccumulator) -> dict[str, npt.NDArray[np.int64]]:
    return dict(zip(native.COUNTER_NAMES, acc.counters(), strict=True))


@given(scenarios())
def test_counter_invariants(sc: Scenario) -> None:
    acc = native.RouteAheadAccumulator(sc.layers, sc.experts, sc.nbytes, sc.decay)
    before = acc.counters()
    for step in sc.steps:
        _feed(acc, step)
        t = _table(acc)
        for prefix in ("req_", ""):
            for sfx in ("", "_bytes"):
                hits, wasted, missed = (
                    t[f"{prefix}{n}{sfx}"] for n in ("hits", "wasted", "missed")
                )
                np.testing.assert_array_equal(hits + missed, t[f"{prefix}routed{sfx}"])
                np.testing.assert_array_equal(hits + wasted, t[f"{prefix}predicted{sfx}"])
        for sfx in ("", "_bytes"):
            issued = t[f"prefetch_issued{sfx}"]
            np.testing.assert_array_equal(
                t[f"prefetch_used{sfx}"] + t[f"prefetch_unused{sfx}"], issued
            )
            # routed = resident | prefetched-and-used | demand load (a partition)
            np.testing.assert_array_equal(
                t[f"resident_routed{sfx}"] + t[f"prefetch_used{sfx}"] + t[f"demand_loads{sfx}"],
                t[f"routed{sfx}"],
            )
            # an unused prefetch is pending, late-used or evicted before use, never twice
            assert (
                t[f"late_used{sfx}"] + t[f"evicted_before_use{sfx}"] <= t[f"prefetch_unused{sfx}"]
            ).all()
        # the batch scope is the union: it never holds more than the requests' sum
        # (its hits may: request 1's prediction can hit request 2's routing)
        assert (t["predicted"] <= t["req_predicted"]).all()
        assert (t["routed"] <= t["req_routed"]).all()
        if isinstance(sc.nbytes, int):
            for name in native.COUNTER_NAMES[: len(native.COUNTER_NAMES) // 2]:
                np.testing.assert_array_equal(t[f"{name}_bytes"], t[name] * sc.nbytes)
        now = acc.counters()
        assert (now >= before).all(), "counters must be monotone"
        before = now
        assert (acc.frequency() >= 0).all()


def test_resident_demand_prefetch_partition() -> None:
    # One layer, 8 experts, every combination of (predicted, routed, resident).
    bits = np.array([[(i >> s) & 1 for i in range(8)] for s in range(3)], dtype=bool)
    predicted, routed, resident = bits[0][None], bits[1][None], bits[2][None]
    acc = native.RouteAheadAccumulator(1, 8, 10)
    acc.update_masks(predicted, routed, resident)
    t = {k: int(v[0]) for k, v in _table(acc).items()}
    # expert i: predicted = bit0, routed = bit1, resident = bit2
    assert t["hits"] == 2 and t["wasted"] == 2 and t["missed"] == 2
    assert t["resident_routed"] == 2  # i in {6, 7}
    assert t["prefetch_issued"] == 2  # predicted, not resident: {1, 3}
    assert t["prefetch_used"] == 1  # {3}
    assert t["prefetch_unused"] == 1  # {1}
    assert t["demand_loads"] == 1  # routed, not predicted, not resident: {2}
    assert t["demand_loads_bytes"] == 10
    np.testing.assert_array_equal(acc.pending()[0], np.arange(8) == 1)
    # expert 1 is routed in the next step: late use, no longer pending
    nxt = np.zeros((1, 8), dtype=bool)
    routed2 = nxt.copy()
    routed2[0, 1] = True
    acc.update_masks(nxt, routed2, resident | (np.arange(8) == 1))
    t = {k: int(v[0]) for k, v in _table(acc).items()}
    assert t["late_used"] == 1 and not acc.pending().any()
    assert acc.record_eviction(np.array([1])) == 0  # used: not waste


def test_eviction_before_use_counts_once() -> None:
    acc = native.RouteAheadAccumulator(2, 4, np.array([[1, 2, 3, 4], [5, 6, 7, 8]]))
    predicted = np.zeros((2, 4), dtype=bool)
    predicted[1, 2] = predicted[0, 0] = True
    acc.update_masks(predicted, np.zeros((2, 4), dtype=bool))
    assert acc.record_eviction(np.array([6, 6, 0, 3])) == 7 + 1
    assert acc.record_eviction(np.array([6])) == 0
    t = _table(acc)
    assert t["evicted_before_use"].tolist() == [1, 1]
    assert t["evicted_before_use_bytes"].tolist() == [1, 7]


def test_frequency_decays_and_counts_requests() -> None:
    acc = native.RouteAheadAccumulator(1, 3, 1, decay=0.5)
    routed = np.array([[[1, 0, 0]], [[1, 1, 0]]], dtype=bool)  # 2 requests
    acc.update_masks(np.zeros_like(routed), routed)
    np.testing.assert_allclose(acc.frequency(), [[2.0, 1.0, 0.0]])
    acc.update_masks(np.zeros((1, 3), bool), np.array([[0, 0, 1]], bool))
    np.testing.assert_allclose(acc.frequency(), [[1.0, 0.5, 1.0]])


def test_reset_is_explicit_and_complete() -> None:
    acc = native.RouteAheadAccumulator(2, 5, 3)
    m = np.ones((2, 5), dtype=bool)
    acc.update_masks(m, ~m)
    assert acc.counters().any() and acc.pending().any() and acc.steps == 1
    acc.reset()
    assert not acc.counters().any() and not acc.pending().any()
    assert not acc.frequency().any() and acc.steps == 0 and acc.requests == 0


def test_pack_masks_bit_layout() -> None:
    mask = np.zeros((2, 130), dtype=bool)
    mask[0, [0, 63, 64, 129]] = True
    mask[1, 5] = True
    packed = native.pack_masks(mask)
    assert packed.shape == (2, 3) and packed.dtype == np.uint64
    assert packed[0].tolist() == [1 | (1 << 63), 1, 2]
    assert packed[1].tolist() == [1 << 5, 0, 0]
    assert native.words_per_layer(130) == 3


def test_routed_bitsets_from_topk() -> None:
    # 2 layers, 3 tokens of requests [1, -1, 1], top-2 over 70 experts
    topk = np.array([[[0, 69], [5, 6], [1, 69]], [[3, 4], [7, 8], [3, 65]]], dtype=np.int64)
    bits = native.routed_bitsets_from_topk(topk, np.array([1, -1, 1]), 2, 70)
    assert bits.shape == (2, 2, 2)
    assert not bits[0].any()
    expect = np.zeros((2, 70), dtype=bool)
    expect[0, [0, 1, 69]] = True
    expect[1, [3, 4, 65]] = True
    np.testing.assert_array_equal(bits[1], native.pack_masks(expect))
    with pytest.raises(ValueError, match="expert id 70"):
        native.routed_bitsets_from_topk(topk + 1, np.array([1, -1, 1]), 2, 70)
    with pytest.raises(ValueError, match="expert id -1"):
        native.routed_bitsets_from_topk(topk - 1, np.array([1, -1, 1]), 2, 70)
    with pytest.raises(ValueError, match="token_request 2"):
        native.routed_bitsets_from_topk(topk, np.array([1, 2, 1]), 2, 70)
    with pytest.raises(ValueError, match="token_request -2"):
        native.routed_bitsets_from_topk(topk, np.array([1, -2, 1]), 2, 70)
    with pytest.raises(TypeError, match="int64"):
        native.routed_bitsets_from_topk(topk.astype(np.int32), np.array([1, -1, 1]), 2, 70)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(predicted=np.zeros((3, 4), bool)), r"predicted must have shape \(2, 4\)"),
        (dict(routed=np.zeros((2, 2, 4), bool)), "predicted has 1 requests but routed has 2"),
        (dict(resident=np.zeros((2, 5), bool)), r"resident must have shape \(2, 4\)"),
        (dict(predicted=np.zeros((2, 4), np.int32)), "bool or uint8 mask, got dtype int32"),
    ],
)
def test_bad_masks_raise_and_record_nothing(kwargs: dict[str, object], match: str) -> None:
    acc = native.RouteAheadAccumulator(2, 4, 1)
    args: dict[str, object] = dict(
        predicted=np.ones((2, 4), bool), routed=np.ones((2, 4), bool), resident=None
    )
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=match):
        acc.update_masks(**args)
    assert not acc.counters().any() and acc.steps == 0


def test_bad_bitsets_and_ids_raise_and_record_nothing() -> None:
    acc = native.RouteAheadAccumulator(2, 4, 1)
    good = np.zeros((2, 1), np.uint64)
    stray = good.copy()
    stray[1, 0] = 1 << 4
    with pytest.raises(ValueError, match="bits set beyond expert 3"):
        acc.update_bitsets(stray, good)
    with pytest.raises(TypeError, match="uint64"):
        acc.update_bitsets(good.astype(np.int64), good)
    with pytest.raises(ValueError, match=r"expert id 8 out of range \[0, 8\)"):
        acc.record_eviction(np.array([1, 8]))
    with pytest.raises(TypeError, match="integers"):
        acc.record_eviction(np.array([1.0]))
    assert not acc.counters().any() and acc.steps == 0


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, 4, 1), "num_layers must be positive, got 0"),
        ((2, 0, 1), "num_experts must be positive, got 0"),
        ((2, 4, -1), "expert_nbytes must be >= 0"),
        ((2, 4, np.ones((2, 3), np.int64)), r"shape \(2, 4\), got shape \(2, 3\)"),
        ((2, 4, 1.5), "expert_nbytes must be integers"),
    ],
)
def test_constructor_rejects(args: tuple[object, ...], match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        native.RouteAheadAccumulator(*args)


def test_constructor_rejects_decay() -> None:
    with pytest.raises(ValueError, match="decay must be in"):
        native.RouteAheadAccumulator(1, 1, 1, decay=0.0)
