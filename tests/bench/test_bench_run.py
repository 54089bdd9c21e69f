"""The bench contract: RunSpec -> RunResult with every §6 field (CPU, tiny)."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from bench_fixtures import TINY_RUN
from pdflash.bench.engine_run import RunSpec, run_spec

from pdflash.report.belady import belady
from pdflash.report.schema import IDENTITY_FIELDS, METRIC_FIELDS, validate_row

# The contract is the report's row schema: one list, shared with the validator.
CONTRACT_IDENTITY = list(IDENTITY_FIELDS)
CONTRACT_METRICS = list(METRIC_FIELDS)


@pytest.mark.parametrize("baseline", ["B0", "B1", "B3"])
def test_run_spec_row_has_every_contract_field(
    baseline: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    seen: list[tuple[int, int]] = []
    spec = RunSpec(
        arch="tiny",
        baseline=baseline,
        concurrency=2,
        block_size=6,
        max_new_tokens=10,
        prompt_len=6,
        slo_s=60.0,
    )
    result = run_spec(spec, progress=lambda done, total: seen.append((done, total)))
    row = result.row
    for key in CONTRACT_IDENTITY + CONTRACT_METRICS:
        assert key in row, key
    missing = row.get("not_measured", {})
    for key in CONTRACT_METRICS:
        if row[key] is None:
            assert missing.get(key), key  # null always carries a reason
        else:
            assert np.isfinite(row[key]) and row[key] >= 0, (key, row[key])
    assert validate_row(row) == []
    assert row["committed_tokens"] == 2 * 10
    assert row["weights_source"] == "synthetic"
    assert row["acceptance_source"] == ("model" if baseline == "B0" else "forced")
    if baseline == "B0":
        assert row["acceptance_length_mean"] == 1.0
    else:
        assert row["acceptance_params"]["distribution"] == "truncated_geometric"
    if baseline == "B3":
        assert row["expert_cache_hit_rate"] == 1.0 and row["h2d_bytes"] == 0
    else:
        assert row["h2d_bytes"] > 0
        assert row["exposed_fetch_s"] > 0 and row["link_busy_s"] > 0
        assert row["compute_busy_s"] > 0
    assert row["goodput_rps"] is not None
    assert seen and seen[-1][0] == seen[-1][1]
    assert result.cache_slots == row["cache_slots"] and result.expert_nbytes == row["expert_nbytes"]
    assert result.routing_trace and len(result.routing_trace) == len(result.trace_kinds)
    assert all(t.dtype == np.int64 for t in result.routing_trace)
    assert len(result.routing_trace) % row["layers"] == 0
    # the setup before the clock, by phase: each timed, and together no more
    # than the time to the clock's start (the rest is "other")
    setup = row["setup_s"]
    for phase in (
        "synthetic_checkpoint",
        "target_load",
        "drafter_load",
        "expert_cache",
        "link_probe",
        "engine_build",
        "warmup",
    ):
        assert setup[phase] >= 0, phase
    assert "host_service" not in setup  # no hybrid service: no phase
    top = sum(v for k, v in setup.items() if "." not in k and k not in ("before_clock", "other"))
    assert setup["other"] >= -1e-6
    assert setup["before_clock"] == pytest.approx(top + setup["other"])


def test_rows_split_hits_on_landed_copies_from_hits_on_copies_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B1's lookahead copies the next layer's experts; over a slow emulated
    link some are still in flight when the layer asks for them. They count as
    hits in ``expert_cache_hit_rate`` and not in the landed-only rate."""
    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    spec = RunSpec(baseline="B1", cache_fraction=0.5, emulated_link_gbps=0.01, **TINY_RUN)
    result = run_spec(spec)
    row = result.row
    assert validate_row(row) == []
    # every forward-layer's distinct routed experts, as the cache counted them
    requested = sum(np.unique(ids).size for ids in result.routing_trace)
    hit, landed = row["expert_cache_hit_rate"], row["expert_cache_landed_hit_rate"]
    inflight = row["expert_cache_inflight_hits"]
    assert inflight > 0 and 0 <= landed < hit
    assert (hit - landed) * requested == pytest.approx(inflight)
    # the exposed fetch split: waits on lookahead copies alone, waits with a miss
    miss, ahead = row["exposed_fetch_miss_s"], row["exposed_fetch_inflight_s"]
    assert miss > 0 and ahead > 0
    assert miss + ahead == pytest.approx(row["exposed_fetch_s"])
    # of the prefetch waits, the extra for those still queued when asked
    # (whether any was queued depends on the copy thread's pace here; the
    # split itself: tests/engine/test_stall_split.py)
    assert 0 <= row["exposed_fetch_queued_s"] <= ahead


