"""The controller warm-up (``controller_warmup``) as a run setting: workload
bursts outside the clock until PD's controller has ended its first round of
probes, so a short run starts where a server's engine is after its first
steps. Spelled by the engine and matrix CLIs, checked, keyed by the report
only for labels that run the controller, recorded in rows (how many bursts
ran, whether the round ended), and settable on an issue-16 arm."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from bench_fixtures import TINY_RUN, check_an_issue16_arm_sets
from pdflash.bench.engine_run import RunSpec, run_spec

from pdflash.engine.config import EngineConfig
from pdflash.labels import BASELINES
from pdflash.report.schema import (
    CONTROLLER_LABELS,
    RUN_SETTINGS,
    row_key,
    spec_settings,
    validate_row,
)

from .test_host_ahead_gate import (
    check_the_matrix_plans_spells_and_keys,
    engine_parser,
    spec_the_engine_suite_runs,
)

(SETTING,) = [s for s in RUN_SETTINGS if s.name == "controller_warmup"]


def test_the_default_is_off_and_a_bad_value_is_refused() -> None:
    assert SETTING.default == RunSpec(arch="tiny", baseline="PD").controller_warmup == "off"
    with pytest.raises(ValueError, match="controller_warmup"):
        RunSpec(arch="tiny", baseline="PD", controller_warmup="forever").validate()


def test_the_controller_labels_mirror_the_presets() -> None:
    assert {b for b in BASELINES if EngineConfig.preset(b).parts_controller} == CONTROLLER_LABELS


def test_the_suites_pass_it_to_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    assert engine_parser().parse_args([]).controller_warmup == "off"
    argv = ["--baselines", "PD", "--controller-warmup", "first_round"]
    assert spec_the_engine_suite_runs(monkeypatch, argv).controller_warmup == "first_round"
    with pytest.raises(SystemExit):
        engine_parser().parse_args(["--controller-warmup", "always"])
    check_the_matrix_plans_spells_and_keys(
        "controller_warmup",
        ["--controller-warmup", "first_round"],
        "first_round",
        "--controller-warmup first_round",
    )


def test_specs_and_rows_are_keyed_by_it_where_the_controller_runs() -> None:
    base = {"arch": "tiny", "baseline": "PD", "concurrency": 4, "cache_fraction": 0.2}
    assert spec_settings(base) == spec_settings({**base, "controller_warmup": "off"})
    assert spec_settings(base) != spec_settings({**base, "controller_warmup": "first_round"})
    # no controller (its label, a full cache that runs none of PD's parts, or
    # expert-parallel ranks, which run PD's parts fixed)
    for plain in (
        {**base, "baseline": "B1"},
        {**base, "baseline": "PD-all-on"},
        {**base, "cache_fraction": 1.0},
        {**base, "gpus": 2},
    ):
        assert spec_settings(plain) == spec_settings({**plain, "controller_warmup": "first_round"})
    row = {"arch": "tiny", "baseline": "PD", "concurrency": 4, "cache_fraction": 0.2}
    assert SETTING.of_row(row) == "off"  # older rows
    assert SETTING.of_row({**row, "controller_warmup": "first_round"}) == "first_round"
    assert row_key(row) == row_key({**row, "controller_warmup": "off"})
    assert row_key(row) != row_key({**row, "controller_warmup": "first_round"})


def test_an_issue16_arm_sets_it() -> None:
    check_an_issue16_arm_sets("controller_warmup", "first_round", "first_round")


def test_a_pd_run_starts_its_clock_past_the_controllers_first_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    plain = run_spec(RunSpec(baseline="PD", cache_fraction=0.5, **TINY_RUN)).row  # type: ignore[arg-type]
    settled = run_spec(
        RunSpec(baseline="PD", cache_fraction=0.5, controller_warmup="first_round", **TINY_RUN)  # type: ignore[arg-type]
    ).row
    assert validate_row(settled) == []
    assert plain["controller_warmup"] == "off" and "controller" not in plain["warmup"]
    assert settled["controller_warmup"] == "first_round"
    warm = settled["warmup"]["controller"]
    assert warm["first_round_done"] is True and warm["bursts"] >= 1 and warm["steps"] > 0
    # the first round's outcome is the row's: every part it judged, where it left it
    assert set(warm["at_end"]) == set(settled["pd_parts"]["at_end"])
    assert warm["decisions"]
    assert {d["part"] for d in warm["decisions"]} <= set(warm["at_end"])
    # the controller's books start at the clock: none of the warm-up's decisions
    assert all(d["step"] <= settled["steps"] for d in settled["pd_parts"]["decisions"])
    assert settled["setup_s"]["controller_warmup"] > 0


def test_a_label_without_the_controller_runs_no_burst(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    row = run_spec(
        RunSpec(baseline="B1", cache_fraction=0.5, controller_warmup="first_round", **TINY_RUN)  # type: ignore[arg-type]
    ).row
    assert row["controller_warmup"] == "off"
    assert row["warmup"]["controller"] == {
        "bursts": 0,
        "steps": 0,
        "first_round_done": None,
        "why": "no PD controller",
        "at_end": None,
        "decisions": [],
        "gate_window": None,
    }


def test_the_controller_starts_over_after_the_settled_warm_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The workload warm-up runs with a settled cache (copies waited for on
    the host): PD's controller forgets what it decided there, once, after
    the warm-up's steps and outside the settled cache."""
    from contextlib import contextmanager

    from pdflash.cache.expert_cache import ExpertCache
    from pdflash.engine.pd_controller import PDController

    inside: list[bool] = [False]
    real_settled = ExpertCache.settled

    @contextmanager
    def settled(self: ExpertCache) -> Iterator[None]:
        inside[0] = True
        try:
            with real_settled(self):
                yield
        finally:
            inside[0] = False

    calls: list[tuple[int, bool]] = []
    real_restart = PDController.restart

    def restart(self: PDController) -> None:
        calls.append((self.summary()["steps"], inside[0]))
        real_restart(self)

    monkeypatch.setattr(ExpertCache, "settled", settled)
    monkeypatch.setattr(PDController, "restart", restart)
    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    run_spec(RunSpec(baseline="PD", cache_fraction=0.5, warmup="workload", **TINY_RUN))  # type: ignore[arg-type]
    ((steps_before, settled_then),) = calls
    assert steps_before > 0 and not settled_then
