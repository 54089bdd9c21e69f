"""bench/h200/default_ab.py: its arms, and the arm whose controller constant
is changed for its runs only."""

from __future__ import annotations

import argparse
import math
from typing import Any

import pytest
from bench_fixtures import load_bench_script

from pdflash.engine import pd_controller
from pdflash.engine.verify_width import AdaptiveWidth

default_ab = load_bench_script("default_ab.py")


class _Row:
    def __init__(self, row: dict[str, Any]) -> None:
        self.row = row


def _settings() -> dict[str, Any]:
    from pdflash.engine.pd_controller import ROUTE_AHEAD_GATE_PRECISION, PDController

    ctl = PDController(route_ahead_gate=ROUTE_AHEAD_GATE_PRECISION, route_ahead_cost_gate=True)
    return dict(ctl.summary()["settings"])


def test_a_patched_arm_changes_its_constant_for_its_run_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = pd_controller.ROUTE_AHEAD_COST_CLEAR
    assert math.isfinite(before)
    seen: list[float] = []

    def fake_run_spec(spec: Any) -> _Row:
        seen.append(pd_controller.ROUTE_AHEAD_COST_CLEAR)
        return _Row({"output_tokens_per_s": 1.0})

    monkeypatch.setattr(default_ab, "run_spec", fake_run_spec)
    spec = {"baseline": "PD"}
    monkeypatch.setattr(default_ab, "RunSpec", lambda **kw: kw)
    patched = default_ab.run_arm("PDnoclear", spec)
    plain = default_ab.run_arm("PD", spec)
    assert seen == [math.inf, before]
    assert before == pd_controller.ROUTE_AHEAD_COST_CLEAR
    assert patched["arm"] == "PDnoclear" and patched["arm_patch"].endswith("=inf")
    assert plain["arm"] == "PD" and "arm_patch" not in plain

    def failing_run_spec(spec: Any) -> _Row:
        raise RuntimeError("the run failed")

    # the controller's summary records the constant as its runs read it
    monkeypatch.setattr(default_ab, "run_spec", lambda spec: _Row(_settings()))
    assert default_ab.run_arm("PDnoclear", spec)["route_ahead_cost_clear"] is None
    assert default_ab.run_arm("PD", spec)["route_ahead_cost_clear"] == before

    monkeypatch.setattr(default_ab, "run_spec", failing_run_spec)
    with pytest.raises(RuntimeError, match="the run failed"):
        default_ab.run_arm("PDnoclear", spec)
    assert before == pd_controller.ROUTE_AHEAD_COST_CLEAR  # restored on failure


def test_every_arm_names_a_spec_and_unknown_arms_are_refused() -> None:
    ns = argparse.Namespace(device="cpu", emulated_link_gbps=10.0)
    base = default_ab._default_specs(ns, 1, on_gpu=False)
    names = ["B1", "B2", "PD", *default_ab.VARIANTS, *default_ab.PATCHED]
    specs = default_ab._arm_specs(names, base)
    assert list(specs) == names
    assert specs["PDnoclear"] == base["PD"]
    assert specs["PDnoraB1"]["baseline"] == "PD-no-route-ahead"
    assert specs["PDpartbooks"] == specs["PDme"] == base["PD"]
    assert specs["PDwcost0"]["verify_width"] == "adaptive:cost=0"
    # the steady-state pair: PD settled, B1 given a burst; else as the default
    assert specs["PDsettled"] == {**base["PD"], "controller_warmup": "first_round"}
    assert specs["B1warm"] == {**base["B1"], "warm_bursts": 1}
    assert specs["PDsetFcfs"] == specs["PDsetB1cfg"] == specs["PDsettled"]
    assert specs["PDsetFull"] == {**specs["PDsettled"], "verify_width": "full"}
    with pytest.raises(SystemExit, match="unknown arm 'PDx'"):
        default_ab._arm_specs(["PDx"], base)