def test_pd_host_rows_split_the_host_services_setup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    kw = dict(arch="tiny", concurrency=2, max_new_tokens=4, prompt_len=4, host_format="auto")
    first = run_spec(RunSpec(baseline="PD+host", **kw)).row  # type: ignore[arg-type]
    setup = first["setup_s"]
    parts = [setup["host_service.host_weights"], setup["host_service.calibrate"]]
    assert all(p > 0 for p in parts)
    assert sum(parts) <= setup["host_service"]
    weights = first["host_service"]["host_weights"]
    assert not weights["reused"]
    assert setup["host_service.host_weights.format_select"] == weights["format_select_s"]
    assert setup["host_service.host_weights.prepare"] == weights["prepare_s"]
    # the next run reuses the prepared weights: no preparation or selection spent
    again = run_spec(RunSpec(baseline="PD+host", repeat=1, **kw)).row  # type: ignore[arg-type]
    assert again["host_service"]["host_weights"]["reused"]
    assert "host_service.host_weights.prepare" not in again["setup_s"]
    assert "host_service.host_weights.format_select" not in again["setup_s"]


def test_pd_host_rows_record_the_host_queued_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RunSpec.host_queued reaches the host service; the row records it and
    its count, and keys the run apart from the default."""
    from pdflash.report.schema import RUN_SETTINGS, settings_label, spec_settings

    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    kw = dict(arch="tiny", concurrency=2, max_new_tokens=4, prompt_len=4, emulated_link_gbps=0.01)
    spec = RunSpec(baseline="PD+host", host_queued=True, **kw)  # type: ignore[arg-type]
    row = run_spec(spec).row
    assert validate_row(row) == []
    service = row["host_service"]
    assert service["host_queued"] is True and service["queued_hosted"] >= 0
    assert settings_label(row, ["host_queued"]) == "host_queued=True"
    at = [s.name for s in RUN_SETTINGS if s.in_spec].index("host_queued")
    assert spec_settings(vars(spec))[at] is True
    assert spec_settings(vars(RunSpec(baseline="PD+host", **kw)))[at] is False  # type: ignore[arg-type]


def test_pd_host_rows_record_the_job_term_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RunSpec.host_job_term reaches the calibration: off (the default) the
    row's calibration has no job point and a zero term, on it has a job
    point per token count; the row records the switch and keys the run
    apart; a row of a service older than the switch reads as off."""
    from pdflash.report.schema import RUN_SETTINGS, settings_label, spec_settings

    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    kw = dict(arch="tiny", concurrency=2, max_new_tokens=4, prompt_len=4, emulated_link_gbps=0.01)
    off = run_spec(RunSpec(baseline="PD+host", **kw)).row  # type: ignore[arg-type]
    on_spec = RunSpec(baseline="PD+host", host_job_term=True, repeat=1, **kw)  # type: ignore[arg-type]
    on = run_spec(on_spec).row
    for row in (on, off):
        assert validate_row(row) == []
    cal_on, cal_off = on["host_service"]["calibration"], off["host_service"]["calibration"]
    assert on["host_service"]["host_job_term"] is True
    assert [p[0] for p in cal_on["job_points"]] == [p[0] for p in cal_on["points"]]
    assert cal_on["job_s"] >= 0
    assert off["host_service"]["host_job_term"] is False
    assert cal_off["job_points"] == [] and "job_s" not in cal_off and cal_off["job_s_absent"]
    assert settings_label(on, ["host_job_term"]) == "host_job_term=True"
    at = [s.name for s in RUN_SETTINGS if s.in_spec].index("host_job_term")
    assert spec_settings(vars(on_spec))[at] is True
    assert spec_settings(vars(RunSpec(baseline="PD+host", **kw)))[at] is False  # type: ignore[arg-type]
    setting = next(s for s in RUN_SETTINGS if s.name == "host_job_term")
    older = {
        **on,
        "host_service": {k: v for k, v in on["host_service"].items() if k != "host_job_term"},
    }
    older.pop("spec", None)
    assert setting.of_row(older) is False


