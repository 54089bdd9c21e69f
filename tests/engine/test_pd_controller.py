"""The PD controller (pdflash.engine.pd_controller): synthetic measurement
streams (a part that costs more than it saves goes off within a bound, one
that pays stays on, a shift re-enables, noise of the size measured on the
loaded CPU box does not flip-flop and switches at most at the stated
false-switch rate), the t test's numbers against the t table, a bounded
switch rate for any measurements (hypothesis), and the engine's greedy
tokens identical whatever the parts do."""

from __future__ import annotations

import contextlib
import itertools
import math
import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdflash.engine.pd_controller import (
    ALL_ON,
    PARTS,
    ROUTE_AHEAD_GATE_PRECISION,
    FixedParts,
    PartsPolicy,
    PartsState,
    PDController,
    StepMeasurement,
    expected_committed,
    paired_test,
    t_isf,
    t_sf,
)
from pdflash.engine.verify_width import SurvivalEstimator
from pdflash.report.stats import t_quantile_975

from .conftest import offloaded_pd_engine

#: wall seconds of one step with every part's effect 1.0
BASE_WALL = 0.1
TOKENS = 64
#: per-step noise measured on the shared 2-core CPU box: 3-step windows'
#: rates spread 0.4-1.8x, i.e. a per-step log-rate sd of about 0.3, with
#: rare hiccups; LOADED_CPU draws log-normal sd 0.3 and, in 5% of steps, a
#: step 1.8x as long
LOADED_CPU = 0.3


class Plant:
    """A synthetic engine: a step's wall time is BASE_WALL times each running
    part's factor (> 1: it costs more than it saves), times seeded noise
    (``noise``: uniform +-noise; ``lognormal``: log-normal of that sd with 5%
    of steps 1.8x long), plus the running prefetch parts' host seconds and
    the exposed fetch they leave (the exposed fetch noisy alike), and a
    ``drift`` of the tokens per step (requests finishing)."""

    def __init__(
        self,
        factors: dict[str, float],
        noise: float = 0.0,
        seed: int = 0,
        host: dict[str, float] | None = None,
        saves: dict[str, float] | None = None,
        exposed: float = 0.0,
        lognormal: float = 0.0,
        drift: float = 0.0,
        books: dict[str, float] | None = None,
    ) -> None:
        self.factors = dict(factors)
        self.noise = noise
        self.lognormal = lognormal
        self.drift = drift
        self.rng = np.random.default_rng(seed)
        # optional: each running part's own host s/step and the exposed fetch
        # s/step it removes from `exposed` (both added to the wall)
        self.host = dict(host or {})
        # optional: host s/step a running part's books charge it beyond
        # ``host`` (work its own part_host_s does not see, such as the
        # forward's hooks), also added to the wall
        self.books = dict(books or {})
        self.saves = dict(saves or {})
        self.exposed = exposed
        self.steps = 0

    def _jitter(self) -> float:
        j = 1.0
        if self.noise:
            j *= 1.0 + float(self.rng.uniform(-self.noise, self.noise))
        if self.lognormal:
            j *= math.exp(float(self.rng.normal(0.0, self.lognormal)))
            if self.rng.random() < 0.05:
                j *= 1.8
        return j

    def step(self, parts: PartsState) -> StepMeasurement:
        self.steps += 1
        wall = BASE_WALL
        for p in PARTS:
            if parts.runs(p):
                wall *= self.factors.get(p, 1.0)
        # fewer tokens per step as requests finish, each step's time with them
        scale = max(0.2, 1.0 - self.drift * self.steps)
        wall *= scale * self._jitter()
        running = [p for p in PARTS if parts.runs(p)]
        host = {p: self.host.get(p, 0.0) for p in running}
        exposed = max(0.0, self.exposed - sum(self.saves.get(p, 0.0) for p in running))
        exposed *= self._jitter() if exposed else 1.0
        hidden = {p: self.books.get(p, 0.0) for p in running}
        books = {p: host[p] + hidden[p] for p in running} if self.books else {}
        return StepMeasurement(
            wall_s=wall + sum(host.values()) + sum(hidden.values()) + exposed,
            committed_tokens=max(1, round(scale * TOKENS)) // 4,
            verified_tokens=max(1, round(scale * TOKENS)),
            part_host_s=host,
            books_host_s=books,
            exposed_fetch_s=exposed,
        )


def drive(ctl: PartsPolicy, plant: Plant, steps: int) -> list[PartsState]:
    """Run ``steps`` steps; returns the parts each step ran with."""
    seen = []
    for _ in range(steps):
        parts = ctl.parts
        seen.append(parts)
        ctl.observe(plant.step(parts))
    return seen


def probe_steps(ctl: PDController, pairs: int | None = None) -> int:
    """Steps of a probe of ``pairs`` pairs (default the most, extended): two
    measured steps a pair, one change of the parts a pair (AB, BA, ...) and
    the change back at the end, each followed by ``settle`` steps."""
    n = ctl.max_pairs + ctl.extend_pairs if pairs is None else pairs
    return 2 * n + (n + 1) * ctl.settle


def switches(ctl: PDController) -> list[tuple[str, bool]]:
    return [(d["part"], d["on"]) for d in ctl.summary()["decisions"] if d["switched"]]


