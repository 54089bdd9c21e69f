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

#: a PD+host row with no host setting recorded (and no spec naming one)
PD_HOST_ROW: dict[str, Any] = {
    "arch": "tiny",
    "baseline": "PD+host",
    "block_size": 16,
    "concurrency": 4,
    "cache_fraction": 0.2,
    "repeat": 0,
}


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


def spec_the_engine_suite_runs(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> RunSpec:
    """The RunSpec ``pdflash-bench engine ARGV`` hands to its first run (the
    run itself stopped before it starts)."""
    seen: list[RunSpec] = []

    def recording(spec: RunSpec, *_: Any, **__: Any) -> Any:
        seen.append(spec)
        raise _Stop

    monkeypatch.setattr(engine_run, "run_spec", recording)
    ap = argparse.ArgumentParser()
    engine.add_arguments(ap)
    with pytest.raises(_Stop):
        engine.run(ap.parse_args(argv))
    return seen[0]


def engine_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    engine.add_arguments(ap)
    return ap


def check_the_matrix_plans_spells_and_keys(
    name: str, argv: list[str], value: Any, spelled: str
) -> None:
    """A matrix planned with ``argv`` (a run setting's flag and value) gives
    every spec ``name`` = ``value`` and its command ``spelled``; one planned
    without it names no ``name`` (its specs, so its resume keys, as before)
    and is keyed apart."""
    ap = argparse.ArgumentParser()
    matrix.add_arguments(ap)
    plain_args = ap.parse_args(["--baselines", "PD+host"])
    set_args = ap.parse_args(["--baselines", "PD+host", *argv])
    plain, with_setting = matrix.plan(plain_args), matrix.plan(set_args)
    assert plain and all(name not in s for s in plain)
    assert with_setting and all(s[name] == value for s in with_setting)
    assert {matrix.spec_key(s) for s in plain}.isdisjoint(matrix.spec_key(s) for s in with_setting)
    assert argv[0] not in matrix.matrix_command(plain_args, Path("/tmp/x"))
    assert spelled in matrix.matrix_command(set_args, Path("/tmp/x"))


def test_the_engine_suite_passes_it_to_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    assert engine_parser().parse_args([]).host_ahead_min_exposed == DEFAULT_HOST_AHEAD_MIN_EXPOSED
    argv = ["--baselines", "PD+host", "--host-ahead-min-exposed", "0"]
    assert spec_the_engine_suite_runs(monkeypatch, argv).host_ahead_min_exposed == 0.0
    with pytest.raises(SystemExit):
        engine_parser().parse_args(["--host-ahead-min-exposed", "never"])


def test_the_matrix_plans_spells_and_keys_it() -> None:
    check_the_matrix_plans_spells_and_keys(
        "host_ahead_min_exposed",
        ["--host-ahead-min-exposed", "0"],
        0.0,
        "--host-ahead-min-exposed 0.0",
    )


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
    row = dict(PD_HOST_ROW)
    assert row_key(row) != row_key({**row, **recorded})
    assert row_key(row) == row_key({**row, "host_ahead_gate": {"min_exposed": 0.2}})