def test_run_spec_frees_its_engine_before_returning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run's engine sits in reference cycles; with the collector off,
    only run_spec's own collection frees it (not one that would fall in the
    next run's clock or graph captures)."""
    from pdflash.engine.engine import Engine

    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        run_spec(RunSpec(arch="tiny", baseline="PD", concurrency=2, max_new_tokens=4, prompt_len=4))
        alive = sum(isinstance(o, Engine) for o in gc.get_objects())
    finally:
        if was:
            gc.enable()
    assert alive == 0


def test_run_spec_rejects_bad_specs() -> None:
    with pytest.raises(ValueError, match="baseline"):
        run_spec(RunSpec(arch="tiny", baseline="B7"))
    with pytest.raises(ValueError, match="unknown arch"):
        run_spec(RunSpec(arch="nope", baseline="B1"))
    with pytest.raises(ValueError, match="dtype must be"):
        run_spec(RunSpec(arch="tiny", baseline="B1", dtype="int8"))
    with pytest.raises(ValueError, match="cache_fraction"):
        run_spec(RunSpec(arch="tiny", baseline="B1", cache_fraction=0.0))
    with pytest.raises(ValueError, match="warmup must be one of"):
        run_spec(RunSpec(arch="tiny", baseline="B1", warmup="long"))


def test_the_workload_warm_up_runs_the_runs_shape_outside_the_clock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    kw = {"arch": "tiny", "baseline": "PD", "concurrency": 3, "num_requests": 5}
    kw |= {"block_size": 6, "max_new_tokens": 7, "prompt_len": 5}
    short = run_spec(RunSpec(**kw)).row  # auto on CPU: the short warm-up
    assert short["warmup"] == {
        "mode": "short",
        "requested": "auto",
        "requests": 1,
        "new_tokens": 2,
        "prompts": "the run's first prompt",
    }
    row = run_spec(RunSpec(**kw, warmup="workload")).row
    # one request per running slot, each with the run's prompt and output
    # lengths (random ids: the run's prompts are random ids too)
    assert row["warmup"] == {
        "mode": "workload",
        "requested": "workload",
        "requests": 3,
        "new_tokens": 21,
        "prompts": "random token ids",
    }
    # nothing of the warm-up is measured: the run's own tokens and requests only
    assert row["committed_tokens"] == short["committed_tokens"] == 5 * 7
    assert row["num_requests"] == 5
    assert validate_row(row) == []