class TrimPlant:
    """A synthetic engine for the scheduler's probe: ``requests`` requests a
    step, each verifying ``drafts[on]`` drafts (the 2-D scheduler on: fewer,
    its trimmed grants) with forced acceptance (each draft accepted with
    probability ``accept`` until the first rejection, as
    :mod:`pdflash.engine.acceptance` forces it); the step's wall is
    ``walls[on]`` times log-normal noise of sd ``lognormal`` (5% of steps
    1.8x long). The measurement carries the expected committed tokens from a
    :class:`SurvivalEstimator` learned from the plant's own outcomes, as the
    engine side of the controller computes them."""

    def __init__(
        self,
        drafts: tuple[int, int],
        walls: tuple[float, float],
        *,
        accept: float = 0.8,
        requests: int = 1,
        lognormal: float = LOADED_CPU,
        seed: int = 0,
    ) -> None:
        self.drafts = {False: drafts[0], True: drafts[1]}
        self.walls = {False: walls[0], True: walls[1]}
        self.accept = accept
        self.requests = requests
        self.lognormal = lognormal
        self.rng = np.random.default_rng(seed)
        self.survival = SurvivalEstimator(15)

    def expected(self, on: bool) -> float:
        """True expected committed tokens per request of a step."""
        return sum(self.accept**j for j in range(self.drafts[on] + 1))

    def step(self, parts: PartsState) -> StepMeasurement:
        k = self.drafts[parts.scheduler_2d]
        outcomes = []
        for rid in range(self.requests):
            accepted = 0
            while accepted < k and self.rng.random() < self.accept:
                accepted += 1
            outcomes.append((rid, k, accepted))
        expected = expected_committed(self.survival, outcomes)
        for rid, verified, accepted in outcomes:
            self.survival.observe(rid, verified, accepted)
        noise = math.exp(float(self.rng.normal(0.0, self.lognormal)))
        if self.rng.random() < 0.05:
            noise *= 1.8
        return StepMeasurement(
            wall_s=self.walls[parts.scheduler_2d] * noise,
            committed_tokens=sum(a + 1 for _, _, a in outcomes),
            verified_tokens=self.requests * (k + 1),
            expected_committed_tokens=expected,
        )


#: the scheduler alone is probed (the prefetching parts are absent)
SCHEDULER_ONLY = PartsState(route_ahead=False, scheduler_2d=True, stream=False)


def _scheduler_probes(rate_of: str, plant_of: Any, runs: int, steps: int) -> tuple[int, int]:
    """(probes, probes that switched) over ``runs`` seeded runs."""
    probes = switched_n = 0
    for seed in range(runs):
        ctl = PDController(rate_of=rate_of)
        ctl.bind(SCHEDULER_ONLY)
        drive(ctl, plant_of(seed), steps)
        s = ctl.summary()
        probes += s["probes"]
        switched_n += s["switches"]
    return probes, switched_n


def _same_committed_rate(lognormal: float) -> Any:
    # on: 6 drafts verified, off: 9; the off step's wall is longer by just
    # its extra expected committed tokens, so both commit at the same rate
    # while the on arm verifies 7/10 of the tokens for 0.89 of the wall
    def plant_of(seed: int) -> TrimPlant:
        plant = TrimPlant((9, 6), (1.0, 1.0), lognormal=lognormal, seed=seed)
        plant.walls[True] = plant.expected(True) / plant.expected(False)
        return plant

    return plant_of


#: a quiet box's per-step wall noise
QUIET = 0.1


@pytest.mark.parametrize("lognormal", [LOADED_CPU, QUIET])
@pytest.mark.parametrize("rate_of", ["expected_committed", "committed"])
def test_a_trimming_scheduler_that_commits_as_fast_is_not_switched_off(
    rate_of: str, lognormal: float
) -> None:
    """The 2-D scheduler's trimmed grants verify fewer drafts, but the drafts
    it drops are the least likely to be accepted: where its committed tokens
    per second equal the token-only batch's, the probe switches it at most at
    the stated false-switch rate (the upper end of a binomial 99.9% band
    around alpha 0.05), under the loaded and a quiet CPU's wall noise, by the
    expected committed tokens (the default) and by the realized ones alike."""
    probes, switched_n = _scheduler_probes(
        rate_of, _same_committed_rate(lognormal), runs=60, steps=160
    )
    assert probes > 150
    band = 0.05 + 3.3 * math.sqrt(0.05 * 0.95 / probes)
    assert switched_n / probes <= band, (switched_n, probes)


def test_verified_tokens_would_switch_off_a_scheduler_that_commits_as_fast() -> None:
    """The bias the committed rate removes: the same plant on a quiet box,
    judged by verified tokens per second (the on arm verifies 0.7x the
    tokens in 0.89x the wall), has the scheduler switched off in most runs."""
    probes, switched_n = _scheduler_probes(
        "verified", _same_committed_rate(QUIET), runs=20, steps=60
    )
    assert switched_n >= 15, (switched_n, probes)


@pytest.mark.parametrize(("lognormal", "kept"), [(QUIET, 3), (LOADED_CPU, 1)])
def test_a_scheduler_that_lowers_committed_tokens_per_second_is_switched_off(
    lognormal: float, kept: int
) -> None:
    """On: ``kept`` drafts verified instead of 9 (4 requests a step) for only
    10% less wall: committed tokens per second 0.74x the token-only batch's
    (3 kept, a quiet box) or 0.45x (1 kept, the loaded box's noise). Within
    one probe (extension included) it is switched off in >= 17 of 20 runs."""

    def costly(seed: int) -> TrimPlant:
        return TrimPlant((9, kept), (1.0, 0.9), requests=4, lognormal=lognormal, seed=seed)

    plant = costly(0)
    assert plant.expected(True) / (plant.expected(False) * 0.9) < 0.75
    off = 0
    for seed in range(20):
        ctl = PDController()
        ctl.bind(SCHEDULER_ONLY)
        drive(ctl, costly(seed), ctl.warmup + probe_steps(ctl))
        off += not ctl.parts.scheduler_2d
    assert off >= 17, off


