"""The PD controller's route-ahead gate (``route_ahead_gate``): route-ahead
whose predictions are mostly unrouted (batch precision below the gate) is
switched off by the gate's first decision, a few steps in, and must earn its
way back by must-earn probes; where its precision is at or above the gate it
is judged as before (default on), and the gate keeps watching its precision
until a probe of route-ahead switches it. With the cost bound, route-ahead
whose host time exceeds what its routed predictions could save (one
expert's copy each) is switched off the same way. Simulated steps: the
step's wall depends on whether route-ahead runs (``ra_factor``), with
multiplicative noise, and route-ahead's steps report the named/routed counts
of a precision, its host seconds and one expert's copy time."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from pdflash.engine.pd_controller import (
    ROUTE_AHEAD_COST_CLEAR,
    ROUTE_AHEAD_COST_CLEAR_STEPS,
    ROUTE_AHEAD_GATE_PRECISION,
    ROUTE_AHEAD_GATE_STEPS,
    ROUTE_AHEAD_GATE_WINDOW,
    ROUTE_AHEAD_IMPRECISE_PAIRS,
    ROUTE_AHEAD_WAITS_MIN_STEPS,
    ROUTE_AHEAD_WAITS_WINDOW,
    PartsState,
    PDController,
    StepMeasurement,
)

from .route_ahead_sim import NAMED, simulate
from .route_ahead_sim import ra_decisions as _ra_decisions
from .route_ahead_sim import step as _step


def _gated() -> PDController:
    return PDController(route_ahead_gate=ROUTE_AHEAD_GATE_PRECISION)


def _probed() -> PDController:
    """The gate without its shadow check (the ablation): a gated
    route-ahead's turn runs its paired must-earn probe at once, whatever its
    precision. The tests of that probe's rules below an imprecise gate
    (earning its way back, the early end) use it: with the check, an
    imprecise route-ahead is kept off before any probe
    (``test_pd_controller_shadow_check.py``)."""
    return PDController(route_ahead_gate=ROUTE_AHEAD_GATE_PRECISION, route_ahead_shadow_check=False)


def _bounded() -> PDController:
    return PDController(route_ahead_gate=ROUTE_AHEAD_GATE_PRECISION, route_ahead_cost_gate=True)


def test_the_gates_constants_and_arguments_are_checked() -> None:
    assert 0.0 < ROUTE_AHEAD_GATE_PRECISION <= 1.0
    assert 1 <= ROUTE_AHEAD_GATE_STEPS <= ROUTE_AHEAD_GATE_WINDOW
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="route_ahead_gate"):
            PDController(route_ahead_gate=bad)
    with pytest.raises(ValueError, match="route_ahead_gate_steps"):
        PDController(route_ahead_gate=0.5, route_ahead_gate_steps=ROUTE_AHEAD_GATE_WINDOW + 1)
    with pytest.raises(ValueError, match="route_ahead_gate_steps"):
        PDController(route_ahead_gate=0.5, route_ahead_gate_steps=0)
    with pytest.raises(ValueError, match="route_ahead_hits"):
        StepMeasurement(wall_s=0.1, committed_tokens=1, route_ahead_predicted=3, route_ahead_hits=4)
    with pytest.raises(ValueError, match="route_ahead_predicted"):
        StepMeasurement(wall_s=0.1, committed_tokens=1, route_ahead_predicted=-1)
    for bad_copy in (-1e-6, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="expert_copy_s"):
            StepMeasurement(wall_s=0.1, committed_tokens=1, expert_copy_s=bad_copy)
    with pytest.raises(ValueError, match="route_ahead_cost_gate"):
        PDController(route_ahead_cost_gate=True)


@pytest.mark.parametrize("seed", range(3))
def test_imprecise_route_ahead_is_switched_off_in_the_first_steps(seed: int) -> None:
    """Precision 0.4 (below the gate) where route-ahead costs 8% a step: off
    after the gate's first decision (its steps' readings), and the first
    round does not probe it (nor the stream, which needs it)."""
    ctl = _gated()
    on = simulate(ctl, precision=0.4, ra_factor=1.08, steps=60, seed=seed)
    first = _ra_decisions(ctl)[0]
    assert first["switched"] and first["on"] is False
    assert "gated" in str(first["why"]) and "0.4" in str(first["why"])
    assert int(str(first["step"])) <= max(ctl.warmup, ROUTE_AHEAD_GATE_STEPS)
    assert all(on[: ctl.warmup]) and not any(on[ROUTE_AHEAD_GATE_STEPS + 1 : 30])
    summary = ctl.summary()
    assert summary["route_ahead_precision"] == pytest.approx(0.4)
    assert summary["settings"]["route_ahead_gate"] == ROUTE_AHEAD_GATE_PRECISION
    # the first round probed nothing: with route-ahead off the scheduler's
    # choice has no byte dimension and the stream does not run
    first_round = [d for d in summary["decisions"] if int(str(d["step"])) < 30]
    assert {d["part"] for d in first_round} == {"route_ahead"}


def test_without_the_gate_route_ahead_runs_until_its_probe() -> None:
    """The same steps, no gate: route-ahead runs through the first round's
    earlier probes (the scheduler's, the stream's) until its own."""
    ctl = PDController()
    on = simulate(ctl, precision=0.4, ra_factor=1.08, steps=60)
    assert all(on[:20])
    assert ctl.summary()["settings"]["route_ahead_gate"] is None


@pytest.mark.parametrize("seed", range(3))
def test_precise_route_ahead_stays_on_and_is_probed_as_default_on(seed: int) -> None:
    """Precision 0.7 (at or above the gate) where route-ahead pays 10%: the
    gate keeps it on, its first-round probe judges it by the default-on
    rules (both, Bonferroni over the looks), and it runs nearly every step."""
    ctl = _gated()
    on = simulate(ctl, precision=0.7, ra_factor=0.9, steps=120, seed=seed)
    first, *later = _ra_decisions(ctl)
    assert not first["switched"] and first["on"] is True and "kept on (gate)" in str(first["why"])
    assert later and all(d["on"] is True for d in later)
    assert all("need mean > margin" in str(d["why"]) for d in later)
    assert sum(on) > 100


@pytest.mark.parametrize("seed", range(3))
def test_gated_route_ahead_earns_its_way_back_where_it_pays(seed: int) -> None:
    """Without the shadow check: precision 0.45 but route-ahead makes the
    step 30% shorter: gated off first, then its must-earn probe (a later
    round) shows the gain and switches it on; later probes still judge it
    as must-earn (precision below the gate) and keep it. (With the check it
    stays off: its precision is below the gate.)"""
    ctl = _probed()
    on = simulate(ctl, precision=0.45, ra_factor=0.7, steps=200, seed=seed)
    first, *later = _ra_decisions(ctl)
    assert first["switched"] and first["on"] is False
    back = [d for d in later if d["switched"] and d["on"] is True]
    assert back and "must earn by the route-ahead gate" in str(back[0]["why"])
    assert "pays again" in str(back[0]["why"])
    assert ctl.configured.route_ahead and sum(on[-60:]) > 50
    # it earned its place by its probe: the gate's watch does not override that
    assert not any("re-reading" in str(d["why"]) for d in later)


@pytest.mark.parametrize("seed", range(3))
def test_gated_route_ahead_that_costs_stays_off(seed: int) -> None:
    """Precision 0.4, route-ahead makes the step 5% longer: gated off, and
    its later must-earn probes keep it off (on only in their on-arm steps)."""
    ctl = _gated()
    on = simulate(ctl, precision=0.4, ra_factor=1.05, steps=200, seed=seed)
    first, *later = _ra_decisions(ctl)
    assert first["switched"] and first["on"] is False
    assert later and all(d["on"] is False for d in later)
    assert all("must earn" in str(d["why"]) for d in later)
    assert sum(on) < 40


@pytest.mark.parametrize("seed", range(4))
def test_an_imprecise_probe_at_one_request_ends_early(seed: int) -> None:
    """Precision 0.4 where route-ahead costs 8% a step, under one request's
    noise (25% a step, several times the effect): once gated off, each
    must-earn probe of route-ahead whose pairs do not show a gain ends after
    ROUTE_AHEAD_IMPRECISE_PAIRS pairs, so route-ahead runs in at most 3 of
    its steps (a settle and a measured step, then the next pair's measured
    step); a probe the noise lets show a gain judges on by its looks.
    Without the shadow check, which keeps such a route-ahead off before any
    probe."""
    ctl = _probed()
    on = simulate(ctl, precision=0.4, ra_factor=1.08, steps=400, seed=seed, noise=0.25)
    first, *later = _ra_decisions(ctl)
    assert first["switched"] and first["on"] is False
    early = [d for d in later if "ended early" in str(d["why"])]
    assert len(early) >= max(2, len(later) - 1)
    assert all(d["on"] is False and "must earn its way back" in str(d["why"]) for d in early)
    assert all(f"after {ROUTE_AHEAD_IMPRECISE_PAIRS} pairs" in str(d["why"]) for d in early)
    assert all("precision of its predictions 0.4 " in str(d["why"]) for d in early)
    # route-ahead's steps after the first decision: 3 per early probe, the
    # full probes' at most 2 per pair (settle and measured) of max_pairs
    full = len(later) - len(early)
    assert sum(on[ROUTE_AHEAD_GATE_STEPS + 1 :]) <= 3 * len(early) + 2 * ctl.max_pairs * full
    # full probes to the last look ran it in 36-40 of these steps (over 100
    # where the noise let one switch it on)
    assert sum(on) < 30


def _late_on_share(*, ra_factor: float, noise: float, seeds: int = 12) -> float:
    """The mean share of steps 200-399 route-ahead ran in, precision 0.45
    (gated off first), over ``seeds`` runs, without the shadow check (its
    probes judge it)."""
    shares = []
    for seed in range(seeds):
        on = simulate(
            _probed(), precision=0.45, ra_factor=ra_factor, steps=400, seed=seed, noise=noise
        )
        shares.append(sum(on[200:]) / 200)
    return float(np.mean(shares))


def test_the_early_end_keeps_a_modest_gain_and_drops_noise() -> None:
    """The screen at two pairs is the last look's own test (gain at p <
    earn_level): a 10% gain at a few requests' noise (5% a step) still earns
    route-ahead's way back in most late steps (0.86; a screen at alpha with
    the margin kept it on in 0.19 of them); where it changes nothing or
    costs 8% under one request's noise, noise switches it on in few (0.12
    and 0.06; full probes: 0.33 and 0.15)."""
    assert _late_on_share(ra_factor=0.9, noise=0.05) > 0.7
    assert _late_on_share(ra_factor=1.0, noise=0.25) < 0.2
    assert _late_on_share(ra_factor=1.08, noise=0.25) < 0.12


@pytest.mark.parametrize("seed", range(3))
def test_a_probe_whose_predictions_turned_precise_runs_in_full(seed: int) -> None:
    """Gated off at precision 0.4, then its predictions turn precise (0.7)
    and route-ahead pays 10%: the next probe reads its steps at or above
    the gate, does not end early, and switches route-ahead back on."""
    ctl = _gated()
    simulate(ctl, precision=0.4, ra_factor=1.05, steps=40, seed=seed)
    assert not ctl.configured.route_ahead
    before = len(_ra_decisions(ctl))
    rng = np.random.default_rng(seed + 20)
    for _ in range(200):
        ctl.observe(_step(ctl.parts, rng, precision=0.7, ra_factor=0.9))
    after = _ra_decisions(ctl)[before:]
    assert after and not any("ended early" in str(d["why"]) for d in after)
    back = next(d for d in after if d["switched"])
    assert back["on"] is True and "pays again" in str(back["why"])
    assert ctl.configured.route_ahead


def test_route_ahead_on_by_its_probe_below_the_gate_is_switched_off_early() -> None:
    """Route-ahead earned its way back at precision 0.45 (30% faster; without
    the shadow check, which would have kept it off); then it stops paying
    (1.0): a later probe whose pairs do not show a gain ends early and
    switches it off."""
    ctl = _probed()
    simulate(ctl, precision=0.45, ra_factor=0.7, steps=200, seed=1)
    assert ctl.configured.route_ahead
    before = len(_ra_decisions(ctl))
    rng = np.random.default_rng(5)
    for _ in range(300):
        ctl.observe(_step(ctl.parts, rng, precision=0.45, ra_factor=1.0))
    off = next(d for d in _ra_decisions(ctl)[before:] if d["switched"])
    assert off["on"] is False
    assert "switched off (imprecise, ended early" in str(off["why"])
    assert not ctl.configured.route_ahead


@pytest.mark.parametrize("seed", range(3))
def test_a_precision_that_falls_below_the_gate_switches_route_ahead_off(seed: int) -> None:
    """Kept on by the first decision (0.7) through the first round, then
    its predictions turn imprecise (0.3) at a cost (3%) its default-on
    probes would not show: the gate's watch switches it off once its window
    reads below the gate outside a probe (within the window's steps and at
    most one probe's length), and its later probes judge it as must-earn."""
    ctl = _gated()
    simulate(ctl, precision=0.7, ra_factor=1.0, steps=80, seed=seed)
    assert ctl.configured.route_ahead and ctl.rounds_done >= 1
    rng = np.random.default_rng(seed + 10)
    on = []
    for _ in range(200):
        on.append(ctl.parts.route_ahead)
        ctl.observe(_step(ctl.parts, rng, precision=0.3, ra_factor=1.03))
    off = next(d for d in _ra_decisions(ctl) if d["switched"])
    assert off["on"] is False
    assert "gated on re-reading" in str(off["why"])
    at = int(str(off["step"]))
    assert 80 < at <= 80 + ROUTE_AHEAD_GATE_WINDOW + 30
    later = [d for d in _ra_decisions(ctl) if int(str(d["step"])) > at]
    assert later and all("must earn" in str(d["why"]) for d in later)
    assert sum(on[60:]) < 70


@pytest.mark.parametrize("seed", range(3))
def test_a_steady_precision_above_the_gate_is_never_gated_on_re_reading(seed: int) -> None:
    """Precision 0.55 throughout (a window of it never reads below 0.5):
    the watch never switches route-ahead off."""
    ctl = _gated()
    on = simulate(ctl, precision=0.55, ra_factor=1.0, steps=200, seed=seed)
    assert not any("re-reading" in str(d["why"]) for d in _ra_decisions(ctl))
    assert sum(on) > 150


def test_no_predictions_do_not_hold_the_first_round_back() -> None:
    """Route-ahead on but naming nothing: after twice the gate's steps the
    first decision keeps it on (nothing read) and the first round starts."""
    ctl = _gated()
    ctl.bind(PartsState())
    for _ in range(40):
        ctl.observe(StepMeasurement(wall_s=0.05, committed_tokens=4, verified_tokens=4))
    first = _ra_decisions(ctl)[0]
    assert first["on"] is True and not first["switched"]
    assert first["step"] == 2 * ROUTE_AHEAD_GATE_STEPS
    assert "no step with route-ahead's predictions" in str(first["why"])
    assert ctl.summary()["route_ahead_precision"] is None
    # the first round ran: the scheduler's probe ended
    assert any(d["part"] == "scheduler_2d" for d in ctl.summary()["decisions"])


def test_restart_makes_the_first_decision_again() -> None:
    ctl = _gated()
    simulate(ctl, precision=0.3, ra_factor=1.0, steps=20)
    assert ctl.parts.route_ahead is False
    ctl.restart()
    assert ctl.parts.route_ahead is True and ctl.summary()["route_ahead_precision"] is None
    simulate(ctl, precision=0.9, ra_factor=1.0, steps=10)
    assert ctl.parts.route_ahead is True


def test_the_gate_does_not_act_with_a_host_part() -> None:
    """With a host part (whose planner reads route-ahead's predictions too)
    imprecise route-ahead is not gated: no gate decision, and its probes
    judge it as a default-on part."""
    ctl = _gated()
    ctl.bind(PartsState(host_experts=True))
    rng = np.random.default_rng(0)
    on = []
    for _ in range(40):
        on.append(ctl.parts.route_ahead)
        ctl.observe(_step(ctl.parts, rng, precision=0.3, ra_factor=1.0))
    assert all(on[:20])
    assert not any("gate" in str(d["why"]) for d in _ra_decisions(ctl))
    assert ctl.summary()["route_ahead_precision"] == pytest.approx(0.3)


# ---- the gate's cost bound (route_ahead_cost_gate)
# A step's 140 routed predictions (precision 0.7 of 200 named) could save at
# most 140 copies: 14 ms at 0.1 ms an expert, 14 us at 0.1 us.
PRECISE = 0.7


def _cheap_copies(
    ctl: PDController, *, steps: int, seed: int = 0, waits_s: float = 0.0
) -> list[bool]:
    """:func:`simulate` with precise predictions whose copies take 0.1 us
    against route-ahead's 0.5 ms of host time a step (1% longer steps), the
    steps waiting ``waits_s`` for copies."""
    return simulate(
        ctl,
        precision=PRECISE,
        ra_factor=1.01,
        steps=steps,
        seed=seed,
        host_s=5e-4,
        copy_s=1e-7,
        waits_s=waits_s,
    )


@pytest.mark.parametrize("seed", range(3))
def test_route_ahead_that_cannot_save_its_host_time_is_switched_off_first(seed: int) -> None:
    """Precise predictions of experts whose copies take 0.1 us (the whole
    step's routed predictions could save 14 us) against 0.5 ms of
    route-ahead's host time a step, which makes the step 1% longer: the
    bound switches it off at the gate's first decision, as soon as its
    reading is clear (500 ms against 14 us: from the second step, not the
    fourth); precision alone would keep it. Its later must-earn probes end
    as soon as their own on-arm steps read clear: route-ahead runs two
    steps a probe (a full must-earn probe ran it on 6-9). (The steps wait
    for copies, so the waits bound does not skip the probes.)"""
    ctl = _bounded()
    # the forwards wait 1 ms a step for copies without it: hiding them all
    # could pay for its host time, so the waits bound lets its probes run
    on = _cheap_copies(ctl, steps=200, seed=seed, waits_s=1e-3)
    first, *later = _ra_decisions(ctl)
    assert first["switched"] and first["on"] is False
    why = str(first["why"])
    assert "cannot save its own host time" in why and "0.7" in why
    assert int(str(first["step"])) == ROUTE_AHEAD_COST_CLEAR_STEPS < ROUTE_AHEAD_GATE_STEPS
    # off through the first hold (the first round has nothing to probe)
    assert not any(on[ROUTE_AHEAD_COST_CLEAR_STEPS : ROUTE_AHEAD_COST_CLEAR_STEPS + ctl.hold])
    assert later and all("by its probe's cost bound" in str(d["why"]) for d in later)
    assert all("clear reading" in str(d["why"]) for d in later)
    # no probe switches it back on while the bound holds
    assert all(d["on"] is False and not d["switched"] for d in later)
    assert sum(on) == ROUTE_AHEAD_COST_CLEAR_STEPS * (1 + len(later))
    assert ctl.summary()["settings"]["route_ahead_cost_clear"] == ROUTE_AHEAD_COST_CLEAR
    assert ctl.summary()["settings"]["route_ahead_cost_gate"] is True
    # the precision gate alone keeps it on in the same steps
    alone = _gated()
    on_alone = _cheap_copies(alone, steps=200, seed=seed)
    assert _ra_decisions(alone)[0]["on"] is True and all(on_alone[:20])


def test_a_clear_reading_decides_in_steps_that_admit_requests() -> None:
    """The first steps of a run admit requests (not measured: no step
    counts toward ``route_ahead_gate_steps``): a clear reading switches
    route-ahead off at the second of them all the same; a reading only
    past the bound waits for measured steps."""
    rng = np.random.default_rng(0)
    for copy_s, decided_at in ((1e-7, ROUTE_AHEAD_COST_CLEAR_STEPS), (None, None)):
        ctl = _bounded()
        ctl.bind(PartsState())
        for _ in range(6):
            step = _step(
                ctl.parts, rng, precision=PRECISE, ra_factor=1.0, host_s=5e-4, copy_s=copy_s
            )
            ctl.observe(dataclasses.replace(step, admitted=1))
        decisions = _ra_decisions(ctl)
        if decided_at is None:
            assert decisions == [] and ctl.parts.route_ahead
        else:
            (first,) = decisions
            assert first["on"] is False and int(str(first["step"])) == decided_at
            assert not ctl.parts.route_ahead


@pytest.mark.parametrize("seed", range(3))
def test_a_bound_exceeded_but_not_clearly_waits_for_the_window_and_full_probes(
    seed: int,
) -> None:
    """Host time 1.5x the bound (below the clear reading's 2x): the first
    decision waits for its ``route_ahead_gate_steps`` and switches it off
    there, and its must-earn probes run to their verdict (at its last look
    or early), none cut short by their own steps."""
    assert ROUTE_AHEAD_COST_CLEAR > 1.5
    assert _gated().summary()["settings"]["route_ahead_cost_clear"] is None  # no cost bound
    copy_s = 5e-4 / (1.5 * round(PRECISE * NAMED))
    ctl = _bounded()
    on = simulate(
        ctl,
        precision=PRECISE,
        ra_factor=1.01,
        steps=200,
        seed=seed,
        host_s=5e-4,
        copy_s=copy_s,
        waits_s=1e-3,  # enough for the waits bound to let the probes run
    )
    first, *later = _ra_decisions(ctl)
    assert first["on"] is False and "cannot save its own host time" in str(first["why"])
    assert int(str(first["step"])) >= ROUTE_AHEAD_GATE_STEPS
    assert all(on[:ROUTE_AHEAD_GATE_STEPS])
    assert later and all("must earn" in str(d["why"]) for d in later)
    assert not any("by its probe's cost bound" in str(d["why"]) for d in later)
    assert all(d["on"] is False for d in later)


@pytest.mark.parametrize("seed", range(3))
def test_a_clear_reading_ends_a_probe_of_route_ahead_that_runs(seed: int) -> None:
    """Route-ahead off by imprecise predictions, switched back on by a
    must-earn probe once they are precise and its copies worth 0.1 ms;
    then its copies cost 0.1 us: the next probe of route-ahead (must-earn
    by the bound) switches it off after its first two steps with it on,
    and later probes keep it off the same way."""
    ctl = _bounded()
    ctl.bind(PartsState())
    rng = np.random.default_rng(seed)
    on = []
    for i in range(400):
        cheap = i >= 200
        step = _step(
            ctl.parts,
            rng,
            precision=0.3 if i < 60 else PRECISE,
            ra_factor=1.01 if cheap else 0.8,
            host_s=5e-4,
            copy_s=1e-7 if cheap else 1e-4,
            # the waits route-ahead hides where it makes the step 20% shorter;
            # then 1 ms: enough for the waits bound to let its probes run
            waits_s=1e-3 if cheap else 0.01,
        )
        on.append(ctl.parts.route_ahead)
        ctl.observe(step)
    decisions = _ra_decisions(ctl)
    back_on = next(d for d in decisions if d["switched"] and d["on"])
    assert "pays again" in str(back_on["why"]) and int(str(back_on["step"])) < 200
    off = next(d for d in decisions if d["switched"] and int(str(d["step"])) > 200)
    assert off["on"] is False and "switched off (cannot save its own host time)" in str(off["why"])
    assert "by its probe's cost bound" in str(off["why"])
    off_at = int(str(off["step"]))
    later = [d for d in decisions if int(str(d["step"])) > off_at]
    assert later and all("by its probe's cost bound" in str(d["why"]) for d in later)
    assert sum(on[off_at:]) == ROUTE_AHEAD_COST_CLEAR_STEPS * len(later)


@pytest.mark.parametrize("seed", range(3))
def test_route_ahead_whose_hits_could_pay_for_its_host_time_is_kept(seed: int) -> None:
    """The same host time where an expert's copy takes 0.1 ms (the routed
    predictions could save 14 ms a step, 56 ms over the first decision's 4
    steps): the bound keeps route-ahead on and says so, and it runs as under
    the precision gate alone."""
    ctl = _bounded()
    on = simulate(
        ctl, precision=PRECISE, ra_factor=0.9, steps=120, seed=seed, host_s=5e-4, copy_s=1e-4
    )
    first = _ra_decisions(ctl)[0]
    assert first["on"] is True and not first["switched"]
    assert "kept on (gate)" in str(first["why"]) and "at most 56 ms" in str(first["why"])
    assert sum(on) > 100


def test_steps_without_a_copy_time_are_not_counted_by_the_bound() -> None:
    """No link rate measured: the bound reads nothing and the precision
    gate decides alone."""
    ctl = _bounded()
    simulate(ctl, precision=PRECISE, ra_factor=1.0, steps=30, host_s=5e-4, copy_s=None)
    first = _ra_decisions(ctl)[0]
    assert first["on"] is True and "no step with a measured copy time" in str(first["why"])


@pytest.mark.parametrize("seed", range(3))
def test_the_watch_switches_off_route_ahead_whose_copies_became_cheap(seed: int) -> None:
    """Kept on by the first decision (copies worth 0.1 ms), then the copies
    cost 0.1 us (the link got fast, or the experts small): the watch
    switches route-ahead off once a full window reads the bound exceeded,
    outside a probe."""
    ctl = _bounded()
    simulate(ctl, precision=PRECISE, ra_factor=1.0, steps=80, seed=seed, host_s=5e-4, copy_s=1e-4)
    assert ctl.configured.route_ahead and ctl.rounds_done >= 1
    rng = np.random.default_rng(seed + 10)
    for _ in range(120):
        parts = ctl.parts
        ctl.observe(_step(parts, rng, precision=PRECISE, ra_factor=1.01, host_s=5e-4, copy_s=1e-7))
    off = next(d for d in _ra_decisions(ctl) if d["switched"])
    assert off["on"] is False
    assert "re-reading: it cannot save its own host time" in str(off["why"])
    assert 80 < int(str(off["step"])) <= 80 + ROUTE_AHEAD_GATE_WINDOW + 30


@pytest.mark.parametrize("seed", range(3))
def test_a_probe_that_hiding_every_wait_could_not_pay_for_is_skipped(seed: int) -> None:
    """Route-ahead off by its cost bound (0.5 ms of host time a step, 0.1 us
    copies) where the steps without it wait 0.1 ms a step for copies:
    even hiding every wait could not pay for it, so the waits bound skips
    each of its probes (logged, kept off) and it runs only the first
    decision's steps. With 1 ms of waits a step its probes run."""
    ctl = _bounded()
    on = _cheap_copies(ctl, steps=300, seed=seed, waits_s=1e-4)
    first, *later = _ra_decisions(ctl)
    assert first["switched"] and first["on"] is False
    assert len(later) >= 2
    for d in later:
        why = str(d["why"])
        assert d["on"] is False and not d["switched"]
        assert "its probe skipped (the waits bound" in why
        waits = re.search(r"the ([0-9.]+) ms a step the latest (\d+) steps without it", why)
        assert waits is not None and 0.08 < float(waits[1]) < 0.13
        assert int(waits[2]) == ROUTE_AHEAD_WAITS_WINDOW
    assert sum(on) == ROUTE_AHEAD_COST_CLEAR_STEPS
    # the rounds go on (the hold doubles): the controller is not stuck
    assert ctl.rounds_done >= len(later)
    waited = _bounded()
    on_waited = _cheap_copies(waited, steps=300, seed=seed, waits_s=1e-3)
    assert not any("waits bound" in str(d["why"]) for d in _ra_decisions(waited))
    assert sum(on_waited) > sum(on)


def test_waits_that_grow_let_the_next_probe_run() -> None:
    """The waits bound reads the latest steps only: where the steps without
    route-ahead start waiting 5 ms a step for copies, the next probe of
    route-ahead runs (its own steps then judge it)."""
    assert ROUTE_AHEAD_WAITS_MIN_STEPS <= ROUTE_AHEAD_WAITS_WINDOW
    ctl = _bounded()
    ctl.bind(PartsState())
    rng = np.random.default_rng(3)
    on = []
    grow_at = 150
    for i in range(600):
        on.append(ctl.parts.route_ahead)
        waits = 1e-4 if i < grow_at else 5e-3
        ctl.observe(
            _step(
                ctl.parts,
                rng,
                precision=PRECISE,
                ra_factor=1.01,
                host_s=5e-4,
                copy_s=1e-7,
                waits_s=waits,
            )
        )
    decisions = _ra_decisions(ctl)
    skipped = [d for d in decisions if "waits bound" in str(d["why"])]
    assert skipped and all(
        int(str(d["step"])) < grow_at + ROUTE_AHEAD_WAITS_WINDOW for d in skipped
    )
    ran = [d for d in decisions if int(str(d["step"])) > grow_at + ROUTE_AHEAD_WAITS_WINDOW]
    assert ran and all("by its probe's cost bound" in str(d["why"]) for d in ran)
    assert any(on[grow_at + ROUTE_AHEAD_WAITS_WINDOW :])


def test_the_waits_bound_needs_enough_steps_and_the_cost_bound() -> None:
    """No skip without the cost bound (the precision gate alone) or before
    :data:`ROUTE_AHEAD_WAITS_MIN_STEPS` steps without route-ahead."""
    alone = _gated()  # precision gate, no cost bound: imprecise route-ahead gated off
    simulate(alone, precision=0.3, ra_factor=1.01, steps=300, host_s=5e-4, copy_s=1e-7)
    assert not any("waits bound" in str(d["why"]) for d in _ra_decisions(alone))
    ctl = _bounded()
    _cheap_copies(ctl, steps=3)
    assert ctl._ra_gated and len(ctl._waits_off) < ROUTE_AHEAD_WAITS_MIN_STEPS
    assert ctl._ra_waits_bound_text() is None