def test_a_configured_arm_changes_the_engine_configuration_for_its_runs_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A patched arm that changes the engine configuration: its runs build
    their spec's engine configuration
    with its fields changed (recorded in ``arm_patch``); other arms' runs,
    and every run after a failed one, build it as the spec says."""
    from pdflash.bench.engine_run import RunSpec

    built: list[Any] = []

    def fake_run_spec(spec: RunSpec) -> _Row:
        built.append(spec.engine_config())
        return _Row({"output_tokens_per_s": 1.0})

    monkeypatch.setattr(default_ab, "run_spec", fake_run_spec)
    spec = {"arch": "tiny", "baseline": "PD-no-route-ahead", "concurrency": 1}
    row = default_ab.run_arm("PDnoraB1", spec)
    plain = default_ab.run_arm("PDnora", spec)
    changed, unchanged = built
    assert (changed.batching, changed.background_prefetch, changed.verify_width) == (
        "fcfs",
        False,
        "full",
    )
    assert (unchanged.batching, unchanged.background_prefetch, unchanged.verify_width) == (
        "deficit_2d",
        True,
        "adaptive",
    )
    assert row["arm"] == "PDnoraB1" and "batching=fcfs" in row["arm_patch"]
    assert plain["arm"] == "PDnora" and "arm_patch" not in plain

    def failing_run_spec(spec: RunSpec) -> _Row:
        raise RuntimeError("the run failed")

    monkeypatch.setattr(default_ab, "run_spec", failing_run_spec)
    with pytest.raises(RuntimeError, match="the run failed"):
        default_ab.run_arm("PDnoraFcfs", spec)
    assert RunSpec(**spec).engine_config().batching == "deficit_2d"  # restored on failure


def test_the_controller_patched_arms_change_the_controller_for_their_runs_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``PDme`` probes route-ahead first and judges it must-earn, and
    ``PDpartbooks`` charges the part-only books, while their runs run; the
    controller is as it was after each run."""
    parts, stances, books = (
        pd_controller.PARTS,
        pd_controller.DEFAULT_STANCES,
        pd_controller._books_host,
    )
    seen: list[tuple[Any, ...]] = []

    def fake_run_spec(spec: Any) -> _Row:
        seen.append(
            (
                pd_controller.PARTS[0],
                pd_controller.ALL_PARTS[1],
                pd_controller.DEFAULT_STANCES["route_ahead"],
                pd_controller._books_host is pd_controller._host,
            )
        )
        return _Row({"output_tokens_per_s": 1.0})

    monkeypatch.setattr(default_ab, "run_spec", fake_run_spec)
    monkeypatch.setattr(default_ab, "RunSpec", lambda **kw: kw)
    me = default_ab.run_arm("PDme", {"baseline": "PD"})
    partbooks = default_ab.run_arm("PDpartbooks", {"baseline": "PD"})
    assert seen == [
        ("route_ahead", "route_ahead", "must_earn", False),
        (parts[0], parts[0], "default_on", True),
    ]
    assert "must_earn" in me["arm_patch"] and partbooks["arm_patch"].endswith("=_host")
    assert parts == pd_controller.PARTS and pd_controller.DEFAULT_STANCES is stances
    assert pd_controller._books_host is books