def test_expected_committed_counts_each_verified_draft_at_its_survival() -> None:
    surv = SurvivalEstimator(4, prior_accept=0.5, prior_weight=2.0)
    # no outcome yet: c_j = 0.5 at every position, S = 0.5, 0.25, ...
    assert expected_committed(surv, [(7, 2, 0)]) == pytest.approx(1.0 + 0.5 + 0.25)
    assert expected_committed(surv, [(7, 0, 0), (8, 9, 0)]) == pytest.approx(
        1.0 + 1.0 + 0.5 + 0.25 + 0.125 + 0.0625
    )
    for _ in range(50):
        surv.observe(7, 4, 4)  # every draft accepted: S -> 1
    assert expected_committed(surv, [(7, 4, 0)]) > 1.0 + 3.5
    # the outcomes' own accepted counts do not enter the expectation
    assert expected_committed(surv, [(7, 4, 0)]) == expected_committed(surv, [(7, 4, 4)])


# ------------------------------------------------------------ the t test
@pytest.mark.parametrize("df", [1, 2, 3, 4, 5, 7, 10, 19, 30])
def test_t_tail_matches_the_t_table(df: int) -> None:
    q = t_quantile_975(df)
    assert t_sf(q, df) == pytest.approx(0.025, abs=2e-6)
    assert t_sf(-q, df) == pytest.approx(0.975, abs=2e-6)
    assert t_isf(0.025, df) == pytest.approx(q, rel=1e-6)
    assert t_sf(0.0, df) == pytest.approx(0.5)
    # df = 1 is the Cauchy distribution: P(T >= t) = 1/2 - atan(t)/pi
    assert t_sf(1.7, 1) == pytest.approx(0.5 - math.atan(1.7) / math.pi)


def test_paired_test_numbers() -> None:
    t = paired_test([0.1, 0.3, 0.2])
    assert t.mean == pytest.approx(0.2) and t.se == pytest.approx(0.1 / math.sqrt(3))
    assert t.p == pytest.approx(t_sf(0.2 / (0.1 / math.sqrt(3)), 2))
    assert t.upper(0.025) == pytest.approx(0.2 + t_quantile_975(2) * 0.1 / math.sqrt(3))
    assert paired_test([0.2, 0.2]).p == 0.0 and paired_test([-0.2, -0.2]).p == 1.0
    with pytest.raises(ValueError, match="2 or more"):
        paired_test([0.1])


# ------------------------------------------------------------ decisions
def test_a_part_that_costs_more_than_it_saves_is_switched_off_within_bound() -> None:
    ctl = PDController()
    seen = drive(ctl, Plant({"route_ahead": 1.3}), 200)
    summary = ctl.summary()
    switched = [d for d in summary["decisions"] if d["switched"]]
    assert [(d["part"], d["on"]) for d in switched] == [("route_ahead", False)]
    assert "costs more than it saves" in switched[0]["why"]
    # warm-up, probes of the scheduler and the stream (no gain: each ends at
    # its first look), then route-ahead's first look
    bound = ctl.warmup + 3 * probe_steps(ctl, ctl.min_pairs)
    off_at = switched[0]["step"]
    assert off_at <= bound, (off_at, bound)
    assert not seen[off_at].route_ahead
    # later re-probes turn it on only for their B steps, and keep it off
    after = seen[off_at:]
    assert sum(s.route_ahead for s in after) / len(after) < 0.15
    assert summary["switches"] == 1
    assert summary["on_fraction"]["scheduler_2d"] > 0.85  # on but in its probes' B steps
    # with route-ahead off the stream does not run (it is not probed either)
    assert not any(s.runs("stream") for s in after if not s.route_ahead)
    assert all(d["part"] != "stream" for d in summary["decisions"] if d["step"] > off_at)


def test_each_costly_part_goes_off_and_the_paying_one_stays_on() -> None:
    ctl = PDController()
    seen = drive(ctl, Plant({"scheduler_2d": 1.25, "stream": 1.2, "route_ahead": 0.7}), 300)
    end = seen[-1]
    assert end.route_ahead and not end.scheduler_2d and not end.stream
    s = ctl.summary()
    assert s["switches"] == 2
    # route-ahead pays: it ran except in its own probes' B steps
    assert s["on_fraction"]["route_ahead"] > 0.85


def test_a_part_that_pays_stays_on() -> None:
    ctl = PDController()
    seen = drive(ctl, Plant({"route_ahead": 0.6, "scheduler_2d": 0.9, "stream": 0.8}), 300)
    assert ctl.summary()["switches"] == 0
    assert all(d["why"].startswith("kept on") for d in ctl.summary()["decisions"])
    assert sum(s == ALL_ON for s in seen) / len(seen) > 0.75  # probes cost the rest


def test_a_shift_re_enables_a_part() -> None:
    ctl = PDController(hold=12, max_hold=12)
    plant = Plant({"stream": 1.3})
    seen = drive(ctl, plant, 100)
    assert not seen[-1].stream
    plant.factors["stream"] = 0.7  # the workload shifts: streaming pays now
    seen = drive(ctl, plant, 200)
    assert switches(ctl) == [("stream", False), ("stream", True)]
    switched = [d for d in ctl.summary()["decisions"] if d["switched"]]
    assert "pays again" in switched[-1]["why"]
    # at most a hold, the probes of the parts before it and its own first look
    bound = ctl.hold + len(PARTS) * probe_steps(ctl) + ctl.settle
    on_after = switched[-1]["step"] - 100
    assert 0 < on_after <= bound, (on_after, bound)
    # and it stays on, but for its re-probes' B steps
    rest = seen[on_after:]
    assert rest[0].stream and sum(s.stream for s in rest) / len(rest) > 0.85


def test_a_costly_part_goes_off_in_a_short_run_on_the_loaded_cpu() -> None:
    """A 40-step run with the measured CPU noise: a stream whose host work is
    20% of the step and saves nothing is off by step 34 (after the
    scheduler's probe, which the noise drags to its last pair) in >= 9 of 10
    seeds (its books: host seconds are measured, not noisy like the wall)."""
    off = 0
    for seed in range(10):
        ctl = PDController()
        plant = Plant({}, lognormal=LOADED_CPU, seed=seed, host={"stream": 0.02}, exposed=0.01)
        seen = drive(ctl, plant, 40)
        off += int(not seen[34].runs("stream") and not seen[-1].runs("stream"))
    assert off >= 9


