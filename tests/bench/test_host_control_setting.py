"""Who decides whether PD+host's host part runs (``host_control``) as a run
setting: spelled by the engine and matrix CLIs, carried by their specs,
recorded in rows (with the controller's books showing the part on) and
keyed by the report; rows older than the setting read as ``controller``."""

from __future__ import annotations

from pathlib import Path

import pytest
from pdflash.bench.engine_run import RunSpec, run_spec
from pdflash.bench.suites import matrix

from pdflash.report.schema import RUN_SETTINGS, row_key, spec_settings, validate_row

from .test_host_ahead_gate import (
    PD_HOST_ROW,
    check_the_matrix_plans_spells_and_keys,
    engine_parser,
    spec_the_engine_suite_runs,
)

(SETTING,) = [s for s in RUN_SETTINGS if s.name == "host_control"]


def test_the_default_is_the_engines_and_the_specs() -> None:
    assert SETTING.default == RunSpec(arch="tiny", baseline="PD+host").host_control
    assert SETTING.default == "controller"
    assert matrix.HOST_DEFAULTS["host_control"] == "controller"


def test_the_engine_suite_passes_it_to_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    assert engine_parser().parse_args([]).host_control == "controller"
    argv = ["--baselines", "PD+host", "--host-control", "always"]
    assert spec_the_engine_suite_runs(monkeypatch, argv).host_control == "always"
    with pytest.raises(SystemExit):
        engine_parser().parse_args(["--host-control", "on"])


def test_the_matrix_plans_spells_and_keys_it() -> None:
    check_the_matrix_plans_spells_and_keys(
        "host_control", ["--host-control", "always"], "always", "--host-control always"
    )


def test_specs_and_rows_are_keyed_by_it() -> None:
    base = {"arch": "tiny", "baseline": "PD+host", "concurrency": 4, "cache_fraction": 0.2}
    assert spec_settings(base) == spec_settings({**base, "host_control": "controller"})
    assert spec_settings(base) != spec_settings({**base, "host_control": "always"})
    # a run without a host service runs no host part: always is the default run
    for plain in ({**base, "baseline": "PD"}, {**base, "baseline": "B3", "host_experts": "auto"}):
        assert spec_settings(plain) == spec_settings({**plain, "host_control": "always"})
    hosted = {**base, "baseline": "PD", "host_experts": "auto"}
    assert spec_settings(hosted) != spec_settings({**hosted, "host_control": "always"})
    row = dict(PD_HOST_ROW)
    # a row older than the setting (no record, no spec naming it): the controller
    assert SETTING.of_row(row) == "controller"
    assert SETTING.of_row({**row, "spec": dict(base)}) == "controller"
    assert SETTING.of_row({**row, "host_control": "always"}) == "always"
    assert row_key(row) == row_key({**row, "host_control": "controller"})
    assert row_key(row) != row_key({**row, "host_control": "always"})


def test_a_run_records_it_with_the_host_part_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    spec = RunSpec(
        arch="tiny-gpt_oss",
        baseline="PD+host",
        concurrency=2,
        block_size=6,
        max_new_tokens=12,
        prompt_len=6,
        device="cpu",
        emulated_link_gbps=0.002,
        host_max_ratio=50.0,
        host_control="always",
    )
    row = run_spec(spec).row
    assert validate_row(row) == [], validate_row(row)
    assert row["host_control"] == "always" and SETTING.of_row(row) == "always"
    parts = row["pd_parts"]
    assert parts["policy"] == "paired-steps"
    assert parts["settings"]["host_control"] == "always"
    assert parts["on_fraction"]["host_experts"] == 1.0
    assert [d for d in parts["decisions"] if d["part"] == "host_experts"] == []
    assert row["host_served_experts"] > 0
