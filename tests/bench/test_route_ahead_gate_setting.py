"""PD's route-ahead gate (``route_ahead_gate``) as a run setting: a RunSpec
field with the engine's default, checked, reaching the engine configuration
and its controller, keyed by the report only where PD's controller runs
route-ahead, read as ``off`` for rows whose controller ran without it and as
``precision`` for rows whose gate had no cost bound, recorded by runs, and
settable on the matrix command and an issue-16 arm."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_fixtures import (
    PD_MATRIX_ARGV,
    TINY_ONE_CLIENT_RUN,
    check_a_matrix_option_keys_its_runs,
    check_an_issue16_arm_sets,
    pd_row,
)
from pdflash.bench.engine_run import RunSpec, run_spec

from pdflash.engine.config import ROUTE_AHEAD_GATES, EngineConfig
from pdflash.engine.pd_controller import ROUTE_AHEAD_GATE_PRECISION
from pdflash.report.schema import RUN_SETTINGS, row_key, spec_settings

(SETTING,) = [s for s in RUN_SETTINGS if s.name == "route_ahead_gate"]


def test_the_default_is_the_engines_and_reaches_its_configuration() -> None:
    assert ROUTE_AHEAD_GATES == ("precision_cost", "precision", "off")
    assert SETTING.default == EngineConfig().route_ahead_gate == "precision_cost"
    assert RunSpec(arch="tiny", baseline="PD").route_ahead_gate == "precision_cost"
    for gate in ROUTE_AHEAD_GATES:
        spec = RunSpec(arch="tiny", baseline="PD", route_ahead_gate=gate)
        spec.validate()
        assert spec.engine_config().route_ahead_gate == gate
    with pytest.raises(ValueError, match="route_ahead_gate"):
        EngineConfig(route_ahead_gate="on")
    with pytest.raises(ValueError, match="route_ahead_gate"):
        RunSpec(arch="tiny", baseline="PD", route_ahead_gate="on").validate()


def test_specs_are_keyed_by_it_where_the_controller_runs_route_ahead() -> None:
    base = {"arch": "tiny", "baseline": "PD", "concurrency": 1, "cache_fraction": 0.2}
    assert spec_settings(base) == spec_settings({**base, "route_ahead_gate": "precision_cost"})
    assert spec_settings(base) != spec_settings({**base, "route_ahead_gate": "precision"})
    assert spec_settings(base) != spec_settings({**base, "route_ahead_gate": "off"})
    full_width = {**base, "baseline": "PD-full-width"}
    assert spec_settings(full_width) != spec_settings({**full_width, "route_ahead_gate": "off"})
    for other in (
        {"baseline": "PD+host"},  # the host planner reads the predictions: no gate
        {"host_experts": "auto"},
        {"baseline": "B1"},  # no route-ahead
        {"baseline": "PD-all-on"},  # no controller
        {"baseline": "PD-no-route-ahead"},
        {"cache_fraction": 1.0},  # a full cache runs no controller
        {"gpus": 2},  # ranks run PD's parts fixed
    ):
        spec = {**base, **other}
        assert spec_settings(spec) == spec_settings({**spec, "route_ahead_gate": "off"})


def test_rows_read_the_gate_their_controller_ran() -> None:
    bounded = {
        "settings": {"route_ahead_gate": ROUTE_AHEAD_GATE_PRECISION, "route_ahead_cost_gate": True}
    }
    precision = {
        "settings": {"route_ahead_gate": ROUTE_AHEAD_GATE_PRECISION, "route_ahead_cost_gate": False}
    }
    # recorded before the cost bound existed: the gate on precision alone
    gated = {"settings": {"route_ahead_gate": ROUTE_AHEAD_GATE_PRECISION}}
    ungated = {"settings": {"route_ahead_gate": None}}
    before = {"settings": {"margin": 0.05}}  # recorded before the gate existed
    row = pd_row(route_ahead_gate="precision_cost", pd_parts=bounded)
    assert SETTING.of_row(row) == "precision_cost"
    assert SETTING.of_row(pd_row(route_ahead_gate="precision", pd_parts=precision)) == "precision"
    assert SETTING.of_row(pd_row(route_ahead_gate="precision", pd_parts=gated)) == "precision"
    assert SETTING.of_row(pd_row(pd_parts=gated)) == "precision"
    assert SETTING.of_row(pd_row(route_ahead_gate="off", pd_parts=ungated)) == "off"
    assert SETTING.of_row(pd_row(pd_parts=before)) == "off"
    spec_row = pd_row(spec={"arch": "tiny", "baseline": "PD"}, pd_parts=before)
    assert SETTING.of_row(spec_row) == "off"
    # a row that records no controller reads as its spec or the default
    assert SETTING.of_row(pd_row()) == "precision_cost"
    # where the gate does not act (a host service) an old row is no "off" run
    assert SETTING.of_row(pd_row(baseline="PD+host", pd_parts=before)) == "precision_cost"
    hosted = pd_row(host_experts="auto", pd_parts=before)
    assert SETTING.of_row(hosted) == "precision_cost"
    assert row_key(pd_row(pd_parts=before)) != row_key(pd_row(pd_parts=gated))
    assert row_key(pd_row(pd_parts=gated)) != row_key(pd_row(pd_parts=bounded))
    assert row_key(pd_row(pd_parts=bounded)) == row_key(pd_row())


def test_a_run_records_it() -> None:
    pd = run_spec(RunSpec(baseline="PD", **TINY_ONE_CLIENT_RUN)).row
    assert pd["route_ahead_gate"] == "precision_cost"
    assert pd["pd_parts"]["settings"]["route_ahead_gate"] == ROUTE_AHEAD_GATE_PRECISION
    assert pd["pd_parts"]["settings"]["route_ahead_cost_gate"] is True
    assert SETTING.of_row(pd) == "precision_cost"
    precision = run_spec(
        RunSpec(baseline="PD", route_ahead_gate="precision", **TINY_ONE_CLIENT_RUN)
    ).row
    assert precision["pd_parts"]["settings"]["route_ahead_cost_gate"] is False
    assert SETTING.of_row(precision) == "precision"
    off = run_spec(RunSpec(baseline="PD", route_ahead_gate="off", **TINY_ONE_CLIENT_RUN)).row
    assert (
        off["route_ahead_gate"] == "off" and off["pd_parts"]["settings"]["route_ahead_gate"] is None
    )
    assert SETTING.of_row(off) == "off"
    b1 = run_spec(RunSpec(baseline="B1", **TINY_ONE_CLIENT_RUN)).row
    assert b1["route_ahead_gate"] is None and SETTING.of_row(b1) == "precision_cost"


def test_an_issue16_arm_sets_it() -> None:
    check_an_issue16_arm_sets("route_ahead_gate", "off", "off")


def test_the_matrix_option_reaches_the_spec_key_and_command(tmp_path: Path) -> None:
    check_a_matrix_option_keys_its_runs(
        PD_MATRIX_ARGV, "--route-ahead-gate", "off", "route_ahead_gate", tmp_path / "o"
    )