def test_a_probe_that_points_to_a_flip_is_extended() -> None:
    """A scheduler that costs 25% under the loaded CPU's noise: over 20
    60-step runs the extension (6 more pairs pooled with the first 6 where
    they point to a flip) switches it off in more runs than probes of 6
    pairs alone."""

    def found(extend: int) -> int:
        n = 0
        for seed in range(20):
            ctl = PDController(extend_pairs=extend)
            drive(ctl, Plant({"scheduler_2d": 1.25}, lognormal=LOADED_CPU, seed=seed), 60)
            n += int(("scheduler_2d", False) in switches(ctl))
        return n

    with_extension, without = found(6), found(0)
    assert with_extension > without, (with_extension, without)


def _route_ahead_books_switches(**plant: Any) -> int:
    """Of 12 seeded 80-step runs on the loaded CPU's noise with ``plant``'s
    route-ahead, how many first probes of route-ahead switched it; each such
    switch must be off, by cost/benefit."""
    switched = 0
    for seed in range(12):
        ctl = PDController()
        drive(ctl, Plant({}, lognormal=LOADED_CPU, seed=seed, **plant), 80)
        first = next(d for d in ctl.summary()["decisions"] if d["part"] == "route_ahead")
        if first["switched"]:
            assert first["on"] is False and "cost/benefit" in first["why"]
            switched += 1
    return switched


def test_cost_benefit_switches_off_a_costly_prefetcher_that_noise_hides() -> None:
    """Route-ahead's host work (12 ms/step) removes 2 ms/step of exposed
    fetch: a 9% loss the loaded CPU's wall noise hides from the rate, not
    from its books. Over 12 runs the books switch it off in the first
    round of at least 10 (the rate's veto stops a few whose noisy rate
    happened to read the part more than the margin faster)."""
    switched = _route_ahead_books_switches(
        host={"route_ahead": 0.012}, saves={"route_ahead": 0.002}, exposed=0.003
    )
    assert switched >= 10


def test_the_books_charge_a_prefetchers_hook_time_beside_its_own_part_time() -> None:
    """Route-ahead's own part time (its predictor, 2 ms/step) is less than
    the 3 ms/step of exposed fetch it removes, but its whole host cost (with
    the forward hooks and plans it adds, 10 ms/step more, ``books_host_s``)
    is not: a 9% loss the loaded CPU's noise hides from the rate. Its books
    switch it off in the first round of at least 10 of 12 runs; charging
    only ``part_host_s`` they would read it paying."""
    switched = _route_ahead_books_switches(
        host={"route_ahead": 0.002},
        books={"route_ahead": 0.010},
        saves={"route_ahead": 0.003},
        exposed=0.004,
    )
    assert switched >= 10


def test_a_restarted_controller_decides_as_a_new_one() -> None:
    """After 80 steps of probes and switches, ``restart`` leaves the
    controller as a new one bound to the same parts: the same state, and the
    same decisions on the same steps."""
    used = PDController()
    drive(used, Plant({"scheduler_2d": 1.4}, noise=0.05, seed=1), 80)
    assert switches(used) and used.rounds_done >= 1
    used.restart()
    fresh = PDController()
    fresh.bind(ALL_ON)
    assert used.parts == fresh.parts and used.rounds_done == 0
    assert used.summary() == fresh.summary()
    seen_used = drive(used, Plant({"stream": 1.3}, noise=0.05, seed=7), 120)
    seen_fresh = drive(fresh, Plant({"stream": 1.3}, noise=0.05, seed=7), 120)
    assert seen_used == seen_fresh and used.summary() == fresh.summary()


def test_the_books_sum_every_steps_wall_and_exposed_fetch() -> None:
    ctl = PDController()
    plant = Plant({}, noise=0.1, seed=2, host={"stream": 0.002}, exposed=0.01)
    walls, exposed = [], []
    for _ in range(40):
        m = plant.step(ctl.parts)
        walls.append(m.wall_s)
        exposed.append(m.exposed_fetch_s)
        ctl.observe(m)
    sums = ctl.summary()["step_sums"]
    assert sums["wall_s"] == pytest.approx(sum(walls)) and sums["exposed_fetch_s"] == pytest.approx(
        sum(exposed)
    )
    ctl.reset_stats()
    assert ctl.summary()["step_sums"] == {"wall_s": 0.0, "exposed_fetch_s": 0.0}


def test_the_rate_vetoes_books_that_miss_a_wait() -> None:
    """The books a proxy gets wrong (the H200's stream, session 26): the
    stream's plan takes 16 ms/step of host time and its forwards wait 25 ms
    on copies, against 5 ms with it off, so its books charge it some +0.35
    of the step; but its steps are about 20% faster (off, the forward's
    thread blocks on copies where no device event sees it: here the wall
    factor). The books alone would switch it off in every run (their p is
    below 1e-3 by the third pair); the rate's veto keeps it on in at least
    9 of 12 runs (the rest: 3-4 pairs whose noisy rate read it no faster)."""
    switched = 0
    for seed in range(12):
        ctl = PDController()
        plant = Plant(
            {"stream": 0.45},
            lognormal=0.1,
            seed=seed,
            host={"stream": 0.016},
            saves={"stream": -0.02},
            exposed=0.005,
        )
        drive(ctl, plant, 120)
        first = next(d for d in ctl.summary()["decisions"] if d["part"] == "stream")
        books = re.search(
            r"on sign: mean ([-+][0-9.]+) \(se [0-9.e-]+, n \d+, p ([0-9.e-]+)\)", first["why"]
        )
        assert books is not None and float(books.group(1)) > 0.25, first["why"]
        assert float(books.group(2)) < 1e-3, first["why"]
        switched += int(("stream", False) in switches(ctl))
    assert switched <= 3


