"""Which rows of a drafted block PD's route-ahead predicts for
(``route_ahead_horizon``) as a run setting: an engine configuration field
the engine obeys, a RunSpec field with the engine's default, checked, keyed
by the report where the label runs route-ahead, and settable on an issue-16
arm."""

from __future__ import annotations

import pytest
from bench_fixtures import check_an_issue16_arm_sets
from pdflash.bench.engine_run import RunSpec

from pdflash.engine.config import ROUTE_AHEAD_HORIZONS, EngineConfig
from pdflash.labels import BASELINES
from pdflash.report.schema import ROUTE_AHEAD_LABELS, RUN_SETTINGS, row_key, spec_settings

(SETTING,) = [s for s in RUN_SETTINGS if s.name == "route_ahead_horizon"]


def test_the_default_is_the_engines_and_reaches_its_configuration() -> None:
    assert SETTING.default == EngineConfig().route_ahead_horizon == "acceptance"
    assert ROUTE_AHEAD_HORIZONS == ("acceptance", "verified")
    assert RunSpec(arch="tiny", baseline="PD").route_ahead_horizon == "acceptance"
    spec = RunSpec(arch="tiny", baseline="PD+host", route_ahead_horizon="verified")
    assert spec.engine_config().route_ahead_horizon == "verified"


def test_a_bad_value_is_refused() -> None:
    with pytest.raises(ValueError, match="route_ahead_horizon must be one of"):
        RunSpec(arch="tiny", baseline="PD", route_ahead_horizon="all").validate()
    with pytest.raises(ValueError, match="route_ahead_horizon must be one of"):
        EngineConfig.preset("PD", route_ahead_horizon="all")


def test_the_route_ahead_labels_mirror_the_presets() -> None:
    assert {b for b in BASELINES if EngineConfig.preset(b).route_ahead} == ROUTE_AHEAD_LABELS


def test_specs_and_rows_are_keyed_by_it_where_route_ahead_runs() -> None:
    base = {"arch": "tiny", "baseline": "PD", "concurrency": 4, "cache_fraction": 0.2}
    assert spec_settings(base) == spec_settings({**base, "route_ahead_horizon": "acceptance"})
    assert spec_settings(base) != spec_settings({**base, "route_ahead_horizon": "verified"})
    # no route-ahead, or a full cache that predicts nothing: any value is the default run
    for plain in ({**base, "baseline": "B1"}, {**base, "baseline": "PD-no-route-ahead"}):
        assert spec_settings(plain) == spec_settings({**plain, "route_ahead_horizon": "verified"})
    full = {**base, "cache_fraction": 1.0}
    assert spec_settings(full) == spec_settings({**full, "route_ahead_horizon": "verified"})
    row = {"arch": "tiny", "baseline": "PD", "concurrency": 4, "cache_fraction": 0.2}
    # a row without route-ahead, or older than the setting, reads as the default
    assert SETTING.of_row({**row, "route_ahead_horizon": None}) == "acceptance"
    assert SETTING.of_row(row) == "acceptance"
    assert row_key({**row, "route_ahead_horizon": "acceptance"}) == row_key(row)
    assert row_key({**row, "route_ahead_horizon": "verified"}) != row_key(row)


def test_an_issue16_arm_sets_it() -> None:
    check_an_issue16_arm_sets("route_ahead_horizon", "verified", "verified")
