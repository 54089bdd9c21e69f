"""Rows at a cache with a slot for every expert (RunSpec.full_cache): the
offloaded labels start the clock with every expert resident, as B3, copy
nothing, run no predictor, and say what was switched off and why."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_fixtures import TINY_RUN
from pdflash.bench.engine_run import RunSpec, run_spec

from pdflash.engine.config import NOTHING_TO_MISS
from pdflash.report.schema import row_settings, validate_row


@pytest.mark.parametrize("baseline", ["PD", "B1"])
def test_full_cache_rows_start_filled_and_copy_nothing(
    baseline: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    row = run_spec(RunSpec(baseline=baseline, cache_fraction=1.0, **TINY_RUN)).row  # type: ignore[arg-type]
    assert validate_row(row) == []
    every = row["layers"] * row["num_experts"]
    assert row["cache_slots"] == every
    assert row["initial_resident_experts"] == every
    assert row["h2d_bytes"] == 0 and row["expert_cache_hit_rate"] == 1.0
    full = row["full_cache"]
    assert full["setting"] == "auto" and full["state"] == "filled"
    assert set(full["switched_off"]) == (
        set(NOTHING_TO_MISS) - {"host_experts"} if baseline == "PD" else {"lookahead"}
    )
    # PD's batch is chosen as B3's: FCFS, no 2-D scheduler
    assert row["batching"] == "fcfs" and row["byte_budget"] is None
    assert row["predict_s"] == 0 and row["router_pass_s"] == 0
    assert row["route_ahead"] is False and row["streaming_prefetch"] is False
    assert row["parts_controller"] is False and row["pd_parts"] is None
    assert row["route_ahead_bytes_submitted"] == 0 and row["background_bytes_submitted"] == 0
    vw = row["verify_width"]
    if baseline == "PD":
        # PD's adaptive width, switched off: every draft verified, as B3
        assert vw["setting"] == "adaptive" and vw["ran"] == "full" and vw["policy"] is None
        assert full["switched_off"]["verify_width"] in vw["why_no_policy"]
    else:
        assert vw["setting"] == vw["ran"] == "full" and vw["policy"] is None
    if baseline == "PD":  # no shadow token-only scheduler where nothing can miss
        assert "every expert resident" in row["not_measured"]["routeahead_coverage"]
        why = row["not_measured"]["token_only_differing_step_fraction"]
        assert "every expert resident" in why


def test_full_cache_off_and_half_cache_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    off = run_spec(RunSpec(baseline="PD", cache_fraction=1.0, full_cache="off", **TINY_RUN)).row  # type: ignore[arg-type]
    assert off["full_cache"]["state"] == "off" and off["full_cache"]["setting"] == "off"
    assert off["initial_resident_experts"] < off["layers"] * off["num_experts"]
    assert off["route_ahead"] is True and off["h2d_bytes"] > 0
    half = run_spec(RunSpec(baseline="PD", cache_fraction=0.5, **TINY_RUN)).row  # type: ignore[arg-type]
    assert half["full_cache"]["state"] == "off"
    # the adaptive width runs where a copy can be saved, or where asked to
    for row in (off, half):
        assert row["verify_width"]["setting"] == row["verify_width"]["ran"] == "adaptive"
        assert row["verify_width"]["policy"] == "adaptive"
    assert "slots for" in half["full_cache"]["why_off"]
    assert half["route_ahead"] is True and half["streaming_prefetch"] is True
    # the two settings of one label are two runs in the reports' keys
    auto = dict(off, full_cache={**off["full_cache"], "setting": "auto"})
    assert row_settings(off) != row_settings(auto)
    # a row from before the setting: at cache 1.0 it filled on demand
    old = {k: v for k, v in off.items() if k != "full_cache"}
    assert row_settings(old) == row_settings(off)


def test_pd_host_row_at_full_cache_builds_no_host_service(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    row = run_spec(RunSpec(baseline="PD+host", cache_fraction=1.0, **TINY_RUN)).row  # type: ignore[arg-type]
    assert validate_row(row) == []
    assert set(row["full_cache"]["switched_off"]) == set(NOTHING_TO_MISS)
    # the row keeps the run's setting; the service was neither built nor run
    assert row["host_experts"] == "auto" and row["host_service"] is None
    assert row["host_served_experts"] is None
    assert "no miss for the host" in row["not_measured"]["host_served_experts"]
    assert row["batching"] == "fcfs" and row["h2d_bytes"] == 0


def test_a_fixed_width_row_at_full_cache_keeps_its_width(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    spec = RunSpec(baseline="PD", cache_fraction=1.0, verify_width="fixed:2", **TINY_RUN)  # type: ignore[arg-type]
    row = run_spec(spec).row
    assert validate_row(row) == []
    assert row["full_cache"]["state"] == "filled"
    assert "verify_width" not in row["full_cache"]["switched_off"]
    vw = row["verify_width"]
    assert vw["setting"] == vw["ran"] == vw["policy"] == "fixed:2"
    assert vw["mean_verified_drafts"] <= 2