def test_rows_count_the_attention_shapes_first_met_inside_the_clock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``sdpa_shapes.new_in_run``: the SDPA call shapes a run met for the
    first time in the process inside its clock (each pays a per-shape setup
    where the backend has one); the same run again meets none."""
    from pdflash.engine.attention import sdpa_shapes_met

    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    # a shape no other test runs: block 5, prompts of 13 tokens
    kw = {"arch": "tiny", "baseline": "PD", "concurrency": 2, "num_requests": 3}
    kw |= {"block_size": 5, "max_new_tokens": 9, "prompt_len": 13}
    before = sdpa_shapes_met()
    first = run_spec(RunSpec(**kw)).row["sdpa_shapes"]
    again = run_spec(RunSpec(**kw)).row["sdpa_shapes"]
    assert first["new_in_run"] > 0 and again["new_in_run"] == 0
    assert before + first["new_in_run"] <= first["process_total"] == again["process_total"]


def test_matrix_keys_runs_by_their_warm_up() -> None:
    from pdflash.bench.suites.matrix import spec_key

    spec = {"arch": "tiny", "baseline": "PD", "block_size": 16, "concurrency": 4}
    spec |= {"cache_fraction": 0.2, "repeat": 0}
    assert spec_key(spec) == spec_key({**spec, "warmup": "auto"})
    assert spec_key(spec) != spec_key({**spec, "warmup": "workload"})


def test_bench_engine_suite_cli(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from pdflash.bench import cli

    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    rc = cli.main(
        [
            "engine",
            "--json",
            "--arch",
            "tiny",
            "--concurrency",
            "1,2",
            "--baselines",
            "B0,B1",
            "--max-new-tokens",
            "4",
            "--prompt-len",
            "4",
            "--out",
            str(tmp_path / "rows"),
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert [(r["baseline"], r["concurrency"]) for r in out["runs"]] == [
        ("B0", 1),
        ("B1", 1),
        ("B0", 2),
        ("B1", 2),
    ]
    for row in out["runs"]:
        # every engine row carries the trace figures a matrix row carries
        assert row["routed_expert_bytes"] > 0 and row["belady_initial_state"] == "engine"
        assert row["initial_resident_experts"] >= 1 and row["belady_bytes"] is not None
        assert row["slo_s"] is None and row["not_measured"]["slo_s"]
    # `pdflash-bench report` validates and evaluates the engine's rows file
    rc = cli.main(
        ["report", "--json", "--no-plots", str(tmp_path / "rows"), "--baselines", "B0,B1"]
    )
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["valid"] and report["problems"] == [], report["problems"]
    assert report["rows"] == 4


def test_report_flags_vacuous_engine_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from pdflash.bench import cli

    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    spec = RunSpec(arch="tiny", baseline="B1", concurrency=1, max_new_tokens=4, prompt_len=4)
    row = run_spec(spec).row
    assert validate_row(row) == []
    # a hit rate with no routed experts is vacuous; a row without the field
    # cannot be checked, so it is rejected as incomplete
    vacuous = dict(row, routed_expert_bytes=0.0)
    lacking = {k: v for k, v in row.items() if k != "routed_expert_bytes"}
    lacking["repeat"] = 1
    folder = tmp_path / "planted"
    folder.mkdir()
    (folder / "rows.jsonl").write_text(json.dumps(vacuous) + "\n" + json.dumps(lacking) + "\n")
    rc = cli.main(["report", "--json", "--no-plots", str(folder), "--baselines", "B1"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 1 and not report["valid"]
    assert any(
        "expert_cache_hit_rate reported with no routed experts" in p for p in report["problems"]
    )
    assert any("missing metric 'routed_expert_bytes'" in p for p in report["problems"])


@pytest.mark.parametrize("baseline", ["B1", "PD", "B3"])
def test_run_reports_its_starting_cache_for_the_belady_replay(
    baseline: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdflash.report.belady import belady

    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    spec = RunSpec(
        arch="tiny", baseline=baseline, concurrency=2, block_size=6, max_new_tokens=10, prompt_len=6
    )
    result = run_spec(spec)
    start = result.initial_resident
    assert start is not None and start.dtype == np.int64
    # the warm-up request left experts behind, within the cache's capacity
    assert 0 < start.size <= result.cache_slots
    assert np.array_equal(start, np.unique(start))
    assert start.min() >= 0 and start.max() < result.row["layers"] * result.row["num_experts"]
    warm = belady(result.routing_trace, result.cache_slots, result.expert_nbytes, initial=start)
    cold = belady(result.routing_trace, result.cache_slots, result.expert_nbytes)
    assert warm.bytes_moved <= cold.bytes_moved
    # the optimum from the same start and capacity never moves more than the run
    assert result.row["h2d_bytes"] >= warm.bytes_moved
    if baseline == "B3":
        # every expert resident after the warm-up: neither moves a byte
        assert start.size == result.cache_slots and warm.bytes_moved == 0
        assert result.row["h2d_bytes"] == 0


def test_mxfp4_experts_move_their_stored_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same MXFP4 checkpoint with experts kept MXFP4 vs dequantized at pack
    time: the same routing and copies, every byte count in stored bytes."""
    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    rows = {}
    results = {}
    for expert_dtype in (None, "dense"):
        spec = RunSpec(
            arch="tiny-gpt_oss",
            baseline="B1",
            concurrency=2,
            block_size=4,
            max_new_tokens=6,
            prompt_len=6,
            synthetic_format="mxfp4",
            expert_dtype=expert_dtype,
        )
        results[expert_dtype] = run_spec(spec)
        rows[expert_dtype] = results[expert_dtype].row
    mx, dense = rows[None], rows["dense"]
    assert (mx["expert_format"], dense["expert_format"]) == ("mxfp4", "dense")
    assert (mx["mxfp4_dequantizer"], dense["mxfp4_dequantizer"]) == ("torch", None)  # CPU
    assert (mx["compressed_gemm"], dense["compressed_gemm"]) == ("dequant", None)
    assert mx["expert_nbytes"] < dense["expert_nbytes"]
    for row in (mx, dense):
        assert row["h2d_bytes"] > 0 and row["h2d_bytes"] % row["expert_nbytes"] == 0
    # identical greedy outputs and routing: the copies are the same experts
    assert mx["h2d_bytes"] // mx["expert_nbytes"] == dense["h2d_bytes"] // dense["expert_nbytes"]
    # Belady counts stored bytes. The rows' replays start from each run's
    # cache contents when its clock started, which depend on when copies of
    # different sizes landed during the warm-up; from one common (empty)
    # start the same routing must cost exactly the size ratio more.
    for row in (mx, dense):
        assert row["belady_bytes"] % row["expert_nbytes"] == 0
    r_mx, r_dense = results[None], results["dense"]
    assert [t.tolist() for t in r_mx.routing_trace] == [t.tolist() for t in r_dense.routing_trace]
    cold_mx = belady(r_mx.routing_trace, r_mx.cache_slots, r_mx.expert_nbytes).bytes_moved
    cold_dense = belady(r_dense.routing_trace, r_dense.cache_slots, r_dense.expert_nbytes)
    ratio = dense["expert_nbytes"] / mx["expert_nbytes"]
    assert cold_mx > 0 and cold_mx * ratio == pytest.approx(cold_dense.bytes_moved)
    with pytest.raises(ValueError, match="synthetic_format mxfp4 is for gpt-oss"):
        run_spec(RunSpec(arch="tiny", baseline="B1", synthetic_format="mxfp4"))


