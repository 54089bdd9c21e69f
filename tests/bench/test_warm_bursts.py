"""Extra warm-up bursts (``warm_bursts``) as a run setting: workload bursts
after the warm-up, outside the clock, for any label, so an arm without the
PD controller can be given the warm-up a settled controller arm ran
(``controller_warmup=first_round``) and an A/B of the two is fair. Checked,
keyed, recorded in rows, settable on an issue-16 arm."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from bench_fixtures import TINY_RUN, check_an_issue16_arm_sets
from pdflash.bench.engine_run import RunSpec, run_spec

from pdflash.report.schema import (
    MAX_WARM_BURSTS,
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

(SETTING,) = [s for s in RUN_SETTINGS if s.name == "warm_bursts"]


def test_the_default_is_zero_and_bad_values_are_refused() -> None:
    assert SETTING.default == RunSpec(arch="tiny", baseline="PD").warm_bursts == 0
    for bad in (-1, MAX_WARM_BURSTS + 1, True, 1.5, "2"):
        with pytest.raises(ValueError, match="warm_bursts"):
            RunSpec(arch="tiny", baseline="B1", warm_bursts=bad).validate()  # type: ignore[arg-type]


def test_it_is_keyed_for_every_label() -> None:
    spec = {"arch": "tiny", "baseline": "PD-all-on", "concurrency": 1, "cache_fraction": 0.2}
    assert SETTING.of_spec(spec) == 0 and SETTING.of_spec({**spec, "warm_bursts": 3}) == 3
    assert spec_settings(spec) == spec_settings({**spec, "warm_bursts": 0})
    assert spec_settings(spec) != spec_settings({**spec, "warm_bursts": 3})
    # a row older than the setting ran none
    assert SETTING.of_row({}) == 0 and SETTING.of_row({"warm_bursts": 2}) == 2


def test_the_suites_pass_it_to_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    assert engine_parser().parse_args([]).warm_bursts == 0
    argv = ["--baselines", "PD-all-on", "--warm-bursts", "3"]
    assert spec_the_engine_suite_runs(monkeypatch, argv).warm_bursts == 3
    for bad in ("-1", str(MAX_WARM_BURSTS + 1), "two"):
        with pytest.raises(SystemExit):
            engine_parser().parse_args(["--warm-bursts", bad])
    check_the_matrix_plans_spells_and_keys(
        "warm_bursts", ["--warm-bursts", "3"], 3, "--warm-bursts 3"
    )


def test_an_issue16_arm_sets_it() -> None:
    check_an_issue16_arm_sets("warm_bursts", "3", 3)


def test_a_run_without_the_controller_runs_its_bursts_outside_the_clock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    plain = run_spec(RunSpec(baseline="PD-all-on", cache_fraction=0.5, **TINY_RUN)).row  # type: ignore[arg-type]
    burst = run_spec(
        RunSpec(baseline="PD-all-on", cache_fraction=0.5, warm_bursts=2, **TINY_RUN)  # type: ignore[arg-type]
    ).row
    assert validate_row(burst) == []
    assert plain["warm_bursts"] == 0 and "bursts" not in plain["warmup"]
    assert burst["warm_bursts"] == 2
    assert burst["warmup"]["bursts"]["bursts"] == 2 and burst["warmup"]["bursts"]["steps"] > 0
    assert burst["setup_s"]["warm_bursts"] > 0
    # the clock's steps are the run's alone: the same workload, the same count
    assert burst["committed_tokens"] == plain["committed_tokens"]
    assert row_key(burst) != row_key(plain)
    # the books' per-step sums cover the clock's steps: on the CPU (no
    # device events, nothing read late) exactly the row's exposed fetch
    sums = burst["pd_parts"]["step_sums"]
    assert sums["exposed_fetch_s"] == pytest.approx(burst["exposed_fetch_s"], rel=1e-9, abs=1e-12)
    assert 0 < sums["wall_s"] <= burst["wall_s"]


def test_the_forced_draws_follow_the_workload_not_the_warm_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B1 verifies every draft: with the measured requests' forced streams
    keyed by their place in the workload and the repeat, bursts before them
    (which take request ids) change none of its draws; another repeat draws
    anew."""
    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    kw = {**TINY_RUN, "max_new_tokens": 24}
    rows = [
        run_spec(
            RunSpec(baseline="B1", cache_fraction=0.5, warm_bursts=b, repeat=r, **kw)  # type: ignore[arg-type]
        ).row
        for b, r in ((0, 0), (3, 0), (0, 1))
    ]
    plain, burst, other = rows
    assert plain["acceptance_source"] == "forced"
    assert burst["steps"] == plain["steps"]
    assert burst["acceptance_length_mean"] == plain["acceptance_length_mean"]
    assert other["acceptance_length_mean"] != plain["acceptance_length_mean"]


def test_the_bursts_run_unsettled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The workload warm-up runs with a settled cache (copies waited for on
    the host, so its resident set does not depend on the copy thread); the
    bursts after it run as the measured run does, or the controller's first
    round would judge the stream where it cannot run ahead."""
    import pdflash.bench.engine_run as engine_run

    settled: list[bool] = []
    real = engine_run._Bursts.run

    def spy(self: Any, *args: Any) -> int:
        settled.append(bool(self.engine.expert_cache.settle_copies))
        return real(self, *args)

    monkeypatch.setattr(engine_run._Bursts, "run", spy)
    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    spec = RunSpec(
        baseline="PD",
        cache_fraction=0.5,
        warm_bursts=1,
        controller_warmup="first_round",
        **TINY_RUN,
    )  # type: ignore[arg-type]
    run_spec(spec)
    assert settled == [False, False]
