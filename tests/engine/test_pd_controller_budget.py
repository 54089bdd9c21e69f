"""The PD controller's probe budget (``probe_budget``): where PD's parts pay,
a probe's flipped arm loses time, and the hold after a round that switched
nothing grows until that loss is about the budget's share of the steps;
parts that change nothing keep their probes; a round that switched is
re-checked after the normal hold."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from pdflash.engine.pd_controller import PARTS, PartsState, PDController

from .test_pd_controller import Plant, drive, switches

#: every part pays: a step with it off takes 1/factor as long (the stream
#: off 1.67x, route-ahead off 1.43x and the stream with it, the 2-D
#: scheduler off 1.11x)
PAYS = {"stream": 0.6, "route_ahead": 0.7, "scheduler_2d": 0.9}


def _extra_time(seen: list[PartsState]) -> float:
    """The mean extra time of the steps over the all-on step's, as a share
    of it (what the probes' flipped arms cost, by the plant's factors)."""
    extra = []
    for parts in seen:
        mult = 1.0
        for p in PARTS:
            if not parts.runs(p):
                mult /= PAYS[p]
        extra.append(mult - 1.0)
    return float(np.mean(extra))


def _paying_run(budget: float, seed: int, steps: int = 2000) -> tuple[PDController, float]:
    ctl = PDController(probe_budget=budget)
    seen = drive(ctl, Plant(PAYS, lognormal=0.1, seed=seed), steps)
    # after the first rounds (a fresh controller probes every part once)
    return ctl, _extra_time(seen[200:])


def test_parts_that_pay_cost_their_probes_about_the_budget() -> None:
    """Over 10 runs of 2000 steps where every part pays, the probes' extra
    time after the first 200 steps is at most twice the 0.05 budget in
    every run, and at most 0.75x the extra time of the same controller
    without the budget (``probe_budget=1``, the doubling hold alone)."""
    with_budget = [_paying_run(0.05, seed)[1] for seed in range(10)]
    without = [_paying_run(1.0, seed)[1] for seed in range(10)]
    assert max(with_budget) <= 0.10, with_budget
    assert np.mean(with_budget) <= 0.75 * np.mean(without), (with_budget, without)


def test_the_summary_adds_up_the_charges() -> None:
    ctl, _ = _paying_run(0.05, seed=0, steps=400)
    s = ctl.summary()
    assert s["settings"]["probe_budget"] == 0.05
    # three probes a round, each losing where the flipped part paid
    assert s["probe_loss_steps"] > 3.0, s["probe_loss_steps"]
    ctl.reset_stats()
    assert ctl.summary()["probe_loss_steps"] == 0.0


def test_parts_that_change_nothing_keep_their_probes() -> None:
    """Noise alone (the loaded CPU's) charges little: over 20 runs of 300
    steps the budget leaves at least 0.9x the probes of the controller
    without it, and switches no more often."""
    probes = {}
    switched = {}
    for budget in (0.05, 1.0):
        runs = []
        for seed in range(20):
            ctl = PDController(probe_budget=budget)
            drive(ctl, Plant({}, lognormal=0.3, seed=seed), 300)
            runs.append(ctl.summary())
        probes[budget] = sum(s["probes"] for s in runs)
        switched[budget] = sum(s["switches"] for s in runs)
    assert probes[0.05] >= 0.9 * probes[1.0], probes
    assert switched[0.05] <= switched[1.0], switched


def test_a_round_that_switched_is_re_checked_after_the_normal_hold() -> None:
    """Route-ahead costs 30% while the stream and the 2-D scheduler pay much:
    the round that switches route-ahead off lost much in its other probes,
    yet the next round starts within ``hold`` measured steps and settles
    (a false switch must not last a budget's hold)."""
    plant = Plant({"route_ahead": 1.3, "scheduler_2d": 0.6}, seed=0)
    ctl = PDController(keep_decisions=100)
    drive(ctl, plant, 300)
    decisions = ctl.summary()["decisions"]
    assert switches(ctl)[0] == ("route_ahead", False)
    off = next(d for d in decisions if d["switched"])
    later = [d for d in decisions if d["step"] > off["step"]]
    assert later, decisions
    # the next round's first probe ends within the hold, its settle and a
    # probe of min_pairs pairs (no noise: each probe ends at its first look)
    bound = ctl.hold + 2 * ctl.min_pairs + (ctl.min_pairs + 2) * ctl.settle
    assert later[0]["step"] - off["step"] <= bound, (off, later[0], bound)


def test_without_a_switch_the_hold_grows_past_max_hold_where_probes_lose() -> None:
    """No noise, every part pays: the rounds after the first wait longer
    than ``max_hold`` (the budget's hold), so the probes' estimated loss is
    at most the budget's share of the steps after the first round."""
    ctl = PDController(keep_decisions=1000)
    drive(ctl, Plant(PAYS), 3000)
    steps = sorted({d["step"] for d in ctl.summary()["decisions"]})
    # a round: three probes' decisions close together; the gaps between
    # rounds are the holds
    gaps = [b - a for a, b in itertools.pairwise(steps) if b - a > 30]
    assert gaps and min(gaps) > ctl.max_hold, gaps
    s = ctl.summary()
    assert s["probe_loss_steps"] <= 0.05 * s["steps"] + 30, s["probe_loss_steps"]


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5, math.nan])
def test_bad_budgets_are_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="probe_budget"):
        PDController(probe_budget=bad)
