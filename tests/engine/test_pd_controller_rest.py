"""The PD controller at rest (module docstring of
:mod:`pdflash.engine.pd_controller`, "Rest"): in a hold with route-ahead
and the host part off it reads of a step only that it ran, so the engine
skips the step's measurement. Differential: a controller fed rest steps
wherever it rests decides exactly as one fed every measurement; in an
engine, the rest steps leave the books' sums, the tokens and the
scheduler's executed choices as they were."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from pdflash.engine.pd_controller import (
    HOST_GATE_WINDOW,
    ROUTE_AHEAD_GATE_PRECISION,
    PartsState,
    PDController,
    RestingPolicy,
    RestStep,
    StepMeasurement,
)

from .conftest import offloaded_pd_engine


def _plant_step(
    parts: PartsState, rng: np.random.Generator, ra_factor: float = 1.01
) -> StepMeasurement:
    """Route-ahead whose host time (0.5 ms) no routed prediction can save
    (0.1 us copies) and that makes the step ``ra_factor`` as long, a host
    part that makes it 10% longer; one step in eight admits a request (not
    measured), with noisy walls."""
    wall = 0.05 * float(np.exp(rng.normal(0.0, 0.02)))
    wall *= ra_factor if parts.route_ahead else 1.0
    wall *= 1.1 if parts.host_experts else 1.0
    named = 200 if parts.route_ahead else 0
    host = 5e-4 if parts.route_ahead else 0.0
    return StepMeasurement(
        wall_s=wall,
        committed_tokens=4,
        verified_tokens=5,
        admitted=int(rng.random() < 0.125),
        exposed_fetch_s=0.01 * wall * float(rng.random()),
        route_ahead_predicted=named,
        route_ahead_hits=round(0.7 * named),
        part_host_s={"route_ahead": host},
        expert_copy_s=1e-7,
    )


def _drive(ctl: PDController, available: PartsState, steps: int, rest: bool) -> list[PartsState]:
    """Run ``steps`` plant steps; with ``rest`` a step where the controller
    rests is handed as a :class:`RestStep` (what the engine side does)."""
    ctl.bind(available)
    rng = np.random.default_rng(7)
    # with a host part the gate does not act: route-ahead goes off by its
    # probe, where it costs 30% a step
    ra_factor = 1.3 if available.host_experts else 1.01
    seen = []
    for _ in range(steps):
        seen.append(ctl.parts)
        m = _plant_step(ctl.parts, rng, ra_factor)
        if rest and ctl.resting:
            counted = m.verified and m.admitted == 0 and m.wall_s > 0
            ctl.rest_step(RestStep(m.wall_s, m.exposed_fetch_s, counted))
        else:
            ctl.observe(m)
    return seen


def _controller() -> PDController:
    return PDController(route_ahead_gate=ROUTE_AHEAD_GATE_PRECISION, route_ahead_cost_gate=True)


@pytest.mark.parametrize(
    "available",
    [PartsState(), PartsState(host_experts=True)],
    ids=["pd", "pd+host"],
)
def test_a_resting_controller_decides_as_one_that_reads_every_step(
    available: PartsState,
) -> None:
    measured, rested = _controller(), _controller()
    assert isinstance(rested, RestingPolicy)
    seen = _drive(measured, available, 400, rest=False)
    assert _drive(rested, available, 400, rest=True) == seen
    a, b = measured.summary(), rested.summary()
    assert b["rest_steps"] > 200 and a["rest_steps"] == 0
    assert a["step_sums"] == pytest.approx(b["step_sums"], rel=1e-12)
    for key in ("decisions", "on_fraction", "switches", "probes", "at_end", "steps"):
        assert a[key] == b[key], key
    # route-ahead was switched off (by its gate's cost bound; with a host
    # part, whose planner reads the predictions, by its probe) and every later
    # probe kept it off; the host part costs, so its probe switched it off
    ra = [d for d in b["decisions"] if d["part"] == "route_ahead"]
    assert ra[0]["switched"] and ra[0]["on"] is False
    assert all(not d["switched"] and d["on"] is False for d in ra[1:]) and len(ra) >= 3
    if available.host_experts:
        host = [d for d in b["decisions"] if d["part"] == "host_experts"]
        assert host[0]["switched"] and all(d["on"] is False for d in host)
        assert rested.rest_tail() == HOST_GATE_WINDOW
    else:
        assert rested.rest_tail() == 1


def test_the_controller_rests_only_in_a_hold_with_nothing_prefetching() -> None:
    ctl = _controller()
    ctl.bind(PartsState())
    # route-ahead runs, the gate's first decision is pending: no rest
    assert not ctl.resting
    with pytest.raises(RuntimeError, match="not at rest"):
        ctl.rest_step(RestStep(0.05, 0.0, True))
    rng = np.random.default_rng(0)
    states = []
    for _ in range(200):
        states.append((ctl.resting, ctl.parts, ctl._probing, ctl._settling))
        m = _plant_step(ctl.parts, rng)
        if ctl.resting:
            ctl.rest_step(RestStep(m.wall_s, m.exposed_fetch_s, m.admitted == 0))
        else:
            ctl.observe(m)
    assert any(r for r, *_ in states)
    for resting, parts, probing, settling in states:
        if resting:
            assert not parts.route_ahead and not probing and settling == 0
    # with route-ahead off the 2-D scheduler and the stream are never probed
    parts_probed = {d["part"] for d in ctl.summary()["decisions"]}
    assert parts_probed == {"route_ahead"}


def test_an_uncounted_rest_step_does_not_shorten_the_hold() -> None:
    ctl = _controller()
    _drive(ctl, PartsState(), 10, rest=True)
    while not ctl.resting:
        ctl.observe(_plant_step(ctl.parts, np.random.default_rng(1)))
    left = ctl._countdown
    ctl.rest_step(RestStep(0.05, 0.0, counted=False))
    assert ctl._countdown == left
    ctl.rest_step(RestStep(0.05, 0.0, counted=True))
    assert ctl._countdown == left - 1


# ------------------------------------------------------------------ engine
class _NeverRests(PDController):
    """The same controller, every step measured."""

    @property
    def resting(self) -> bool:
        return False


def _pd_engine(
    tmp: Any, controller: PDController, rest_batching: str = "scheduler"
) -> tuple[Any, Any]:
    # every draft verified: the adaptive width reads the (noisy) timing
    return offloaded_pd_engine(
        tmp, "PD", controller, verify_width="full", rest_batching=rest_batching
    )


def _run(
    offloaded: tuple[Any, list[Any]], controller: PDController, rest_batching: str = "scheduler"
) -> tuple[Any, list[Any]]:
    tmp, cases = offloaded
    eng, issuer = _pd_engine(tmp, controller, rest_batching)
    try:
        ids = [eng.add_request(p, max_new_tokens=14) for p, _ in cases]
        done = eng.run_until_done(max_steps=400)
        return eng, [done[rid].output for rid in ids]
    finally:
        issuer.close()


def _switching_off_route_ahead() -> dict[str, Any]:
    # route-ahead off by its gate's first decision (precision 1.0 is out of
    # reach), then one long hold: no decision reads the (noisy) timing, so
    # the two runs choose alike step by step
    return {"route_ahead_gate": 1.0, "warmup": 0, "hold": 1000, "max_hold": 1000}


def test_an_engine_at_rest_keeps_its_tokens_books_and_batches(
    offloaded: tuple[Any, list[Any]],
) -> None:
    rested, measured = (
        PDController(**_switching_off_route_ahead()),
        _NeverRests(**_switching_off_route_ahead()),
    )
    eng, out = _run(offloaded, rested)
    ref_eng, ref = _run(offloaded, measured)
    _, cases = offloaded
    assert out == ref == [want for _, want in cases]
    books, ref_books = rested.summary(), measured.summary()
    assert books["rest_steps"] > 0 and ref_books["rest_steps"] == 0
    # each run's books count its every step; the two runs' step counts are not
    # compared: the 2-D batcher splits by the bytes missing when it is asked,
    # which can depend on when the issuer's copies land (under load, 31
    # against 29 steps with the same tokens)
    assert books["steps"] == eng.steps and ref_books["steps"] == ref_eng.steps
    # the rest steps' walls and waits are in the books' sums: on the CPU
    # (nothing read late) the waits are the run's whole exposed fetch
    assert books["step_sums"]["exposed_fetch_s"] == pytest.approx(
        eng.timer.stall_s(), rel=1e-9, abs=1e-12
    )
    assert books["step_sums"]["wall_s"] > 0
    # at rest only the executed batcher ran; the steps it compared are the others
    shadow = eng.batcher
    assert shadow.uncompared_steps > 0
    assert shadow.steps + shadow.uncompared_steps == ref_eng.batcher.steps
    assert ref_eng.batcher.uncompared_steps == 0
    # the controller's acceptance estimates forget finished requests all the same
    assert eng.parts is not None and eng.parts.survival.request_ids() == []


def test_at_rest_the_engine_batches_first_come_and_pauses_its_scheduler(
    offloaded: tuple[Any, list[Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``rest_batching="first_come"`` (the default): the rest steps are
    batched by B1's rule over the waiting requests in arrival order, the
    configured batcher is not consulted in them, and the tokens are the
    target's greedy tokens all the same."""
    import pdflash.engine.engine as engine_module

    controller = PDController(**_switching_off_route_ahead())
    tmp, cases = offloaded
    eng, issuer = _pd_engine(tmp, controller, "first_come")
    consulted = [0]
    select = eng.batcher.select

    def counting(demands: Any, resident: Any) -> Any:
        consulted[0] += 1
        return select(demands, resident)

    eng.batcher.select = counting
    rest_steps: list[tuple[list[tuple[int, int]], list[tuple[int, int]]]] = []
    first_come = engine_module.first_come_grants

    def recording(demands: Any, token_budget: int) -> list[tuple[int, int]]:
        got = first_come(demands, token_budget)
        rest_steps.append(([(d.request_id, d.tokens) for d in demands], got))
        return got

    monkeypatch.setattr(engine_module, "first_come_grants", recording)
    try:
        ids = [eng.add_request(p, max_new_tokens=14) for p, _ in cases]
        steps = 0
        while eng.has_work:
            eng.step()
            steps += 1
        out = [eng.request(rid).output for rid in ids]
    finally:
        issuer.close()
    assert out == [want for _, want in cases]
    assert rest_steps and consulted[0] > 0  # both kinds of step ran
    # every scheduled step was either the batcher's or first-come
    assert consulted[0] + len(rest_steps) == len(eng.scheduler_us)
    assert consulted[0] == eng.batcher.steps + eng.batcher.uncompared_steps
    assert controller.summary()["rest_steps"] == len(rest_steps)
    budget = eng.config.token_budget
    for demands, got in rest_steps:
        ids_in_order = [rid for rid, _ in demands]
        assert ids_in_order == sorted(ids_in_order)  # arrival order (ids are given in it)
        left, want = budget, []
        for rid, tokens in demands:  # B1's rule: whole grants, the last trimmed to fit
            if left <= 0:
                break
            want.append((rid, min(tokens, left)))
            left -= min(tokens, left)
        assert got == want


