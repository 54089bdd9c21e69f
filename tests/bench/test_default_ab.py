"""bench/h200/default_ab.py: its arms, and the arm whose controller constant
is changed for its runs only."""

from __future__ import annotations

import argparse
import math
from typing import Any

import pytest
from bench_fixtures import load_bench_script

from pdflash.engine import pd_controller

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
    assert specs["PDwcost0"]["verify_width"] == "adaptive:cost=0"
    with pytest.raises(SystemExit, match="unknown arm 'PDx'"):
        default_ab._arm_specs(["PDx"], base)
