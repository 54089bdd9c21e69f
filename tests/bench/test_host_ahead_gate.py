"""The pre-verify host plan's gate as a run setting
(``host_ahead_min_exposed``): validated, spelled by the engine and matrix
CLIs, carried by their specs, recorded in rows and keyed by the report."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
from pdflash.bench import engine_run
from pdflash.bench.engine_run import RunSpec
from pdflash.bench.suites import engine, matrix

from pdflash.engine.config import DEFAULT_HOST_AHEAD_MIN_EXPOSED
from pdflash.report.schema import RUN_SETTINGS, row_key, spec_settings

(SETTING,) = [s for s in RUN_SETTINGS if s.name == "host_ahead_min_exposed"]


def test_the_default_is_the_engines_and_the_specs() -> None:
    assert DEFAULT_HOST_AHEAD_MIN_EXPOSED == 0.2
    assert SETTING.default == RunSpec(arch="tiny", baseline="PD+host").host_ahead_min_exposed
    assert SETTING.default == DEFAULT_HOST_AHEAD_MIN_EXPOSED
    assert matrix.HOST_DEFAULTS["host_ahead_min_exposed"] == DEFAULT_HOST_AHEAD_MIN_EXPOSED
    RunSpec(arch="tiny-gpt_oss", baseline="PD+host", host_ahead_min_exposed=0).validate()
    with pytest.raises(ValueError, match=r"host_ahead_min_exposed must be a share in \[0, 1\]"):
        RunSpec(arch="tiny-gpt_oss", baseline="PD+host", host_ahead_min_exposed=-1.0).validate()


class _Stop(Exception):
    pass


def test_the_engine_suite_passes_it_to_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[RunSpec] = []

    def recording(spec: RunSpec, *_: Any, **__: Any) -> Any:
        seen.append(spec)
        raise _Stop

    monkeypatch.setattr(engine_run, "run_spec", recording)
    ap = argparse.ArgumentParser()
    engine.add_arguments(ap)
    assert ap.parse_args([]).host_ahead_min_exposed == DEFAULT_HOST_AHEAD_MIN_EXPOSED
    args = ap.parse_args(["--baselines", "PD+host", "--host-ahead-min-exposed", "0"])
    with pytest.raises(_Stop):
        engine.run(args)
    assert seen[0].host_ahead_min_exposed == 0.0
    with pytest.raises(SystemExit):
        ap.parse_args(["--host-ahead-min-exposed", "never"])


def test_the_matrix_plans_spells_and_keys_it() -> None:
    ap = argparse.ArgumentParser()
    matrix.add_arguments(ap)
    plain_args = ap.parse_args(["--baselines", "PD+host"])
    open_args = ap.parse_args(["--baselines", "PD+host", "--host-ahead-min-exposed", "0"])
    plain, gate_open = matrix.plan(plain_args), matrix.plan(open_args)
    # a plan without it is as before (its specs, so its resume keys, unchanged)
    assert plain and all("host_ahead_min_exposed" not in s for s in plain)
    assert gate_open and all(s["host_ahead_min_exposed"] == 0.0 for s in gate_open)
    assert {matrix.spec_key(s) for s in plain}.isdisjoint(matrix.spec_key(s) for s in gate_open)
    assert "--host-ahead-min-exposed" not in matrix.matrix_command(plain_args, Path("/tmp/x"))
    assert "--host-ahead-min-exposed 0.0" in matrix.matrix_command(open_args, Path("/tmp/x"))


def test_rows_are_keyed_by_the_gate_they_ran() -> None:
    base = {"arch": "tiny", "baseline": "PD+host", "concurrency": 4, "cache_fraction": 0.2}
    # an int or a float share is one setting; the default is the omitted one
    assert spec_settings({**base, "host_ahead_min_exposed": 0}) == spec_settings(
        {**base, "host_ahead_min_exposed": 0.0}
    )
    assert spec_settings(base) == spec_settings({**base, "host_ahead_min_exposed": 0.2})
    assert spec_settings(base) != spec_settings({**base, "host_ahead_min_exposed": 0.0})
    # rows without a spec: the gate the row recorded; none recorded (no host
    # service, or a row older than the record): the default
    assert SETTING.recorded is not None
    recorded = {"host_ahead_gate": {"min_exposed": 0.0, "open": 5, "closed": 0}}
    assert SETTING.recorded(recorded) == 0.0
    assert SETTING.recorded({"host_ahead_gate": None}) == 0.2
    assert SETTING.recorded({}) == 0.2
    row: dict[str, Any] = {
        "arch": "tiny",
        "baseline": "PD+host",
        "block_size": 16,
        "concurrency": 4,
        "cache_fraction": 0.2,
        "repeat": 0,
    }
    assert row_key(row) != row_key({**row, **recorded})
    assert row_key(row) == row_key({**row, "host_ahead_gate": {"min_exposed": 0.2}})