def test_cost_benefit_keeps_a_prefetcher_that_saves_more_than_it_costs() -> None:
    for seed in range(5):
        ctl = PDController()
        plant = Plant(
            {},
            lognormal=LOADED_CPU,
            seed=seed,
            host={"route_ahead": 0.002, "stream": 0.001},
            saves={"route_ahead": 0.02, "stream": 0.01},
            exposed=0.04,
        )
        drive(ctl, plant, 300)
        # the prefetchers pay by their books (the scheduler, which changes
        # nothing here, is left to the false-switch rate test)
        assert not [p for p, _ in switches(ctl) if p != "scheduler_2d"], (seed, switches(ctl))


def test_noise_of_the_measured_size_switches_at_most_at_the_stated_rate() -> None:
    """Parts that change nothing, under the loaded CPU's noise and a drift
    of the tokens per step: over 40 runs of 300 steps the share of probes
    that switch stays within the stated alpha (0.05; the upper end of a
    binomial 99.9% band around 0.05 for the probes run), and no part is
    switched and switched back within a run more than twice in all (it
    takes two false switches in a row of the same part)."""
    probes = switched_n = flipflops = 0
    for seed in range(40):
        ctl = PDController()
        drive(ctl, Plant({}, lognormal=LOADED_CPU, seed=seed, drift=0.002), 300)
        s = ctl.summary()
        probes += s["probes"]
        switched_n += s["switches"]
        sw = switches(ctl)
        flipflops += sum(
            1 for (p1, on1), (p2, on2) in itertools.pairwise(sw) if p1 == p2 and on1 != on2
        )
    assert probes > 300
    band = 0.05 + 3.3 * math.sqrt(0.05 * 0.95 / probes)
    assert switched_n / probes <= band, (switched_n, probes)
    assert flipflops <= 2, flipflops


@pytest.mark.parametrize("seed", range(5))
def test_no_flapping_under_noise(seed: int) -> None:
    # the parts change nothing; every step's wall time is off by up to +-10%:
    # over 2000 steps the hold grows to max_hold, and the few false switches
    # (alpha per probe) never come back and forth
    ctl = PDController()
    drive(ctl, Plant({}, noise=0.10, seed=seed), 2000)
    s = ctl.summary()
    assert s["probes"] > 30
    assert s["switches"] <= 2, s["decisions"]


def test_small_noise_never_switches() -> None:
    # +-2% per step: no pair can show a 5% gain
    ctl = PDController()
    drive(ctl, Plant({}, noise=0.02, seed=1), 1000)
    assert ctl.summary()["switches"] == 0


def test_prefill_steps_and_steps_without_verify_are_not_measured() -> None:
    ctl = PDController(warmup=0)
    before = ctl.parts
    for _ in range(50):
        ctl.observe(StepMeasurement(wall_s=1.0, committed_tokens=1, admitted=2))
        ctl.observe(StepMeasurement(wall_s=1.0, committed_tokens=0, verified=False))
    assert ctl.parts == before and ctl.summary()["probes"] == 0
    assert ctl.summary()["steps"] == 100  # counted in the books all the same


def test_unavailable_parts_stay_off_and_are_never_probed() -> None:
    ctl = PDController(warmup=0, hold=1)
    ctl.bind(PartsState(route_ahead=True, scheduler_2d=False, stream=False))
    seen = drive(ctl, Plant({"scheduler_2d": 0.5, "stream": 0.5}), 200)
    assert not any(s.scheduler_2d or s.stream for s in seen)
    assert {d["part"] for d in ctl.summary()["decisions"]} == {"route_ahead"}
    assert ctl.summary()["on_fraction"]["stream"] == 0.0


def test_fixed_parts_never_switch_and_keep_books() -> None:
    pol = FixedParts()
    pol.bind(PartsState(stream=False))
    seen = drive(pol, Plant({"route_ahead": 3.0}), 30)
    assert set(seen) == {PartsState(stream=False)}
    s = pol.summary()
    assert s["switches"] == 0 and s["on_fraction"] == {
        "route_ahead": 1.0,
        "scheduler_2d": 1.0,
        "stream": 0.0,
    }
    pol.reset_stats()
    assert pol.summary()["steps"] == 0 and pol.summary()["on_fraction"]["route_ahead"] is None


def test_reset_stats_keeps_the_decision_state() -> None:
    ctl = PDController()
    drive(ctl, Plant({"route_ahead": 1.5}), 80)
    assert not ctl.parts.route_ahead
    ctl.reset_stats()
    assert ctl.summary()["switches"] == 0 and ctl.summary()["steps"] == 0
    assert not ctl.parts.route_ahead


def test_committed_rate_can_be_chosen() -> None:
    ctl = PDController(rate_of="committed")
    drive(ctl, Plant({"route_ahead": 1.4}), 60)
    assert not ctl.parts.route_ahead
    first = next(d for d in ctl.summary()["decisions"] if d["switched"])
    assert "log committed tokens/s" in first["why"]


def test_the_default_rate_is_the_expected_committed_one() -> None:
    ctl = PDController()
    assert ctl.rate_of == "expected_committed"
    drive(ctl, Plant({"route_ahead": 1.4}), 60)
    first = next(d for d in ctl.summary()["decisions"] if d["switched"])
    assert "log expected committed tokens/s" in first["why"]


