"""The weighted ahead plan (``--host-ahead weighted``, pdflash.hybrid.planner,
"The ahead plan"): before a verify each route-ahead predicted expert is
planned as routed with the run's measured probability ``p``
(:class:`RoutedFraction`), its host time weighted by ``p`` and its tokens
if routed ``expected / p``; ``certain`` (the default) plans ``p = 1``.

On issue 16's recorded c=4 case (the host costs of H200 session 10, the
fixtures of test_planner_recorded.py) and the measured routed fraction of
the ahead plans' HOST experts there (0.69-0.78), the weighted plan hosts
more of the predicted experts, within the planner's caps."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdflash.hybrid import (
    HOST_AHEAD_CHOICES,
    AheadObservingMissPlanner,
    ForcedHostPlanner,
    HostExpertExecutor,
    HostExpertService,
)
from pdflash.hybrid.cost import HostCostModel
from pdflash.hybrid.planner import (
    DEFAULT_ROUTED_FLOOR,
    DEFAULT_ROUTED_PRIOR_WEIGHT,
    CostModelPlanner,
    LinkState,
    RoutedFraction,
)

# the recorded case's constants, from its own test module (tests are not a
# package; pytest imports them by path)
_spec = importlib.util.spec_from_file_location(
    "_test_planner_recorded", Path(__file__).with_name("test_planner_recorded.py")
)
assert _spec is not None and _spec.loader is not None
_recorded = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_recorded)
EXPERT_NBYTES: int = _recorded.EXPERT_NBYTES
LINK_BYTES_PER_S: float = _recorded.LINK_BYTES_PER_S
RECORDED: dict[str, HostCostModel] = _recorded.RECORDED

PER_COPY_S = EXPERT_NBYTES / LINK_BYTES_PER_S


def _ahead_case(
    tokens_per_request: int, n: int, seed: int, requests: int = 4, predicted: int = 10
) -> tuple[np.ndarray, np.ndarray]:
    """``n`` layers' route-ahead expectations at c=4 as the engine builds
    them (:meth:`pdflash.engine.Engine._plan_host_ahead`): each request
    spreads its ``tokens x top_k`` (top-4) rows evenly over the ``predicted``
    experts it is predicted to use in a layer of 32, 6 of them resident
    (cache 0.2): ~20 predicted non-resident experts per layer."""
    rng = np.random.default_rng(seed)
    expected = np.zeros((n, 32))
    resident = np.zeros((n, 32), dtype=np.bool_)
    for layer in range(n):
        for _ in range(requests):
            expected[layer, rng.choice(32, predicted, replace=False)] += (
                tokens_per_request * 4 / predicted
            )
        resident[layer, rng.choice(32, 6, replace=False)] = True
    return expected, resident


def _planner(cost: HostCostModel, ahead: str, fraction: RoutedFraction) -> CostModelPlanner:
    return CostModelPlanner(
        cost, EXPERT_NBYTES, online=False, ahead=ahead, routed_fraction=fraction
    )


def _measured(routed_share: float) -> RoutedFraction:
    """The fraction after a run's worth of ahead plans (1000 HOST experts
    seen) routed ``routed_share`` of them."""
    f = RoutedFraction()
    f.observe(1000, round(1000 * routed_share))
    return f


@pytest.mark.parametrize("model", sorted(RECORDED))
@pytest.mark.parametrize("tokens_per_request", [5, 13])  # the runs' mean widths: 4 and 12 drafts
@pytest.mark.parametrize("routed_share", [0.69, 0.78])  # the recorded ahead outcome (calls 3, 5)
def test_weighted_hosts_more_of_the_predicted_experts_within_the_caps(
    model: str, tokens_per_request: int, routed_share: float
) -> None:
    cost = RECORDED[model]
    expected, resident = _ahead_case(tokens_per_request, 60, seed=tokens_per_request)
    link = LinkState(LINK_BYTES_PER_S)
    fraction = _measured(routed_share)
    p = fraction.value
    assert 0.69 <= p <= 0.8  # the prior (1.0, 64 experts) moves it a little
    certain = _planner(cost, "certain", fraction).plan_ahead(expected, resident, link)
    weighted_planner = _planner(cost, "weighted", fraction)
    weighted = weighted_planner.plan_ahead(expected, resident, link)
    predicted = (expected > 0) & ~resident
    assert not (certain & ~predicted).any() and not (weighted & ~predicted).any()
    assert 18 <= predicted.sum(axis=1).mean() <= 22
    # more of the predicted experts hosted over the 60 layers (fewer copied ahead)
    assert weighted.sum() > certain.sum()
    # and every one it hosts is within the caps as the rule weighs them: its
    # expected host time at most max_host_ratio x its copy's expected value,
    # at most max_host_tokens if routed
    tokens_if_routed = np.maximum(1.0, np.ceil(expected[weighted] / p))
    expected_host = p * np.asarray(cost.expert_s(tokens_if_routed))
    ratio = weighted_planner.max_host_ratio
    assert (expected_host <= ratio * p * PER_COPY_S).all()
    assert weighted_planner.max_host_tokens is not None
    assert (tokens_if_routed <= weighted_planner.max_host_tokens).all()


@pytest.mark.parametrize("model", sorted(RECORDED))
@pytest.mark.parametrize("tokens_per_request", [1, 5, 13, 40])
def test_routed_fraction_one_is_exactly_certain(model: str, tokens_per_request: int) -> None:
    cost = RECORDED[model]
    expected, resident = _ahead_case(tokens_per_request, 30, seed=tokens_per_request + 7)
    # the link's queue is not the ahead plan's to see: both replace it by 0
    link = LinkState(LINK_BYTES_PER_S, ahead_bytes=3 * EXPERT_NBYTES)
    all_routed = RoutedFraction()
    all_routed.observe(500, 500)
    assert all_routed.value == 1.0
    for fraction in (RoutedFraction(), all_routed):  # the prior alone, and measured 1.0
        certain = _planner(cost, "certain", fraction).plan_ahead(expected, resident, link)
        weighted = _planner(cost, "weighted", fraction).plan_ahead(expected, resident, link)
        assert np.array_equal(certain, weighted)
    # the certain rule ignores the measured fraction altogether
    low = _measured(0.3)
    assert np.array_equal(
        _planner(cost, "certain", low).plan_ahead(expected, resident, link),
        _planner(cost, "certain", RoutedFraction()).plan_ahead(expected, resident, link),
    )


def test_at_the_floor_wide_verifies_cross_the_caps() -> None:
    """The caps read the tokens if routed, ``expected / p``: at 13 tokens per
    request (12 drafts) and ``p`` at the floor, the noisy calibration's
    per-token cost puts every predicted expert past ``max_host_ratio`` and
    the weighted plan hosts none, where ``certain`` hosts ~9 a layer (the
    module doc's caveat)."""
    cost = RECORDED["noisy_calibration"]
    expected, resident = _ahead_case(13, 60, seed=13)
    link = LinkState(LINK_BYTES_PER_S)
    floor = RoutedFraction()
    floor.observe(10_000, 0)
    assert floor.value == DEFAULT_ROUTED_FLOOR
    certain = _planner(cost, "certain", floor).plan_ahead(expected, resident, link)
    weighted = _planner(cost, "weighted", floor).plan_ahead(expected, resident, link)
    assert certain.sum(axis=1).mean() > 5
    assert weighted.sum() == 0


@given(
    expected=st.lists(st.floats(0.05, 40.0), min_size=1, max_size=24),
    a_us=st.floats(50.0, 2000.0),
    p_low=st.floats(DEFAULT_ROUTED_FLOOR, 1.0),
    p_high=st.floats(DEFAULT_ROUTED_FLOOR, 1.0),
    roundtrip_us=st.floats(0.0, 500.0),
)
@settings(deadline=None)
def test_a_lower_routed_fraction_never_hosts_fewer_at_a_flat_host_cost(
    expected: list[float], a_us: float, p_low: float, p_high: float, roundtrip_us: float
) -> None:
    """With a host cost flat in tokens (the recorded end-of-run fit) and no
    caps, an expert's expected host time is ``p x a``: the less likely the
    predicted experts are routed, the more of them the plan hosts. (With the
    caps on this can fail: ``expected / p`` pushes an expert past
    ``max_host_tokens``.)"""
    p_low, p_high = sorted((p_low, p_high))
    cost = HostCostModel(a_us * 1e-6, 0.0, roundtrip_s=roundtrip_us * 1e-6)
    exp = np.asarray([expected])
    resident = np.zeros(exp.shape, dtype=np.bool_)
    link = LinkState(LINK_BYTES_PER_S)
    counts = []
    for p in (p_low, p_high):
        planner = CostModelPlanner(
            cost,
            EXPERT_NBYTES,
            online=False,
            max_host_ratio=1e9,
            max_host_tokens=None,
            ahead="weighted",
            routed_fraction=RoutedFraction(prior=p, floor=DEFAULT_ROUTED_FLOOR),
        )
        counts.append(int(planner.plan_ahead(exp, resident, link).sum()))
    assert counts[0] >= counts[1]


# -- the measured fraction -----------------------------------------------------------


def test_routed_fraction_prior_and_floor() -> None:
    f = RoutedFraction()
    # nothing measured: the prior (today's plan, p = 1)
    assert f.value == 1.0 and f.prior_weight == DEFAULT_ROUTED_PRIOR_WEIGHT
    # a first layer that routed none of its 4 planned HOST experts barely moves it
    f.observe(4, 0)
    assert f.value == pytest.approx(64 / 68)
    # a run's worth pulls it to the measurement: (730 + 64) / (1000 + 64)
    f.observe(996, 730)
    assert f.value == pytest.approx(794 / 1064)
    # never below the floor, however bad the run
    g = RoutedFraction()
    g.observe(10_000, 100)
    assert g.value == DEFAULT_ROUTED_FLOOR
    # without a prior weight: the raw fraction once something is seen
    h = RoutedFraction(prior=0.9, prior_weight=0.0, floor=0.1)
    assert h.value == 0.9
    h.observe(10, 3)
    assert h.value == pytest.approx(0.3)
    assert h.to_json() == {
        "value": pytest.approx(0.3),
        "seen": 10,
        "routed": 3,
        "prior": 0.9,
        "prior_weight": 0.0,
        "floor": 0.1,
    }


@pytest.mark.parametrize(
    "kw",
    [
        {"floor": 0.0},
        {"floor": 1.5},
        {"prior": 0.4},  # below the default floor
        {"prior": 1.1},
        {"prior_weight": -1.0},
        {"prior_weight": math.inf},
        {"seen": 2, "routed": 3},
    ],
)
def test_routed_fraction_refuses_bad_settings(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        RoutedFraction(**kw)


def test_routed_fraction_refuses_a_bad_observation_unchanged() -> None:
    f = RoutedFraction()
    f.observe(10, 7)
    for seen, routed in ((3, 4), (-1, 0), (2, -1)):
        with pytest.raises(ValueError):
            f.observe(seen, routed)
    assert (f.seen, f.routed) == (10, 7)


# -- the service feeds it --------------------------------------------------------------


class _Cache:
    def __init__(self, n: int) -> None:
        self.slot_of = np.full(n, -1, dtype=np.int64)
        self.ticket = np.zeros(0, dtype=np.int64)


class _AheadPlanner(ForcedHostPlanner):
    """Plans ``mask`` ahead and keeps what the service reports of it."""

    def __init__(self, mask: np.ndarray) -> None:
        super().__init__(every=1)
        self.mask = mask
        self.fraction = RoutedFraction(prior_weight=0.0, floor=0.01)
        self.reports: list[tuple[int, int]] = []

    def plan_ahead(self, expected_tokens, resident, link):  # type: ignore[no-untyped-def]
        return self.mask.copy()

    def observe_ahead(self, seen: int, routed: int) -> None:
        self.reports.append((seen, routed))
        self.fraction.observe(seen, routed)

    def ahead_fraction(self) -> dict[str, Any] | None:
        return self.fraction.to_json()


def _executor() -> HostExpertExecutor:
    return HostExpertExecutor(
        lambda g: {"w": torch.tensor(float(g + 1))},
        lambda x, w: x * w["w"],
        dtype=torch.float32,
        workers=1,
    )


def test_the_service_reports_each_layers_ahead_outcome_to_the_planner() -> None:
    layers, experts = 2, 8
    mask = np.zeros((layers, experts), dtype=np.bool_)
    mask[0, [1, 2, 3]] = True
    mask[1, [5]] = True
    planner = _AheadPlanner(mask)
    assert isinstance(planner, AheadObservingMissPlanner)
    with _executor() as ex:
        svc = HostExpertService(
            ex, planner, num_experts=experts, expert_nbytes=100, link_bytes_per_s=1e3
        )
        cache = _Cache(layers * experts)
        svc.plan_ahead(np.ones((layers, experts)), np.zeros((layers, experts), dtype=np.bool_))
        svc.split(0, np.array([1, 3, 4]), np.array([1, 1, 1]), cache)  # 2 of 3 routed
        svc.split(1, np.array([8 + 6]), np.array([2]), cache)  # 0 of 1
        svc.split(0, np.array([1]), np.array([1]), cache)  # the plan was used: no report
        assert planner.reports == [(3, 2), (1, 0)]
        assert svc.describe()["ahead_fraction"]["value"] == pytest.approx(0.5)
        # the books agree with what the planner was told
        assert svc.describe()["ahead_outcome"]["seen"] == 4
        assert svc.describe()["ahead_outcome"]["routed"] == 2


def test_a_planner_without_the_fraction_records_none() -> None:
    class _Plain(ForcedHostPlanner):
        def plan_ahead(self, expected_tokens, resident, link):  # type: ignore[no-untyped-def]
            out = np.zeros(np.asarray(resident).shape, dtype=np.bool_)
            out[0, 1] = True
            return out

    plain = _Plain(every=1)
    assert not isinstance(plain, AheadObservingMissPlanner)
    with _executor() as ex:
        svc = HostExpertService(ex, plain, num_experts=4, expert_nbytes=100, link_bytes_per_s=1e3)
        svc.plan_ahead(np.ones((1, 4)), np.zeros((1, 4), dtype=np.bool_))
        svc.split(0, np.array([1]), np.array([1]), _Cache(4))
        assert svc.describe()["ahead_fraction"] is None
        assert svc.describe()["ahead_outcome"]["routed"] == 1


def test_the_cost_model_planner_records_its_rule_and_fraction() -> None:
    cost = RECORDED["quiet_calibration"]
    p = _planner(cost, "weighted", RoutedFraction())
    assert p.params()["ahead"] == "weighted"
    p.observe_ahead(10, 5)
    assert p.ahead_fraction() == p.routed_fraction.to_json()
    assert p.routed_fraction.seen == 10
    assert CostModelPlanner(cost, EXPERT_NBYTES).params()["ahead"] == "certain"
    with pytest.raises(ValueError, match="ahead"):
        CostModelPlanner(cost, EXPERT_NBYTES, ahead="sometimes")


# -- the switch ----------------------------------------------------------------------


def test_the_run_setting_is_validated_keyed_and_spelled_by_the_clis() -> None:
    import argparse

    from pdflash.bench.engine_run import RunSpec, run_spec
    from pdflash.bench.suites import engine, matrix

    from pdflash.report.schema import RUN_SETTINGS, spec_settings

    assert HOST_AHEAD_CHOICES == ("certain", "weighted")
    assert RunSpec(arch="tiny-qwen3_moe", baseline="PD+host").host_ahead == "certain"
    with pytest.raises(ValueError, match="host_ahead"):
        run_spec(RunSpec(arch="tiny-gpt_oss", baseline="PD+host", host_ahead="sometimes"))
    ap = argparse.ArgumentParser()
    engine.add_arguments(ap)
    assert ap.parse_args([]).host_ahead == "certain"
    assert ap.parse_args(["--host-ahead", "weighted"]).host_ahead == "weighted"
    with pytest.raises(SystemExit):
        ap.parse_args(["--host-ahead", "sometimes"])
    assert matrix.HOST_DEFAULTS["host_ahead"] == "certain"
    (setting,) = [s for s in RUN_SETTINGS if s.name == "host_ahead"]
    assert setting.default == "certain" and setting.recorded is not None
    # a row records the rule its planner ran with; no service, or a planner
    # that records none (older, or forced): certain
    assert setting.recorded({"host_service": {"planner": {"ahead": "weighted"}}}) == "weighted"
    assert setting.recorded({"host_service": {"planner": {"planner": "forced"}}}) == "certain"
    assert setting.recorded({}) == "certain"
    # two specs apart only in the rule are two runs
    base = {"arch": "tiny", "baseline": "PD+host", "concurrency": 4, "cache_fraction": 0.2}
    assert spec_settings(base) == spec_settings({**base, "host_ahead": "certain"})
    assert spec_settings(base) != spec_settings({**base, "host_ahead": "weighted"})


def test_the_matrix_command_spells_a_non_default_rule() -> None:
    import argparse

    from pdflash.bench.suites import matrix

    ap = argparse.ArgumentParser()
    matrix.add_arguments(ap)
    plain = matrix.matrix_command(ap.parse_args([]), Path("/tmp/x"))
    assert "--host-ahead" not in plain
    weighted = matrix.matrix_command(ap.parse_args(["--host-ahead", "weighted"]), Path("/tmp/x"))
    assert "--host-ahead weighted" in weighted


def test_build_host_service_refuses_an_unknown_rule() -> None:
    from pdflash.hybrid import build_host_service

    with pytest.raises(ValueError, match="host_ahead"):
        build_host_service(object(), link_bytes_per_s=1e9, host_ahead="sometimes")
