"""The route-ahead gate's shadow check (``route_ahead_shadow_check``) as a
run setting (opt-in): a RunSpec field with the engine's default, checked, reaching
the engine configuration and its controller, keyed by the report only where
the gate acts, read as False for rows whose gate recorded no shadow check
(older than it), recorded by runs, and settable on an issue-16 arm (the A/B
of the check against the gate's paired probes)."""

from __future__ import annotations

from typing import Any

import pytest
from bench_fixtures import TINY_ONE_CLIENT_RUN, check_an_issue16_arm_sets, pd_row
from pdflash.bench.engine_run import RunSpec, run_spec

from pdflash.engine.config import EngineConfig
from pdflash.engine.pd_controller import ROUTE_AHEAD_GATE_PRECISION
from pdflash.report.schema import RUN_SETTINGS, row_key, spec_settings

(SETTING,) = [s for s in RUN_SETTINGS if s.name == "route_ahead_shadow_check"]


def test_the_default_is_the_engines_and_reaches_its_configuration() -> None:
    # opt-in until a GPU A/B shows it pays
    assert SETTING.default is EngineConfig().route_ahead_shadow_check is False
    assert RunSpec(arch="tiny", baseline="PD").route_ahead_shadow_check is False
    for check in (True, False):
        spec = RunSpec(arch="tiny", baseline="PD", route_ahead_shadow_check=check)
        spec.validate()
        assert spec.engine_config().route_ahead_shadow_check is check
    with pytest.raises(ValueError, match="route_ahead_shadow_check"):
        RunSpec(arch="tiny", baseline="PD", route_ahead_shadow_check="no").validate()  # type: ignore[arg-type]


def test_specs_are_keyed_by_it_where_the_gate_acts() -> None:
    base = {"arch": "tiny", "baseline": "PD", "concurrency": 1, "cache_fraction": 0.2}
    assert spec_settings(base) == spec_settings({**base, "route_ahead_shadow_check": False})
    assert spec_settings(base) != spec_settings({**base, "route_ahead_shadow_check": True})
    for other in (
        {"route_ahead_gate": "off"},  # no gate, no check
        {"baseline": "PD+host"},  # the gate does not act
        {"baseline": "B1"},
        {"baseline": "PD-all-on"},
        {"cache_fraction": 1.0},
        {"gpus": 2},
    ):
        spec = {**base, **other}
        assert spec_settings(spec) == spec_settings({**spec, "route_ahead_shadow_check": True})


def test_rows_read_the_check_their_controller_ran() -> None:
    def parts(**settings: Any) -> dict[str, Any]:
        return {"settings": {"route_ahead_gate": ROUTE_AHEAD_GATE_PRECISION, **settings}}

    checked = parts(route_ahead_cost_gate=True, route_ahead_shadow_check=True)
    ablated = parts(route_ahead_cost_gate=True, route_ahead_shadow_check=False)
    before = parts(route_ahead_cost_gate=True)  # recorded before the check
    assert SETTING.of_row(pd_row(route_ahead_shadow_check=True, pd_parts=checked)) is True
    assert SETTING.of_row(pd_row(route_ahead_shadow_check=False, pd_parts=ablated)) is False
    assert SETTING.of_row(pd_row(pd_parts=before)) is False
    spec_row = pd_row(spec={"arch": "tiny", "baseline": "PD"}, pd_parts=before)
    assert SETTING.of_row(spec_row) is False
    # no gate recorded, or none acting: the default, as the spec's
    assert SETTING.of_row(pd_row(pd_parts={"settings": {"route_ahead_gate": None}})) is False
    assert SETTING.of_row(pd_row(baseline="PD+host", pd_parts=before)) is False
    assert SETTING.of_row(pd_row()) is False
    assert row_key(pd_row(pd_parts=before)) != row_key(pd_row(pd_parts=checked))
    assert row_key(pd_row(pd_parts=before)) == row_key(pd_row(pd_parts=ablated))


def test_a_run_records_it() -> None:
    pd = run_spec(RunSpec(baseline="PD", route_ahead_shadow_check=True, **TINY_ONE_CLIENT_RUN)).row
    assert pd["route_ahead_shadow_check"] is True
    assert pd["pd_parts"]["settings"]["route_ahead_shadow_check"] is True
    assert "route_ahead_shadow_steps" in pd["pd_parts"]
    assert SETTING.of_row(pd) is True
    default = run_spec(RunSpec(baseline="PD", **TINY_ONE_CLIENT_RUN)).row
    assert default["route_ahead_shadow_check"] is False
    assert default["pd_parts"]["settings"]["route_ahead_shadow_check"] is False
    assert SETTING.of_row(default) is False and row_key(pd) != row_key(default)
    off = run_spec(RunSpec(baseline="PD", route_ahead_gate="off", **TINY_ONE_CLIENT_RUN)).row
    assert off["route_ahead_shadow_check"] is None and SETTING.of_row(off) is False
    b1 = run_spec(RunSpec(baseline="B1", **TINY_ONE_CLIENT_RUN)).row
    assert b1["route_ahead_shadow_check"] is None and SETTING.of_row(b1) is False


def test_an_issue16_arm_sets_it() -> None:
    check_an_issue16_arm_sets("route_ahead_shadow_check", "true", True)