def test_decisions_carry_their_numbers() -> None:
    ctl = PDController(rate_of="verified")
    drive(ctl, Plant({}, host={"stream": 0.03}), 40)
    d = next(d for d in ctl.summary()["decisions"] if d["part"] == "stream")
    assert d["switched"] and d["why"].startswith("switched off")
    for text in ("by rate and cost/benefit", "log verified tokens/s", "host s/step in part 0.03"):
        assert text in d["why"], d["why"]
    assert f"p < {ctl.alpha_per_look('stream'):.3g}" in d["why"]
    # looks after pairs 3, 4, 5, 6 and, extended, 9 and 12; two rules for the stream
    assert ctl.looks == (3, 4, 5, 6, 9, 12)
    assert ctl.alpha_per_look("stream") == pytest.approx(0.05 / 12)
    assert ctl.alpha_per_look("scheduler_2d") == pytest.approx(0.05 / 6)
    assert PDController(min_pairs=2, max_pairs=3, extend_pairs=5).looks == (2, 3, 5, 7, 8)
    assert PDController(extend_pairs=0).looks == (3, 4, 5, 6)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_pairs": 1},
        {"max_pairs": 2, "min_pairs": 3},
        {"hold": -1},
        {"margin": -0.1},
        {"margin": float("nan")},
        {"alpha": 0.0},
        {"alpha": 1.0},
        {"min_pairs": 2.5},
        {"rate_of": "bytes"},
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        PDController(**kwargs)


def test_bad_measurements_and_parts_are_refused() -> None:
    with pytest.raises(ValueError, match="wall_s"):
        StepMeasurement(wall_s=-1.0, committed_tokens=1)
    with pytest.raises(ValueError, match="verified_tokens"):
        StepMeasurement(wall_s=1.0, committed_tokens=1, verified_tokens=-1)
    for bad in (-0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="expected_committed_tokens"):
            StepMeasurement(wall_s=1.0, committed_tokens=1, expected_committed_tokens=bad)
    with pytest.raises(ValueError, match="unknown part"):
        ALL_ON.with_part("bands", False)


def test_policies_conform_to_the_protocol() -> None:
    assert isinstance(PDController(), PartsPolicy)
    assert isinstance(FixedParts(), PartsPolicy)


measurements = st.lists(
    st.tuples(
        st.floats(min_value=0.0, max_value=10.0),  # wall
        st.integers(min_value=0, max_value=512),  # verified tokens
        st.integers(min_value=0, max_value=2),  # admitted
        st.booleans(),  # verified
        st.floats(min_value=0.0, max_value=1.0),  # exposed fetch
        st.floats(min_value=0.0, max_value=1.0),  # host s of each part
    ),
    max_size=400,
)


@settings(max_examples=60, deadline=None)
@given(
    seq=measurements,
    min_pairs=st.integers(2, 4),
    extra_pairs=st.integers(0, 3),
    settle=st.integers(0, 2),
    # route-ahead, the 2-D scheduler, the stream and the (must-earn) host service
    available=st.tuples(st.booleans(), st.booleans(), st.booleans(), st.booleans()),
)
def test_switch_rate_is_bounded_and_decisions_are_deterministic(
    seq: list[tuple[float, int, int, bool, float, float]],
    min_pairs: int,
    extra_pairs: int,
    settle: int,
    available: tuple[bool, bool, bool, bool],
) -> None:
    avail = PartsState(*available)

    def run() -> tuple[PDController, list[PartsState]]:
        ctl = PDController(
            min_pairs=min_pairs,
            max_pairs=min_pairs + extra_pairs,
            settle=settle,
            warmup=0,
            hold=0,
        )
        ctl.bind(avail)
        seen = []
        for wall, tokens, admitted, verified, exposed, host in seq:
            seen.append(ctl.parts)
            ctl.observe(
                StepMeasurement(
                    wall_s=wall,
                    committed_tokens=tokens // 4,
                    verified_tokens=tokens,
                    admitted=admitted,
                    verified=verified,
                    exposed_fetch_s=exposed,
                    part_host_s=dict.fromkeys(PARTS, host),
                )
            )
        return ctl, seen

    ctl, seen = run()
    s = ctl.summary()
    # a switch needs at least min_pairs pairs of measured steps
    assert s["switches"] <= len(seq) // (2 * min_pairs)
    assert s["switches"] <= s["probes"]
    # the parts are what the engine has, and nothing else
    assert all(p == p.masked(avail) for p in seen)
    # changes of the parts: one a pair, and the change back (or the switch)
    changes = sum(a != b for a, b in itertools.pairwise(seen))
    assert changes <= (min_pairs + extra_pairs + ctl.extend_pairs + 1) * (s["probes"] + 1)
    _, again = run()
    assert again == seen


# ------------------------------------------------------------------ engine
class ScriptedParts:
    """Runs the eight on/off combinations of the parts in turn, one per step."""

    name = "scripted"

    def __init__(self) -> None:
        self._combos = [PartsState(*c) for c in itertools.product((True, False), repeat=3)]
        self._i = 0
        self._available = ALL_ON
        self.seen: list[PartsState] = []

    @property
    def parts(self) -> PartsState:
        return self._combos[self._i % len(self._combos)].masked(self._available)

    def bind(self, available: PartsState) -> None:
        self._available = available

    def observe(self, m: StepMeasurement) -> PartsState:
        self.seen.append(self.parts)
        self.measured = m
        self._i += 1
        return self.parts

    def summary(self) -> dict[str, Any]:
        return {"policy": self.name, "steps": self._i}

    def reset_stats(self) -> None:
        self._i = 0


@contextlib.contextmanager
def _recorded_pd_run(
    offloaded: tuple[Any, list[Any]], prepare: Callable[[Any], None] | None = None
) -> Iterator[tuple[Any, _Recording]]:
    """A PD engine whose controller records every step's measurement, after
    running the cases to the end (``prepare`` sees it first); its issuer is
    closed on leaving, so its worker threads end now, not at a later
    collection."""
    tmp, cases = offloaded
    policy = _Recording()
    eng, issuer = offloaded_pd_engine(tmp, "PD", policy)
    try:
        if prepare is not None:
            prepare(eng)
        for prompt, _ in cases:
            eng.add_request(prompt, max_new_tokens=14)
        eng.run_until_done(max_steps=400)
        yield eng, policy
    finally:
        issuer.close()


