"""The PD controller (pdflash.engine.pd_controller): synthetic measurement
sequences (a part that costs more than it saves goes off, one that pays
stays on, a shift re-enables, noise does not flap), a bounded switch rate
for any measurements (hypothesis), and the engine's greedy tokens identical
whatever the parts do."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdflash.engine.pd_controller import (
    ALL_ON,
    PARTS,
    FixedParts,
    PartsPolicy,
    PartsState,
    PDController,
    StepMeasurement,
)

#: wall seconds of one step with every part's effect 1.0
BASE_WALL = 0.1
TOKENS = 64


class Plant:
    """A synthetic engine: a step's wall time is BASE_WALL times each running
    part's factor (> 1: it costs more than it saves), times seeded noise."""

    def __init__(self, factors: dict[str, float], noise: float = 0.0, seed: int = 0) -> None:
        self.factors = dict(factors)
        self.noise = noise
        self.rng = np.random.default_rng(seed)

    def step(self, parts: PartsState) -> StepMeasurement:
        wall = BASE_WALL
        for p in PARTS:
            if parts.runs(p):
                wall *= self.factors.get(p, 1.0)
        if self.noise:
            wall *= 1.0 + float(self.rng.uniform(-self.noise, self.noise))
        return StepMeasurement(wall_s=wall, committed_tokens=TOKENS // 4, verified_tokens=TOKENS)


def drive(ctl: PartsPolicy, plant: Plant, steps: int) -> list[PartsState]:
    """Run ``steps`` steps; returns the parts each step ran with."""
    seen = []
    for _ in range(steps):
        parts = ctl.parts
        seen.append(parts)
        ctl.observe(plant.step(parts))
    return seen


# one probe = 3 windows of `window` measured steps (+ `settle` after each change)
def probe_steps(ctl: PDController) -> int:
    return 3 * ctl.window + 2 * ctl.settle


def test_a_part_that_costs_more_than_it_saves_is_switched_off_within_bound() -> None:
    ctl = PDController()
    seen = drive(ctl, Plant({"route_ahead": 1.3}), 200)
    summary = ctl.summary()
    switched = [d for d in summary["decisions"] if d["switched"]]
    assert [(d["part"], d["on"]) for d in switched] == [("route_ahead", False)]
    assert "costs more than it saves" in switched[0]["why"]
    # warm-up, a probe of the stream (probed first), then `confirm` probes of route-ahead
    bound = ctl.warmup + (1 + ctl.confirm) * probe_steps(ctl)
    off_at = switched[0]["step"]
    assert off_at <= bound, (off_at, bound)
    assert not seen[off_at].route_ahead
    # later re-probes turn it on only for their B windows, and keep it off
    after = seen[off_at:]
    assert sum(s.route_ahead for s in after) / len(after) < 0.15
    assert not seen[-1].route_ahead or summary["probes"] > 2
    assert summary["switches"] == 1
    assert summary["on_fraction"]["scheduler_2d"] > 0.9  # the others were left on
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
    # route-ahead pays: it ran except in its own probes' B windows
    assert s["on_fraction"]["route_ahead"] > 0.85


def test_a_part_that_pays_stays_on() -> None:
    ctl = PDController()
    seen = drive(ctl, Plant({"route_ahead": 0.6, "scheduler_2d": 0.9, "stream": 0.8}), 300)
    assert ctl.summary()["switches"] == 0
    assert all(d["why"].startswith("kept on") for d in ctl.summary()["decisions"])
    assert sum(s == ALL_ON for s in seen) / len(seen) > 0.75  # probes cost the rest


def test_a_shift_re_enables_a_part() -> None:
    ctl = PDController(hold=12)
    plant = Plant({"stream": 1.3})
    seen = drive(ctl, plant, 100)
    assert not seen[-1].stream
    plant.factors["stream"] = 0.7  # the workload shifts: streaming pays now
    seen = drive(ctl, plant, 200)
    switched = [d for d in ctl.summary()["decisions"] if d["switched"]]
    assert [(d["part"], d["on"]) for d in switched] == [("stream", False), ("stream", True)]
    assert "pays again" in switched[-1]["why"]
    # at most a hold, the probes of the parts before it and its own confirm probes
    bound = ctl.hold + (len(PARTS) - 1 + ctl.confirm) * probe_steps(ctl) + ctl.settle
    on_after = switched[-1]["step"] - 100
    assert 0 < on_after <= bound, (on_after, bound)
    # and it stays on, but for its re-probes' B windows
    rest = seen[on_after:]
    assert rest[0].stream and sum(s.stream for s in rest) / len(rest) > 0.85


@pytest.mark.parametrize("seed", range(5))
def test_no_flapping_under_noise(seed: int) -> None:
    # the parts change nothing; every step's wall time is off by up to +-10%
    ctl = PDController()
    drive(ctl, Plant({}, noise=0.10, seed=seed), 2000)
    s = ctl.summary()
    assert s["probes"] > 50
    assert s["switches"] <= 2, s["decisions"]


def test_small_noise_never_switches() -> None:
    # +-2% per step cannot make a window 5% faster than two others
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
    assert "committed tokens/s" in ctl.summary()["decisions"][0]["why"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"window": 0},
        {"confirm": 0},
        {"hold": -1},
        {"margin": -0.1},
        {"margin": float("nan")},
        {"window": 2.5},
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
    ),
    max_size=400,
)


@settings(max_examples=60, deadline=None)
@given(
    seq=measurements,
    window=st.integers(1, 4),
    confirm=st.integers(1, 3),
    settle=st.integers(0, 2),
    available=st.tuples(st.booleans(), st.booleans(), st.booleans()),
)
def test_switch_rate_is_bounded_and_decisions_are_deterministic(
    seq: list[tuple[float, int, int, bool]],
    window: int,
    confirm: int,
    settle: int,
    available: tuple[bool, bool, bool],
) -> None:
    avail = PartsState(*available)

    def run() -> tuple[PDController, list[PartsState]]:
        ctl = PDController(window=window, confirm=confirm, settle=settle, warmup=0, hold=0)
        ctl.bind(avail)
        seen = []
        for wall, tokens, admitted, verified in seq:
            seen.append(ctl.parts)
            ctl.observe(
                StepMeasurement(
                    wall_s=wall,
                    committed_tokens=tokens // 4,
                    verified_tokens=tokens,
                    admitted=admitted,
                    verified=verified,
                )
            )
        return ctl, seen

    ctl, seen = run()
    # a switch needs `confirm` whole probes of 3 windows of measured steps each
    assert ctl.summary()["switches"] <= len(seq) // (confirm * 3 * window)
    # the parts are what the engine has, and nothing else
    assert all(s == s.masked(avail) for s in seen)
    # changes of the parts: each probe changes them at most twice, a switch once more
    changes = sum(a != b for a, b in itertools.pairwise(seen))
    assert changes <= 3 * (ctl.summary()["probes"] + 1)
    _, again = run()
    assert again == seen