def test_verify_breakdown_adds_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    base = {"arch": "tiny", "baseline": "B3", "concurrency": 2, "block_size": 4}
    base.update(max_new_tokens=6, prompt_len=6)
    row = run_spec(RunSpec(**base, breakdown=True)).row  # type: ignore[arg-type]
    parts = row["verify_breakdown_ms"]
    assert row["verify_steps"] > 0 and parts["timing_method"] == "host_perf_counter"
    named = parts["attention_ms"] + parts["router_ms"] + parts["experts_ms"]
    assert all(parts[k] > 0 for k in ("attention_ms", "router_ms", "experts_ms"))
    assert named + parts["other_and_host_gaps_ms"] == pytest.approx(parts["verify_ms"])
    assert parts["other_and_host_gaps_ms"] >= 0 and parts["draft_ms_per_verify"] > 0
    off = run_spec(RunSpec(**base)).row  # type: ignore[arg-type]
    assert off["verify_breakdown_ms"] is None and "verify_breakdown_ms" in off["not_measured"]


def test_verify_roofline_bytes_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The verify roofline's bytes come on every device; on the CPU its times
    are null with the reason (never 0), and its expert bytes are the
    run's verify routing (distinct experts per layer) x stored bytes."""
    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    spec = RunSpec(
        arch="tiny-gpt_oss", baseline="B3", concurrency=2, block_size=4,
        max_new_tokens=6, prompt_len=6, synthetic_format="mxfp4",
    )  # fmt: skip
    result = run_spec(spec)
    row = result.row
    roof = row["verify_roofline"]
    assert roof["forwards"] == row["verify_forwards"] > 0
    kinds = result.trace_kinds
    verify = [t for t, k in zip(result.routing_trace, kinds, strict=True) if k == "verify"]
    distinct = sum(len(t) for t in verify)
    parts = roof["bytes_per_forward"]
    assert parts["experts"] == pytest.approx(distinct * row["expert_nbytes"] / roof["forwards"])
    assert parts["kv_cache"] > 0 and parts["embedding_rows"] > 0
    assert parts["non_expert_params"] > 0
    assert roof["total_bytes_per_forward"] == pytest.approx(sum(parts.values()))
    for name in ("hbm_gbps", "hbm_roofline_ms", "verify_over_roofline"):
        assert row[name] is None and name not in roof
        assert "no CUDA device" in row["not_measured"][name]
    assert validate_row(row) == []