@pytest.mark.parametrize("policy", ["scripted", "controller", "default", "all-on"])
def test_engine_greedy_tokens_identical_whatever_the_parts(
    policy: str, offloaded: tuple[Any, list[Any]]
) -> None:
    tmp, cases = offloaded
    controller: PartsPolicy | None = {
        "scripted": ScriptedParts(),
        # switches as often as it can: the fewest pairs, no settling, no margin
        "controller": PDController(
            min_pairs=2, max_pairs=2, warmup=0, hold=0, settle=0, margin=0.0, alpha=0.5
        ),
        "default": None,  # PD's preset builds its own PDController
        "all-on": None,
    }[policy]
    baseline = "PD-all-on" if policy == "all-on" else "PD"
    eng, issuer = offloaded_pd_engine(tmp, baseline, controller)
    try:
        ids = [eng.add_request(p, max_new_tokens=14) for p, _ in cases]
        done = eng.run_until_done(max_steps=400)
        for rid, (_, ref) in zip(ids, cases, strict=True):
            assert done[rid].output == ref, (policy, rid)
            assert done[rid].error is None
        assert eng.prefetch_failures == 0
        assert int(np.asarray(eng.adapter.cache.pins).sum()) == 0
        if policy == "all-on":
            assert eng.parts is None and eng.stream is not None
            return
        assert eng.parts is not None
        assert eng.parts.available == ALL_ON  # every part was switchable
        # the acceptance estimates of finished requests are not kept
        assert eng.parts.survival.request_ids() == []
        if policy == "scripted":
            assert isinstance(controller, ScriptedParts)
            seen = set(controller.seen)
            # the parts really were switched: every combination ran
            assert len(seen) == 8
            assert eng.batcher.shadow_executed_steps > 0  # type: ignore[attr-defined]
            # and the two schedulers did choose different batches
            assert eng.batcher.differing_steps > 0  # type: ignore[attr-defined]
            assert eng.parts.stream is not None and eng.parts.stream.bytes_submitted > 0
            m = controller.measured
            assert m.wall_s > 0 and m.exposed_fetch_s >= 0 and m.bytes_in is not None
            # each verified request is expected to commit its bonus token and at
            # most every draft it verified
            e = m.expected_committed_tokens
            assert e is not None and m.verified
            assert 1.0 <= e <= m.verified_tokens
        if policy == "controller":
            assert isinstance(controller, PDController)
            assert controller.summary()["probes"] > 0
    finally:
        issuer.close()


