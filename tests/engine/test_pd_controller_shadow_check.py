"""The route-ahead gate's shadow check (``route_ahead_shadow_check``): at
route-ahead's turn while it must earn its way back, the controller first
runs it in shadow (its predictions counted, no copy made) for the gate's
``route_ahead_gate_steps`` steps with predictions; a batch precision below
the gate keeps it off with no paired probe, at or above it the must-earn
probe runs as before, and no shadow step enters a probe's pairs. Simulated
steps (``route_ahead_sim``: a shadow step is timed as an off one and
reports its predictions); then the engine on the tiny
offloaded target: a shadow step predicts and counts, and copies nothing."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from pdflash.engine.pd_controller import (
    ROUTE_AHEAD_GATE_PRECISION,
    ROUTE_AHEAD_GATE_STEPS,
    FixedParts,
    PartsState,
    PDController,
    StepMeasurement,
)

from .conftest import offloaded_pd_engine
from .route_ahead_sim import ra_decisions as _ra_decisions
from .route_ahead_sim import simulate
from .route_ahead_sim import step as _step

SHADOW_WHY = "kept off (imprecise in a shadow check"


def _checked(**kwargs: Any) -> PDController:
    # the check is opt-in (off by default)
    kwargs.setdefault("route_ahead_shadow_check", True)
    return PDController(route_ahead_gate=ROUTE_AHEAD_GATE_PRECISION, **kwargs)


def _runs(flags: list[bool]) -> list[tuple[int, int]]:
    """(start, length) of each run of True in ``flags``."""
    out, start = [], None
    for i, f in enumerate([*flags, False]):
        if f and start is None:
            start = i
        elif not f and start is not None:
            out.append((start, i - start))
            start = None
    return out


def _drive(
    ctl: PDController,
    steps: int,
    *,
    precision: float | list[float],
    ra_factor: float = 1.0,
    seed: int = 0,
    noise: float = 0.02,
    shadow_step: Callable[[StepMeasurement], StepMeasurement] | None = None,
) -> tuple[list[PartsState], list[StepMeasurement]]:
    """Run ``steps`` simulated steps (``precision`` per step where a list;
    a shadow step's measurement changed by ``shadow_step`` where given);
    after each, assert that no shadow step is in the probe's pairs. Returns
    the parts and the measurement of each step."""
    ctl.bind(PartsState())
    rng = np.random.default_rng(seed)
    seen, measured = [], []
    shadow_ids: set[int] = set()
    for i in range(steps):
        p = precision[i] if isinstance(precision, list) else precision
        parts = ctl.parts
        m = _step(parts, rng, precision=p, ra_factor=ra_factor, noise=noise)
        if parts.route_ahead_shadow:
            if shadow_step is not None:
                m = shadow_step(m)
            shadow_ids.add(id(m))
        seen.append(parts)
        measured.append(m)
        ctl.observe(m)
        paired = {id(x) for pair in ctl._pairs for x in (pair.a, pair.b)}
        if ctl._half is not None:
            paired.add(id(ctl._half))
        assert not paired & shadow_ids, f"a shadow step was paired (step {i})"
    return seen, measured


@pytest.mark.parametrize("seed", range(3))
def test_an_imprecise_gated_route_ahead_is_kept_off_by_its_shadow_check(seed: int) -> None:
    """Precision 0.4 where route-ahead costs 8% a step: gated off at the
    first decision, then at each later turn it runs in shadow (route-ahead
    off, the shadow on) for exactly the gate's steps and stays off with no
    paired probe: route-ahead never runs after the first decision."""
    ctl = _checked()
    seen, _ = _drive(ctl, 400, precision=0.4, ra_factor=1.08, seed=seed, noise=0.25)
    first, *later = _ra_decisions(ctl)
    assert first["switched"] and first["on"] is False
    on = [p.route_ahead for p in seen]
    shadow = [p.route_ahead_shadow for p in seen]
    assert not any(on[ROUTE_AHEAD_GATE_STEPS + 1 :])
    # a shadow step is route-ahead off
    assert all(not p.route_ahead for p in seen if p.route_ahead_shadow)
    runs = _runs(shadow)
    assert len(runs) >= 3 and all(n == ROUTE_AHEAD_GATE_STEPS for _, n in runs)
    # one decision a check, none switched, each with its numbers
    assert len(later) == len(runs)
    for d in later:
        why = str(d["why"])
        assert d["on"] is False and not d["switched"] and why.startswith(SHADOW_WHY)
        assert "precision of its predictions 0.4 " in why and "no paired probe" in why
        assert f"over {ROUTE_AHEAD_GATE_STEPS} steps with predictions in shadow" in why
        assert "must earn its way back" in why
    summary = ctl.summary()
    assert summary["route_ahead_shadow_steps"] == sum(shadow)
    assert summary["settings"]["route_ahead_shadow_check"] is True
    assert summary["switches"] == 1  # the first decision's


def test_the_shadow_check_costs_fewer_route_ahead_steps_than_the_probes() -> None:
    """The same workload without the check (the ablation): its must-earn
    probes run route-ahead in some of their steps; with it, none."""
    ablated = PDController(
        route_ahead_gate=ROUTE_AHEAD_GATE_PRECISION, route_ahead_shadow_check=False
    )
    off = simulate(ablated, precision=0.4, ra_factor=1.08, steps=400, seed=1, noise=0.25)
    on = simulate(_checked(), precision=0.4, ra_factor=1.08, steps=400, seed=1, noise=0.25)
    assert sum(off[ROUTE_AHEAD_GATE_STEPS + 1 :]) > 0
    assert sum(on[ROUTE_AHEAD_GATE_STEPS + 1 :]) == 0


@pytest.mark.parametrize("seed", range(3))
def test_a_precise_shadow_check_runs_the_paired_probe_without_its_steps(seed: int) -> None:
    """Gated off at precision 0.4; then its predictions turn precise (0.7)
    and route-ahead pays 10%: the next turn's shadow check reads them at or
    above the gate and the must-earn probe runs as before (no shadow step
    in its pairs: checked every step), switching route-ahead back on."""
    ctl = _checked()
    precision = [0.4] * 40 + [0.7] * 200
    seen, _ = _drive(ctl, 240, precision=precision, ra_factor=0.9, seed=seed)
    decisions = _ra_decisions(ctl)
    assert decisions[0]["on"] is False and decisions[0]["switched"]
    back = next(d for d in decisions if d["switched"] and d["on"])
    assert "pays again" in str(back["why"]) and "must earn" in str(back["why"])
    at = int(str(back["step"]))
    # a shadow check ran right before that probe, and none of its steps
    # ran route-ahead on
    shadow_runs = _runs([p.route_ahead_shadow for p in seen])
    before = [(s, n) for s, n in shadow_runs if s < at]
    assert before and before[-1][1] == ROUTE_AHEAD_GATE_STEPS
    start, n = before[-1]
    assert not any(p.route_ahead for p in seen[start : start + n])
    # the probe's first step after the check is its arm A (off), settling
    assert not seen[start + n].route_ahead_shadow and not seen[start + n].route_ahead
    assert not any(SHADOW_WHY in str(d["why"]) for d in decisions if int(str(d["step"])) > 40)
    assert ctl.configured.route_ahead


def test_a_shadow_check_without_predictions_runs_the_probe() -> None:
    """Shadow steps that name nothing (no prediction read): after twice the
    gate's steps the check gives way to the paired probe, as before."""
    ctl = _checked(warmup=0, hold=2, max_hold=2)

    def names_nothing(m: StepMeasurement) -> StepMeasurement:
        return dataclasses.replace(m, route_ahead_predicted=0, route_ahead_hits=0)

    seen, _ = _drive(ctl, 60, precision=0.3, shadow_step=names_nothing)
    runs = _runs([p.route_ahead_shadow for p in seen])[:2]  # the last may run past the end
    assert len(runs) == 2 and all(n == 2 * ROUTE_AHEAD_GATE_STEPS for _, n in runs)
    assert not any(SHADOW_WHY in str(d["why"]) for d in _ra_decisions(ctl))
    # the probe ran after each check: route-ahead on in some of its steps
    first_end = runs[0][0] + runs[0][1]
    assert any(p.route_ahead for p in seen[first_end:])


def test_shadow_steps_count_in_steps_that_admit_requests() -> None:
    """The precision needs no measured wall: shadow steps that admit
    requests (not measured) count toward the check, as the first
    decision's clear reading does."""
    ctl = _checked(warmup=0, hold=2, max_hold=2)

    def admits(m: StepMeasurement) -> StepMeasurement:
        return dataclasses.replace(m, admitted=1)

    seen, _ = _drive(ctl, 40, precision=0.3, shadow_step=admits)
    runs = _runs([p.route_ahead_shadow for p in seen])
    assert runs and all(n == ROUTE_AHEAD_GATE_STEPS for _, n in runs)
    assert all(str(d["why"]).startswith(SHADOW_WHY) for d in _ra_decisions(ctl)[1:])


def test_shadow_steps_refill_the_gates_window() -> None:
    """The shadow check's steps are steps with predictions: the gate's
    window (and the summary's precision) reads them."""
    ctl = _checked(warmup=0, hold=2, max_hold=2)
    _drive(ctl, 30, precision=[0.45] * 10 + [0.2] * 20)
    summary = ctl.summary()
    assert summary["route_ahead_shadow_steps"] > 0
    # no route-ahead step after the first decision: the shadow steps' 0.2
    assert summary["route_ahead_precision"] == pytest.approx(0.2)


def test_the_controller_is_never_at_rest_in_a_shadow_check() -> None:
    """A shadow step is measured (its predictions are the check's reading):
    the controller does not rest in one, and rests in the hold after."""
    ctl = _checked(warmup=0, hold=8, max_hold=8)
    ctl.bind(PartsState())
    rng = np.random.default_rng(0)
    shadow = rested = 0
    for _ in range(80):
        parts = ctl.parts
        if parts.route_ahead_shadow:
            shadow += 1
            assert not ctl.resting
        rested += ctl.resting
        ctl.observe(_step(parts, rng, precision=0.3, ra_factor=1.0))
    assert shadow > 0 and rested > 0


@pytest.mark.parametrize(
    ("precision", "kwargs", "available"),
    [
        (0.4, {}, PartsState()),  # gated: the check would run
        (0.4, {"route_ahead_cost_gate": True}, PartsState()),
        (0.7, {}, PartsState()),  # precise: never gated
        (0.4, {}, PartsState(host_experts=True)),  # the gate does not act
    ],
)
def test_the_ablation_never_runs_a_shadow_step(
    precision: float, kwargs: dict[str, Any], available: PartsState
) -> None:
    """``route_ahead_shadow_check=False`` runs no shadow step and decides as
    the gate did before the check: where no check would be due (precise
    predictions, a host part) the two settings run the same steps; where one
    is due they run the same steps up to its first shadow step."""

    def run(check: bool) -> tuple[list[PartsState], list[dict[str, Any]]]:
        ctl = _checked(route_ahead_shadow_check=check, **kwargs)
        ctl.bind(available)
        rng = np.random.default_rng(3)
        seen = []
        for _ in range(300):
            seen.append(ctl.parts)
            ctl.observe(
                _step(
                    ctl.parts,
                    rng,
                    precision=precision,
                    ra_factor=1.02,
                    host_s=1e-4,
                    copy_s=1e-5,
                    waits_s=1e-3,  # enough for the waits bound to let a probe run
                )
            )
        assert ctl.summary()["settings"]["route_ahead_shadow_check"] is check
        return seen, ctl.summary()["decisions"]

    ablated, ablated_decisions = run(False)
    checked, checked_decisions = run(True)
    assert not any(p.route_ahead_shadow for p in ablated)
    first = next((i for i, p in enumerate(checked) if p.route_ahead_shadow), None)
    if precision >= ROUTE_AHEAD_GATE_PRECISION or available.host_experts:
        assert first is None and checked == ablated and checked_decisions == ablated_decisions
    else:
        assert first is not None and checked[:first] == ablated[:first]
        # there the ablation's paired probe starts at once: its arm A (off)
        # where the check runs the shadow, then its arm B (on)
        assert ablated[first] == dataclasses.replace(checked[first], route_ahead_shadow=False)
        assert any(p.route_ahead for p in ablated[first : first + 4])
        assert not any(p.route_ahead for p in checked[first : first + 4])


def test_no_gate_no_shadow_check() -> None:
    """Without a gate the setting changes nothing: the check is the gate's."""
    runs = []
    for check in (True, False):
        ctl = PDController(route_ahead_shadow_check=check)
        runs.append(simulate(ctl, precision=0.3, ra_factor=1.08, steps=200, seed=2))
        assert ctl.summary()["route_ahead_shadow_steps"] == 0
    assert runs[0] == runs[1]


def test_a_shadow_state_is_masked_without_a_predictor() -> None:
    state = PartsState(route_ahead=False, route_ahead_shadow=True)
    assert state.shadows_route_ahead
    assert not state.masked(PartsState(route_ahead=False)).route_ahead_shadow
    assert state.masked(PartsState()).route_ahead_shadow
    # moot with route-ahead on
    assert not PartsState(route_ahead_shadow=True).shadows_route_ahead
    books = FixedParts(state)
    books.bind(PartsState())
    for _ in range(3):
        books.observe(StepMeasurement(wall_s=0.05, committed_tokens=1))
    summary = books.summary()
    assert summary["route_ahead_shadow_steps"] == 3
    assert summary["on_fraction"]["route_ahead"] == 0.0


# ------------------------------------------------------------------ engine
class _Watched(FixedParts):
    """Fixed parts; each step's measurement kept with the route-ahead
    bytes the engine's prefetcher had submitted by its end."""

    def __init__(self, parts: PartsState) -> None:
        super().__init__(parts)
        self.engine: Any = None
        self.measured: list[StepMeasurement] = []
        self.route_ahead_bytes: list[int] = []

    def observe(self, m: StepMeasurement) -> PartsState:
        self.measured.append(m)
        self.route_ahead_bytes.append(self.engine.prefetch.stats()["route_ahead_bytes_submitted"])
        return super().observe(m)


@dataclasses.dataclass
class _Run:
    engine: Any
    outputs: list[list[int]]
    #: each scheduled demand's ``predicted`` (what the scheduler saw)
    demanded: list[Any]
    #: the flat ids each call protected in the eviction policy
    protected: list[Any]


def _engine_run(offloaded: tuple[Any, list[Any]], policy: Any, **changes: Any) -> _Run:
    """The cases on a PD engine of the tiny offloaded target under
    ``policy`` (no gate lookahead: its copies go in the ROUTE_AHEAD band
    too; every draft verified), the scheduler's demands and the eviction
    policy's protections recorded."""
    tmp, cases = offloaded
    eng, issuer = offloaded_pd_engine(
        tmp, "PD", policy, lookahead=False, verify_width="full", **changes
    )
    try:
        policy.engine = eng
        demanded: list[Any] = []
        protected: list[Any] = []
        select = eng.batcher.select

        def recorded_select(demands: Any, resident: Any) -> Any:
            demanded.extend(d.predicted for d in demands)
            return select(demands, resident)

        eng.batcher.select = recorded_select
        evict = eng.expert_cache.policy
        set_predicted = evict.set_predicted

        def recorded_set_predicted(ids: Any) -> None:
            protected.append(np.asarray(ids))
            set_predicted(ids)

        evict.set_predicted = recorded_set_predicted
        ids = [eng.add_request(p, max_new_tokens=14) for p, _ in cases]
        done = eng.run_until_done(max_steps=400)
        outputs = [done[rid].output for rid in ids]
        assert outputs == [ref for _, ref in cases]  # lossless whatever the parts
        return _Run(eng, outputs, demanded, protected)
    finally:
        issuer.close()


ON = PartsState(route_ahead=True, scheduler_2d=False, stream=False)
OFF = PartsState(route_ahead=False, scheduler_2d=False, stream=False)
SHADOW = dataclasses.replace(OFF, route_ahead_shadow=True)


def test_a_shadow_step_predicts_and_counts_and_copies_nothing(
    offloaded: tuple[Any, list[Any]],
) -> None:
    """Route-ahead in shadow: the predictor runs and every verify counts its
    predictions against the routing (the steps' ``route_ahead_predicted`` /
    ``hits``) exactly as route-ahead on counts its own (the same batches,
    the same routing: the same counts), while no ROUTE_AHEAD byte is
    submitted, no demand names a predicted expert, nothing is protected
    from eviction and the stream plans nothing; route-ahead on does all of
    these, route-ahead off predicts nothing."""
    on = _engine_run(offloaded, _Watched(ON))
    shadow = _engine_run(offloaded, _Watched(SHADOW))
    off = _engine_run(offloaded, _Watched(OFF))
    eng = shadow.engine
    watched = eng.parts.policy
    assert eng.parts.applied == SHADOW and eng.route_ahead_shadow
    assert not eng.config.route_ahead and not eng.prefetch.route_ahead
    # predicted and counted
    assert eng.route_ahead_predicted_n > 0 and eng.route_ahead_hit_n > 0
    assert sum(m.route_ahead_predicted for m in watched.measured) == eng.route_ahead_predicted_n
    assert sum(m.route_ahead_hits for m in watched.measured) == eng.route_ahead_hit_n
    assert eng.timer.kind_s("predict") > 0.0
    assert sum(m.part_host_s["route_ahead"] for m in watched.measured) > 0.0
    # exactly as route-ahead on counts its predictions
    assert (eng.route_ahead_predicted_n, eng.route_ahead_hit_n) == (
        on.engine.route_ahead_predicted_n,
        on.engine.route_ahead_hit_n,
    )
    # ... and used by nothing
    assert set(watched.route_ahead_bytes) == {0}
    assert eng.prefetch.stats()["route_ahead_bytes_submitted"] == 0
    assert eng.prefetch.built_stream.bytes_submitted == 0
    assert shadow.demanded and all(p is None for p in shadow.demanded)
    assert all(ids.size == 0 for ids in shadow.protected)
    assert eng.host_ahead is None
    # route-ahead on: copies, demands and protections from its predictions
    assert on.engine.prefetch.stats()["route_ahead_bytes_submitted"] > 0
    assert any(p is not None and p.size for p in on.demanded)
    assert any(ids.size for ids in on.protected)
    # route-ahead off: no prediction
    assert off.engine.route_ahead_predicted_n == 0
    assert off.engine.timer.kind_s("predict") == 0.0
    assert off.engine.prefetch.stats()["route_ahead_bytes_submitted"] == 0


class _Logged(PDController):
    """The PD controller, each step's parts and measurement logged with the
    route-ahead bytes the engine had submitted by its end."""

    engine: Any = None

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.log: list[tuple[PartsState, StepMeasurement, int]] = []

    def observe(self, m: StepMeasurement) -> PartsState:
        copied = self.engine.prefetch.stats()["route_ahead_bytes_submitted"]
        self.log.append((self.parts, m, copied))
        return super().observe(m)


def test_the_engines_controller_runs_its_shadow_check_without_copies(
    offloaded: tuple[Any, list[Any]],
) -> None:
    """The PD controller over the engine, its gate at precision 1 (no
    prediction is that precise: route-ahead is gated off at the first
    decision): at route-ahead's next turn it runs in shadow, its steps
    report predictions and submit no ROUTE_AHEAD byte, and it stays off
    with the shadow check's decision."""
    ctl = _Logged(route_ahead_gate=1.0, route_ahead_shadow_check=True, warmup=0, hold=2, max_hold=2)
    _engine_run(offloaded, ctl)
    shadow = [(m, b) for parts, m, b in ctl.log if parts.shadows_route_ahead]
    assert shadow, "no shadow step ran"
    assert sum(m.route_ahead_predicted for m, _ in shadow) > 0
    first = next(i for i, (parts, _, _) in enumerate(ctl.log) if parts.shadows_route_ahead)
    copied_before = ctl.log[first - 1][2]
    assert all(b == copied_before for _, b in shadow)
    decisions = _ra_decisions(ctl)
    assert decisions[0]["switched"] and decisions[0]["on"] is False
    assert any(str(d["why"]).startswith(SHADOW_WHY) for d in decisions[1:])
    assert ctl.summary()["route_ahead_shadow_steps"] == sum(
        parts.shadows_route_ahead for parts, _, _ in ctl.log
    )