def test_matrix_takes_cuda_graphs_into_specs_keys_and_command(tmp_path: Path) -> None:
    import argparse

    from pdflash.bench.suites import matrix

    parser = argparse.ArgumentParser()
    matrix.add_arguments(parser)
    base = "--arch tiny --baselines B3,PD --concurrency 4 --cache-fraction 0.5 --repeats 1"
    off = matrix.plan(parser.parse_args(base.split()))
    on_args = parser.parse_args([*base.split(), "--cuda-graphs", "auto"])
    on = matrix.plan(on_args)
    # off stays out of the specs (so earlier rows' keys are unchanged)
    assert all("cuda_graphs" not in s for s in off)
    assert [s["cuda_graphs"] for s in on] == ["auto"] * len(on)
    assert {matrix.spec_key(s) for s in off}.isdisjoint({matrix.spec_key(s) for s in on})
    assert "--cuda-graphs auto" in matrix.matrix_command(on_args, tmp_path)
    with pytest.raises(SystemExit):
        parser.parse_args([*base.split(), "--cuda-graphs", "always"])


def test_matrix_takes_verify_width_into_specs_keys_and_command(tmp_path: Path) -> None:
    import argparse

    from pdflash.bench.suites import matrix

    parser = argparse.ArgumentParser()
    matrix.add_arguments(parser)
    base = "--arch tiny --baselines B1,B2,PD --concurrency 4 --cache-fraction 0.5 --repeats 1"
    auto = matrix.plan(parser.parse_args(base.split()))
    # auto: every spec names the width its label runs at (PD's preset is
    # adaptive); a full-width label's key is the key of its spec without a
    # width (recorded before widths existed)
    assert {s["baseline"]: s.get("verify_width") for s in auto} == {
        "B1": "full",
        "B2": "full",
        "PD": "adaptive",
    }
    b1 = next(s for s in auto if s["baseline"] == "B1")
    assert matrix.spec_key(b1) == matrix.spec_key(
        {k: v for k, v in b1.items() if k != "verify_width"}
    )
    fixed_args = parser.parse_args([*base.split(), "--verify-width", "fixed:3"])
    fixed = matrix.plan(fixed_args)
    assert [s["verify_width"] for s in fixed] == ["fixed:3"] * 3
    full = matrix.plan(parser.parse_args([*base.split(), "--verify-width", "full"]))
    keys = {s["baseline"]: matrix.spec_key(s) for s in auto}
    full_keys = {s["baseline"]: matrix.spec_key(s) for s in full}
    assert keys["B1"] == full_keys["B1"] and keys["PD"] != full_keys["PD"]
    assert {matrix.spec_key(s) for s in fixed}.isdisjoint(keys.values())
    assert "--verify-width fixed:3" in matrix.matrix_command(fixed_args, tmp_path)
    assert "--verify-width" not in matrix.matrix_command(parser.parse_args(base.split()), tmp_path)
    for bad in ("wide", "fixed:x", "fixed:-2", "full,wide"):
        with pytest.raises(SystemExit):
            parser.parse_args([*base.split(), "--verify-width", bad])


def test_matrix_breakdown_is_in_specs_keys_and_command_only_when_asked(tmp_path: Path) -> None:
    import argparse

    from pdflash.bench.suites import matrix

    parser = argparse.ArgumentParser()
    matrix.add_arguments(parser)
    base = "--arch tiny --baselines B1,PD --concurrency 1 --cache-fraction 0.2 --repeats 1"
    plain_args = parser.parse_args(base.split())
    timed_args = parser.parse_args([*base.split(), "--breakdown"])
    plain, timed = matrix.plan(plain_args), matrix.plan(timed_args)
    assert all("breakdown" not in s for s in plain)
    assert [s["breakdown"] for s in timed] == [True, True]
    assert {matrix.spec_key(s) for s in timed}.isdisjoint(matrix.spec_key(s) for s in plain)
    assert "--breakdown" in matrix.matrix_command(timed_args, tmp_path)
    assert "--breakdown" not in matrix.matrix_command(plain_args, tmp_path)