def test_the_no_waits_arm_turns_the_waits_bound_off_for_its_runs_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``PDnowaits``: a controller in its run never skips a probe by the
    waits bound (its window can never hold enough steps); after the run
    the bound reads again."""
    from pdflash.engine.pd_controller import PDController

    def skipping(ctl: PDController) -> bool:
        # a controller whose route-ahead is off by its cost gate, with a
        # cost reading and a full window of steps that waited nothing
        ctl._ra_gated = True
        ctl._ra_window.append(_ra_step())
        ctl._waits_off.extend([0.0] * pd_controller.ROUTE_AHEAD_WAITS_WINDOW)
        return ctl._ra_waits_bound_text() is not None

    seen: list[bool] = []

    def fake_run_spec(spec: Any) -> _Row:
        seen.append(skipping(_bounded_controller()))
        return _Row({"output_tokens_per_s": 1.0})

    monkeypatch.setattr(default_ab, "run_spec", fake_run_spec)
    monkeypatch.setattr(default_ab, "RunSpec", lambda **kw: kw)
    row = default_ab.run_arm("PDnowaits", {"baseline": "PD"})
    default_ab.run_arm("PD", {"baseline": "PD"})
    assert seen == [False, True]
    assert "ROUTE_AHEAD_WAITS_MIN_STEPS" in row["arm_patch"]
    assert skipping(_bounded_controller())


def _bounded_controller() -> Any:
    from pdflash.engine.pd_controller import PartsState, PDController

    ctl = PDController(route_ahead_gate=0.5, route_ahead_cost_gate=True)
    ctl.bind(PartsState())
    ctl._parts = ctl._parts.with_part("route_ahead", False)  # off, as its gate leaves it
    return ctl


def _ra_step() -> Any:
    """A step of route-ahead's: 1 ms of host time, predictions that could
    save at most 1 us."""
    from pdflash.engine.pd_controller import _RouteAheadStep

    return _RouteAheadStep(named=10, hits=1, host_s=1e-3, saving_bound_s=1e-6)


def test_the_width_patched_arm_changes_the_probe_cap_for_its_runs_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``PDprobe16``'s runs stand down with a fixed 16-step probe gap; the
    class is as it was after each run, on failure too."""
    cap = AdaptiveWidth.COST_PROBE_MAX_EVERY
    assert cap > AdaptiveWidth.COST_PROBE_EVERY
    seen: list[int] = []

    def fake_run_spec(spec: Any) -> _Row:
        seen.append(AdaptiveWidth.COST_PROBE_MAX_EVERY)
        return _Row({"output_tokens_per_s": 1.0})

    monkeypatch.setattr(default_ab, "run_spec", fake_run_spec)
    monkeypatch.setattr(default_ab, "RunSpec", lambda **kw: kw)
    row = default_ab.run_arm("PDprobe16", {"baseline": "PD"})
    assert seen == [AdaptiveWidth.COST_PROBE_EVERY]
    assert (
        row["arm_patch"] == f"AdaptiveWidth.COST_PROBE_MAX_EVERY={AdaptiveWidth.COST_PROBE_EVERY}"
    )
    assert cap == AdaptiveWidth.COST_PROBE_MAX_EVERY

    def failing_run_spec(spec: Any) -> _Row:
        raise RuntimeError("the run failed")

    monkeypatch.setattr(default_ab, "run_spec", failing_run_spec)
    with pytest.raises(RuntimeError, match="the run failed"):
        default_ab.run_arm("PDprobe16", {"baseline": "PD"})
    assert cap == AdaptiveWidth.COST_PROBE_MAX_EVERY


def test_the_never_resting_arm_measures_every_step_for_its_runs_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``PDnorest``'s runs use a controller that never rests; the class's
    property is back after each run, on failure too."""
    prop = pd_controller.PDController.__dict__["resting"]
    assert isinstance(prop, property)
    seen: list[bool] = []

    def fake_run_spec(spec: Any) -> _Row:
        ctl = pd_controller.PDController()
        ctl.bind(pd_controller.PartsState(route_ahead=False))
        ctl._countdown = 50  # a hold: this controller would rest
        seen.append(ctl.resting)
        return _Row({"output_tokens_per_s": 1.0})

    monkeypatch.setattr(default_ab, "RunSpec", lambda **kw: kw)
    monkeypatch.setattr(default_ab, "run_spec", fake_run_spec)
    row = default_ab.run_arm("PDnorest", {"baseline": "PD"})
    default_ab.run_arm("PD", {"baseline": "PD"})
    assert seen == [False, True]
    assert row["arm_patch"] == "PDController.resting=False (every step measured)"
    assert pd_controller.PDController.__dict__["resting"] is prop

    def failing_run_spec(spec: Any) -> _Row:
        raise RuntimeError("the run failed")

    monkeypatch.setattr(default_ab, "run_spec", failing_run_spec)
    with pytest.raises(RuntimeError, match="the run failed"):
        default_ab.run_arm("PDnorest", {"baseline": "PD"})
    assert pd_controller.PDController.__dict__["resting"] is prop
