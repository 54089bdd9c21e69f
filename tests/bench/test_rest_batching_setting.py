"""How steps are batched while PD's controller rests (``rest_batching``) as
a run setting: a RunSpec field with the engine's default, checked, reaching
the engine configuration, keyed by the report only where PD's controller
runs, read as ``scheduler`` for rows of a resting controller recorded before
at-rest first-come batching, recorded by runs, and settable on the matrix
command and an issue-16 arm."""

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

from pdflash.engine.config import REST_BATCHINGS, EngineConfig
from pdflash.report.schema import RUN_SETTINGS, row_key, spec_settings

(SETTING,) = [s for s in RUN_SETTINGS if s.name == "rest_batching"]


def test_the_default_is_the_engines_and_reaches_its_configuration() -> None:
    assert REST_BATCHINGS == ("first_come", "scheduler")
    assert SETTING.default == EngineConfig().rest_batching == "first_come"
    assert RunSpec(arch="tiny", baseline="PD").rest_batching == "first_come"
    for setting in REST_BATCHINGS:
        spec = RunSpec(arch="tiny", baseline="PD", rest_batching=setting)
        spec.validate()
        assert spec.engine_config().rest_batching == setting
    with pytest.raises(ValueError, match="rest_batching"):
        RunSpec(arch="tiny", baseline="PD", rest_batching="fcfs").validate()


def test_specs_are_keyed_by_it_where_the_controller_runs() -> None:
    base = {"arch": "tiny", "baseline": "PD", "concurrency": 1, "cache_fraction": 0.2}
    assert spec_settings(base) == spec_settings({**base, "rest_batching": "first_come"})
    assert spec_settings(base) != spec_settings({**base, "rest_batching": "scheduler"})
    hosted = {**base, "baseline": "PD+host"}
    assert spec_settings(hosted) != spec_settings({**hosted, "rest_batching": "scheduler"})
    for other in (
        {"baseline": "B1"},  # no controller
        {"baseline": "PD-all-on"},
        {"cache_fraction": 1.0},  # a full cache runs no controller
        {"gpus": 2},  # ranks run PD's parts fixed
    ):
        spec = {**base, **other}
        assert spec_settings(spec) == spec_settings({**spec, "rest_batching": "scheduler"})


def test_rows_read_the_batching_their_rest_ran() -> None:
    rested = {"rest_steps": 70}
    since = {"setting": "adaptive", "controller_rest_steps": 68}  # at-rest first-come's rows
    before = {"setting": "adaptive"}  # recorded before it
    assert SETTING.of_row(pd_row(rest_batching="scheduler", pd_parts=rested)) == "scheduler"
    assert SETTING.of_row(pd_row(rest_batching="first_come", pd_parts=rested)) == "first_come"
    assert SETTING.of_row(pd_row(pd_parts=rested, verify_width=since)) == "first_come"
    assert SETTING.of_row(pd_row(pd_parts=rested, verify_width=before)) == "scheduler"
    spec_row = pd_row(spec={"arch": "tiny", "baseline": "PD"}, pd_parts=rested)
    assert SETTING.of_row({**spec_row, "verify_width": before}) == "scheduler"
    # no resting controller recorded: the spec's or the default
    assert SETTING.of_row(pd_row()) == "first_come"
    assert SETTING.of_row(pd_row(baseline="B1", verify_width=before)) == "first_come"
    old = pd_row(pd_parts=rested, verify_width=before)
    assert row_key(old) != row_key(pd_row(pd_parts=rested, verify_width=since))
    assert row_key(old) == row_key(pd_row(rest_batching="scheduler", verify_width=before))


def test_a_run_records_it() -> None:
    pd = run_spec(RunSpec(baseline="PD", **TINY_ONE_CLIENT_RUN)).row
    assert pd["rest_batching"] == "first_come" and SETTING.of_row(pd) == "first_come"
    turns = run_spec(RunSpec(baseline="PD", rest_batching="scheduler", **TINY_ONE_CLIENT_RUN)).row
    assert turns["rest_batching"] == "scheduler" and SETTING.of_row(turns) == "scheduler"
    assert row_key(pd) != row_key(turns)
    b1 = run_spec(RunSpec(baseline="B1", **TINY_ONE_CLIENT_RUN)).row
    assert b1["rest_batching"] is None and SETTING.of_row(b1) == "first_come"


def test_an_issue16_arm_sets_it() -> None:
    check_an_issue16_arm_sets("rest_batching", "scheduler", "scheduler")


def test_the_matrix_option_reaches_the_spec_key_and_command(tmp_path: Path) -> None:
    check_a_matrix_option_keys_its_runs(
        PD_MATRIX_ARGV, "--rest-batching", "scheduler", "rest_batching", tmp_path / "o"
    )