def test_matrix_command_spells_a_host_setting_only_off_its_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each of HOST_DEFAULTS' settings is spelled where it differs from the
    owner's default and left out at it (so plain commands stay as before)."""
    import argparse

    from pdflash.bench.suites import matrix

    parser = argparse.ArgumentParser()
    matrix.add_arguments(parser)
    off_default = {
        "host_experts": "--host-experts auto",
        "host_format": "--host-format packed",
        "host_workers": "--host-workers 2",
        "host_threads": "--host-threads 3",
        "host_max_ratio": "--host-max-ratio 2.0",
        "host_max_tokens": "--host-max-tokens 0",
        "host_critical_path": "--host-critical-path",
        "host_queued": "--host-queued",
        "host_job_term": "--host-job-term",
        "host_handoff": "--host-handoff stream",
        "host_affinity": "--host-affinity off",
        "host_ahead": "--host-ahead weighted",
        "host_ahead_from": "--host-ahead-from stream",
        "host_ahead_min_exposed": "--host-ahead-min-exposed 0.5",
        "host_control": "--host-control always",
    }
    # a new host setting needs its case here
    assert set(off_default) == set(matrix.HOST_DEFAULTS)
    plain = matrix.matrix_command(parser.parse_args([]), tmp_path)
    for name, spelled in off_default.items():
        args = parser.parse_args(spelled.split())
        assert getattr(args, name) != matrix.HOST_DEFAULTS[name], name
        assert spelled.split()[0] not in plain, name
        assert f" {spelled} " in matrix.matrix_command(args, tmp_path), name
        # and the plan hands it to every run (host_format was parsed, then dropped)
        for spec in matrix.plan(parser.parse_args(["--arch", "tiny", *spelled.split()])):
            assert spec[name] == getattr(args, name), name
    # the default given explicitly is not spelled either
    at_default = parser.parse_args(
        ["--host-max-ratio", str(matrix.HOST_DEFAULTS["host_max_ratio"])]
    )
    assert "--host-max-ratio" not in matrix.matrix_command(at_default, tmp_path)
    # the owner decides: with stream as the default handoff, stream is not spelled
    stream = parser.parse_args(["--host-handoff", "stream"])
    monkeypatch.setitem(matrix.HOST_DEFAULTS, "host_handoff", "stream")
    assert "--host-handoff" not in matrix.matrix_command(stream, tmp_path)


def test_matrix_runs_every_label_at_each_listed_width_interleaved(tmp_path: Path) -> None:
    """A width list: each label at each width (a width that resolves to one
    already planned is dropped), the (label, width) runs rotated per repeat
    like the labels, each keyed apart, and the command keeps the list."""
    import argparse

    from pdflash.bench.suites import matrix

    parser = argparse.ArgumentParser()
    matrix.add_arguments(parser)
    base = "--arch tiny --baselines B2,PD --concurrency 4 --cache-fraction 0.5 --repeats 2"
    args = parser.parse_args([*base.split(), "--verify-width", "auto,fixed:1,full"])
    specs = matrix.plan(args)
    runs = [(s["baseline"], s.get("verify_width", "full"), s["repeat"]) for s in specs]
    # B2: auto is full (listed once); PD: adaptive, fixed:1 and full
    assert runs[:5] == [
        ("B2", "full", 0),
        ("B2", "fixed:1", 0),
        ("PD", "adaptive", 0),
        ("PD", "fixed:1", 0),
        ("PD", "full", 0),
    ]
    # the next repeat starts one run later (round-robin over label x width)
    assert runs[5:] == [
        ("B2", "fixed:1", 1),
        ("PD", "adaptive", 1),
        ("PD", "fixed:1", 1),
        ("PD", "full", 1),
        ("B2", "full", 1),
    ]
    assert len({matrix.spec_key(s) for s in specs}) == len(specs) == 10
    assert "--verify-width auto,fixed:1,full" in matrix.matrix_command(args, tmp_path)