def test_an_aborted_request_leaves_no_estimate_at_rest(offloaded: tuple[Any, list[Any]]) -> None:
    """A request aborted while the controller rests (the hold outlasts the
    run: no measured step follows) leaves nothing in its acceptance
    estimates."""
    tmp, cases = offloaded
    controller = PDController(**_switching_off_route_ahead())
    eng, issuer = _pd_engine(tmp, controller)
    try:
        ids = [eng.add_request(p, max_new_tokens=14) for p, _ in cases]
        while eng.has_work and not (eng.parts is not None and eng.parts.resting):
            eng.step()
        assert eng.parts is not None and eng.parts.resting
        victim = next(rid for rid in ids if rid in eng.parts.survival.request_ids())
        assert eng.abort(victim)
        eng.step()
        assert eng.parts.resting and victim not in eng.parts.survival.request_ids()
        eng.run_until_done(max_steps=400)
        assert eng.parts.survival.request_ids() == []
    finally:
        issuer.close()


class _CountingTimer:
    """A stall timer whose every read is counted; ``stall()`` records a
    wait of ``ms`` (a version bump, as :class:`ComputeTimer`'s)."""

    def __init__(self) -> None:
        self.total = 0.0
        self.reads = 0
        self.stall_version = 0

    def stall(self, ms: float) -> None:
        self.stall_version += 1
        self.total += ms * 1e-3

    def stall_s_ready(self) -> float:
        self.reads += 1
        return self.total