def test_pd_row_records_the_controllers_decisions(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdflash.bench.engine_run import RunSpec, run_spec

    from pdflash.report.schema import validate_row

    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    spec = RunSpec(
        arch="tiny",
        baseline="PD",
        concurrency=4,
        block_size=6,
        max_new_tokens=24,
        prompt_len=6,
        device="cpu",
        emulated_link_gbps=0.5,
    )
    row = run_spec(spec).row
    assert validate_row(row) == []
    assert row["parts_controller"] is True
    # the configuration PD was built with, whatever the controller left on at the end
    assert row["route_ahead"] and row["streaming_prefetch"] and row["batching"] == "deficit_2d"
    parts = row["pd_parts"]
    assert parts["policy"] == "paired-steps" and parts["steps"] == row["steps"]
    assert parts["available"] == {"stream": True, "route_ahead": True, "scheduler_2d": True}
    assert all(0.0 <= f <= 1.0 for f in parts["on_fraction"].values())
    assert parts["switches"] >= 0 and all("why" in d for d in parts["decisions"])


def test_stall_ready_adds_only_completed_spans_without_synchronizing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    from pdflash.engine.timing import _Span

    class Event:
        def __init__(self, t_ms: float, done: bool) -> None:
            self.t_ms, self.done = t_ms, done

        def query(self) -> bool:
            return self.done

        def elapsed_time(self, end: Event) -> float:
            return end.t_ms - self.t_ms

    def no_sync() -> None:
        raise AssertionError("ready_s must not synchronize the device")

    monkeypatch.setattr(torch.cuda, "synchronize", no_sync)
    span = _Span(cuda=True)
    span.pairs = [
        (Event(0, True), Event(2, True)),
        (Event(5, True), Event(8, True)),
        (Event(9, True), Event(20, False)),  # still running on the device
        (Event(21, False), Event(22, False)),
    ]
    assert span.ready_s() == pytest.approx(0.005)
    assert len(span.pairs) == 2
    span.pairs[0][1].done = True
    span.pairs[1] = (Event(21, True), Event(22, True))
    assert span.ready_s() == pytest.approx(0.005 + 0.011 + 0.001)
    assert span.pairs == []


def test_a_step_whose_rate_overflows_is_left_out_of_the_test() -> None:
    # a subnormal wall makes a step's rate inf; its ratio to a finite rate is
    # 0, whose log is undefined: such pairs are left out, nothing raises
    ctl = PDController(min_pairs=2, max_pairs=3, settle=0, warmup=0, hold=0)
    ctl.bind(PartsState(True, True, True))
    for i in range(60):
        ctl.observe(
            StepMeasurement(
                wall_s=5e-324 if i % 3 == 0 else 1.0 + 0.01 * (i % 5),
                committed_tokens=2,
                verified_tokens=8,
                admitted=0,
                verified=True,
                exposed_fetch_s=0.0,
                part_host_s=dict.fromkeys(PARTS, 0.0),
            )
        )
    assert ctl.summary()["probes"] >= 1


def test_configured_is_the_decided_configuration_while_a_probe_flips_a_part() -> None:
    """Outside a probe ``configured`` is ``parts``; inside one, ``parts``
    is arm A or the flipped arm B by turns, and ``configured`` stays the
    configuration the probe started from (no decision chose arm B)."""
    ctl = PDController()
    ctl.bind(PartsState(host_experts=False))
    plant = Plant({})  # no part changes anything: no probe switches
    flipped = False
    for _ in range(200):
        if ctl.parts != ctl.configured:
            flipped = True
            assert ctl.configured == PartsState(host_experts=False)
            assert sum(ctl.parts.on(p) != ctl.configured.on(p) for p in PARTS) == 1
        else:
            assert ctl.configured == ctl.parts
        ctl.observe(plant.step(ctl.parts))
    assert flipped, "no probe ran"
    assert switches(ctl) == []


class _Recording(FixedParts):
    """Every part on but the 2-D scheduler (the token-only one batches
    several requests a step), every measurement kept."""

    def __init__(self) -> None:
        super().__init__(PartsState(scheduler_2d=False))
        self.measured: list[StepMeasurement] = []

    def observe(self, m: StepMeasurement) -> PartsState:
        self.measured.append(m)
        return super().observe(m)


def test_steps_report_route_aheads_batch_books_as_the_route_ahead_stats_count_them(
    offloaded: tuple[Any, list[Any]],
) -> None:
    """Differential: each step's named/routed route-ahead pairs (the gate's
    reading) add up to the batch scope of the route-ahead stats' own
    accumulator over the same verifies."""
    from pdflash.routeahead import RouteAheadStats

    def with_stats(eng: Any) -> None:
        eng.route_stats = RouteAheadStats.for_adapter(eng.adapter)

    with _recorded_pd_run(offloaded, prepare=with_stats) as (eng, policy):
        batch = eng.route_stats.snapshot().batch
        named = sum(m.route_ahead_predicted for m in policy.measured)
        hits = sum(m.route_ahead_hits for m in policy.measured)
        assert named == batch.predicted > 0 and hits == batch.hits > 0
        assert (named, hits) == (eng.route_ahead_predicted_n, eng.route_ahead_hit_n)
        # batches of several requests name fewer pairs than their requests' sum
        assert batch.predicted < eng.route_stats.snapshot().request.predicted


@pytest.mark.parametrize(
    ("setting", "gate", "cost"),
    [
        ("precision_cost", ROUTE_AHEAD_GATE_PRECISION, True),
        ("precision", ROUTE_AHEAD_GATE_PRECISION, False),
        ("off", None, False),
    ],
)
def test_the_engines_controller_gates_route_ahead_as_configured(
    setting: str, gate: float | None, cost: bool, offloaded: tuple[Any, list[Any]]
) -> None:
    tmp, _ = offloaded
    eng, issuer = offloaded_pd_engine(tmp, "PD", None, route_ahead_gate=setting)
    issuer.close()
    assert isinstance(eng.parts.policy, PDController)
    assert eng.parts.policy.route_ahead_gate == gate
    assert eng.parts.policy.route_ahead_cost_gate is cost
    settings = eng.parts.policy.summary()["settings"]
    assert settings["route_ahead_gate"] == gate and settings["route_ahead_cost_gate"] is cost


def test_steps_measure_one_experts_copy_time_at_the_issuers_rate(
    offloaded: tuple[Any, list[Any]],
) -> None:
    """Each step's ``expert_copy_s`` is the cache's expert bytes at the
    issuer's link-rate estimate as it stood (the gate's cost bound reads
    it), once the issuer has one."""
    from pdflash.engine.verify_width import link_rate_of

    with _recorded_pd_run(offloaded) as (eng, policy):
        rate = link_rate_of(eng.expert_cache)  # while the issuer is open
        measured = [m.expert_copy_s for m in policy.measured if m.expert_copy_s is not None]
        assert rate is not None and measured
        assert all(c > 0.0 for c in measured)
        # the last step's reading is the rate as it stands after the run
        last = policy.measured[-1].expert_copy_s
        assert last == pytest.approx(eng.expert_cache.expert_nbytes / rate)


def test_prefetching_parts_books_charge_every_prefetch_stage_and_the_forward_hooks(
    offloaded: tuple[Any, list[Any]],
) -> None:
    """Differential: each step's books charge the stream the prefetch
    stages that change with it (the copies issued before the verify, the
    stream's plans, the forward hooks), and route-ahead those plus its
    predictor's span; over the run they add up to the prefetcher's own
    stage seconds and the compute timer's ``predict`` spans."""
    with _recorded_pd_run(offloaded) as (eng, policy):
        stages = eng.prefetch.stage_s
        assert stages["forward_hooks"] > 0.0 and stages["stream_plan"] > 0.0
        machinery = sum(stages.get(k, 0.0) for k in ("route_ahead", "stream_plan", "forward_hooks"))
        stream = sum(m.books_host_s["stream"] for m in policy.measured)
        route_ahead = sum(m.books_host_s["route_ahead"] for m in policy.measured)
        assert stream == pytest.approx(machinery, rel=1e-9)
        assert route_ahead == pytest.approx(machinery + eng.timer.kind_s("predict"), rel=1e-9)
        # the books charge more than the part's own time: the hooks and plans
        assert route_ahead > sum(m.part_host_s["route_ahead"] for m in policy.measured)


def test_route_aheads_books_charge_the_predictors_span_not_the_hosts_wall(
    offloaded: tuple[Any, list[Any]],
) -> None:
    """The steps' route-ahead seconds add up to the compute timer's
    ``predict`` spans plus the prefetch stage's route-ahead seconds: the
    predictor's own span (on CUDA its first device read waits for the draft
    queued before it; the host's wall around it, ``predict_s``, counts that
    wait and is not what the books charge)."""
    with _recorded_pd_run(offloaded) as (eng, policy):
        charged = sum(m.part_host_s["route_ahead"] for m in policy.measured)
        span = eng.timer.kind_s("predict")
        assert span > 0.0 and eng.predict_s > span  # the host's bracket is the wider
        route_ahead_stage = eng.prefetch.stage_s.get("route_ahead", 0.0)
        assert charged == pytest.approx(span + route_ahead_stage, rel=1e-9)