def test_resolved_width_mirrors_the_presets() -> None:
    from pdflash.bench.suites import _common as common

    from pdflash.engine.config import BASELINES, EngineConfig

    for label in BASELINES:
        assert common.resolved_width("auto", label) == EngineConfig.preset(label).verify_width
        assert common.resolved_width("fixed:2", label) == ("full" if label == "B0" else "fixed:2")


def test_run_spec_records_the_width_and_what_it_decided(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdflash.bench.engine_run import RunSpec, run_spec

    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    base = dict(
        arch="tiny",
        concurrency=2,
        block_size=6,
        max_new_tokens=10,
        prompt_len=6,
        device="cpu",
        emulated_link_gbps=0.5,
        acceptance="forced",
        mean_tau=3.0,
    )
    row = run_spec(RunSpec(baseline="B2", verify_width="fixed:2", **base)).row  # type: ignore[arg-type]
    vw = row["verify_width"]
    assert vw["setting"] == "fixed:2" and vw["policy"] == "fixed:2"
    assert vw["mean_verified_drafts"] <= 2 and vw["rounds"] > 0
    assert row["acceptance_length_mean"] <= 3  # 2 drafts + the bonus at most
    pd = run_spec(RunSpec(baseline="PD", **base)).row  # type: ignore[arg-type]
    assert pd["verify_width"]["setting"] == "adaptive" and pd["verify_width"]["decisions"] > 0
    assert pd["verify_width"]["ran"] == "adaptive"
    assert pd["verify_width"]["estimates"]["link_bytes_per_s"] is not None
    b1 = run_spec(RunSpec(baseline="B1", **base)).row  # type: ignore[arg-type]
    assert b1["verify_width"] == {
        "setting": "full",
        "requested": "auto",
        "ran": "full",
        "policy": None,
        "why_no_policy": "full width: every draft verified, no policy consulted",
    }
    with pytest.raises(ValueError, match="exceeds the 5 drafts"):
        RunSpec(baseline="B2", verify_width="fixed:9", **base).validate()  # type: ignore[arg-type]


def test_engine_suite_takes_a_list_of_widths() -> None:
    import argparse

    from pdflash.bench.suites import engine

    parser = argparse.ArgumentParser()
    engine.add_arguments(parser)
    args = parser.parse_args(["--verify-width", "full, fixed:02,adaptive"])
    assert args.verify_width == ["full", "fixed:2", "adaptive"]
    assert parser.parse_args([]).verify_width == ["auto"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--verify-width", "full,sometimes"])


@pytest.mark.parametrize(
    ("field", "bad", "message"),
    [
        ("baseline", "B7", "baseline must be one of {choices}, got 'B7'"),
        ("host_handoff", "bogus", "host_handoff must be one of {choices}, got 'bogus'"),
        ("full_cache", "on", "full_cache must be one of {choices}, got 'on'"),
        ("num_requests", 0, "num_requests must be >= 1, got 0"),
        ("token_budget", 0, "token_budget must be >= 1, got 0"),
        ("host_threads", -1, "host_threads must be >= 1, got -1"),
    ],
)
def test_run_spec_checks_name_the_field_its_choices_and_the_value(
    field: str, bad: Any, message: str
) -> None:
    """RunSpec's choice and >= 1 checks share one message shape: the field,
    the choices where it has some, the value given."""
    from pdflash.engine.config import BASELINES, FULL_CACHE
    from pdflash.hybrid import HANDOFF_CHOICES

    choices = {"baseline": BASELINES, "host_handoff": HANDOFF_CHOICES, "full_cache": FULL_CACHE}
    spec = RunSpec(arch="tiny", baseline="B1")
    setattr(spec, field, bad)
    with pytest.raises(ValueError) as err:
        spec.validate()
    assert str(err.value) == message.format(choices=choices.get(field))
    # the unset optional counts are valid
    RunSpec(arch="tiny", baseline="B1").validate()