def test_a_step_starts_from_the_last_steps_end_reading_while_no_wait_came_between() -> None:
    from types import SimpleNamespace

    from pdflash.engine.pd_controller import _stall_end, _stall_mark

    timer = _CountingTimer()
    parts: Any = SimpleNamespace(engine=SimpleNamespace(timer=timer), stall_reading=None)
    assert _stall_mark(parts) == 0.0 and timer.reads == 1  # nothing kept: read
    timer.stall(2.0)
    assert _stall_end(parts) == pytest.approx(2e-3) and timer.reads == 2
    # the next step's start: the end reading, no read
    assert _stall_mark(parts) == pytest.approx(2e-3) and timer.reads == 2
    timer.stall(1.0)
    assert _stall_end(parts) == pytest.approx(3e-3)
    # a wait recorded between the steps (or a reset): read again
    timer.stall(4.0)
    assert _stall_mark(parts) == pytest.approx(7e-3) and timer.reads == 4
    # a step that never reached its end keeps nothing for the next one
    assert parts.stall_reading is None
    assert _stall_mark(parts) == pytest.approx(7e-3) and timer.reads == 5


def test_the_compute_timers_stall_version_moves_with_each_wait_and_reset() -> None:
    import torch

    from pdflash.engine.timing import ComputeTimer

    timer = ComputeTimer(torch.device("cpu"))
    v0 = timer.stall_version
    with timer.forward("verify"), timer.stall("unclassified"):
        pass
    assert timer.stall_version == v0 + 1
    timer.reset()
    assert timer.stall_version == v0 + 2 and timer.stall_s_ready() == 0.0
