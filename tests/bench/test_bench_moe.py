"""``pdflash-bench moe`` on the CPU (tiny synthetic model, host issuer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pdflash.bench.cli import main


def test_bench_moe_cpu_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "moe",
            "--json",
            "--arch",
            "gpt_oss",
            "--device",
            "cpu",
            "--cache-fraction",
            "0.5,1.0",
            "--tokens",
            "3",
            "--repeats",
            "2",
            "--all-hit-tokens",
            "4",
            "--all-hit-iters",
            "2",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    small, full = out["runs"]
    for row in (small, full):
        assert (
            row["weights"] == "synthetic" and row["preset"] == "tiny" and row["arch"] == "gpt_oss"
        )
        assert row["issuer_backend"] == "host" and row["device"] == "cpu"
        assert len(row["per_layer"]) == row["layers"] == 2
        assert all(p["resident_ms"] > 0 and p["offloaded_ms"] > 0 for p in row["per_layer"])
        assert row["max_abs_err"] <= 1e-4 * max(1.0, row["max_abs_logit_resident"])
        assert row["link_gbps"] is None and "link_gbps" in row["not_measured"]
        assert row["bytes_moved"] == row["copies"] * row["expert_nbytes"]
        assert row["expert_format"] == "dense" and row["moe_path"] == "grouped"
        assert [(r["layer"], r["tokens"]) for r in row["all_hit"]] == [(0, 4), (1, 4)]
        assert row["all_hit_timing"]["rounds"] == 3 and row["all_hit_timing"]["iters"] == 2
        for r in row["all_hit"]:
            assert r["offloaded_all_hit_us"] > 0 and r["grouped_mm_active_us"] > 0
            # both sides timed alike: rounds interleaved, the host's issue time beside
            for side in ("offloaded_all_hit", "grouped_mm_active"):
                assert len(r[f"{side}_rounds_us"]) == 3 and r[f"{side}_host_us"] > 0
                assert r[f"{side}_device_us"] is None
                assert "CPU" in r["not_measured"][f"{side}_device_us"]
            assert (
                r["offloaded_host_bound"] is None and r["offloaded_over_grouped_mm_device"] is None
            )
            # torch dispatches per call: the block's sort, gathers and sum on top of the MLP's
            ops, plain_ops = r["offloaded_all_hit_dispatches"], r["grouped_mm_active_dispatches"]
            assert ops["by_op"]["_grouped_mm"] == plain_ops["by_op"]["_grouped_mm"] == 2
            assert ops["all"] > plain_ops["all"] and ops["kernel_ops"] > plain_ops["kernel_ops"]
            assert ops["all"] == sum(ops["by_op"].values())
            assert r["offloaded_all_hit_syncs"] is None
            assert "CPU" in r["not_measured"]["offloaded_all_hit_syncs"]
            assert r["max_abs_err_vs_grouped_mm"] <= 1e-5
            assert r["weight_bytes_touched"] == r["active_experts"] * row["expert_nbytes"]
            assert r["hbm_roofline_us"] is None and "hbm_roofline_us" in r["not_measured"]
        assert row["all_hit_targets"]["rows"] == 2
    # 8 slots hold all 8 experts of one layer: the no-sync path was measured
    assert all(r["resident_path"] == "layer_resident" for r in full["all_hit"] + small["all_hit"])
    assert small["cache_slots"] == 8 and full["cache_slots"] == 16
    assert small["misses"] > 0 and small["evictions"] > 0
    # everything fits at fraction 1.0 and the warm-up forward is not counted, so
    # only experts never routed before the measured repeats are copied
    assert full["evictions"] == 0 and full["hit_rate"] > small["hit_rate"]


def test_bench_moe_mxfp4_moves_the_stored_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    rows = {}
    for extra in ([], ["--expert-dtype", "dense"]):
        argv = ["moe", "--json", "--arch", "gpt_oss", "--device", "cpu", "--tokens", "3"]
        argv += ["--repeats", "1", "--all-hit-tokens", "", "--synthetic-format", "mxfp4"]
        assert main(argv + extra) == 0
        row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        rows[row["expert_format"]] = row
    mx, dense = rows["mxfp4"], rows["dense"]
    assert mx["expert_nbytes"] < dense["expert_nbytes"]
    for row in (mx, dense):
        assert row["bytes_moved"] == row["copies"] * row["expert_nbytes"] > 0
        assert row["moe_max_abs_err"] <= 1e-5 and row["all_hit"] == []
    # which dequantizer ran is recorded: on the CPU always the torch path
    assert dense["mxfp4_dequantizer"] is None
    assert (mx["compressed_gemm"], dense["compressed_gemm"]) == ("dequant", None)
    assert mx["mxfp4_dequantizer"] == "torch" and "CUDA" in mx["mxfp4_triton_unavailable"]
    assert mx["mxfp4_dequant_calls"]["torch"] > 0 and mx["mxfp4_dequant_calls"]["triton"] == 0
    speed = mx["mxfp4_dequant_speed"]
    assert speed["torch_us"] > 0 and speed["torch_gbps"] > 0
    assert speed["bytes_moved_per_call"] > speed["output_bytes"] > 0
    assert speed["triton_us"] is None and "CUDA" in speed["not_measured"]["triton_us"]
    assert speed["torch_over_hbm"] is None and "torch_over_hbm" in speed["not_measured"]


def test_bench_moe_fp8_reports_its_error(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["moe", "--json", "--arch", "qwen3_moe", "--device", "cpu", "--tokens", "3"]
    argv += ["--repeats", "1", "--all-hit-tokens", "", "--expert-dtype", "fp8"]
    assert main(argv) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    err = row["fp8_error"]
    assert row["expert_format"] == "fp8" and err["tokens"] == 256
    assert err["fp8_expert_nbytes"] == row["expert_nbytes"] < err["reference_expert_nbytes"]
    assert err["logit_max_abs_err"] > 0 and 0 < err["logit_rel_err"] < 1
    assert 0 < err["greedy_agreement_teacher_forced"] <= 1
    assert row["moe_max_abs_err"] <= 1e-5  # offloaded fp8 block vs HF block on the same weights


def test_bench_moe_compressed_gemm_both_on_cpu_says_why_fused_is_absent(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    argv = ["moe", "--json", "--arch", "gpt_oss", "--device", "cpu", "--tokens", "3"]
    argv += ["--repeats", "1", "--all-hit-tokens", "4", "--all-hit-iters", "1"]
    argv += ["--synthetic-format", "mxfp4", "--cache-fraction", "1.0"]
    try:
        assert main([*argv, "--compressed-gemm", "both"]) == 0
        row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert row["compressed_gemm"] == "dequant"
        for r in row["all_hit"]:
            assert r["compressed_gemm"] == "dequant" and r["by_compressed_gemm"] is None
            # the plain baseline's experts are dequantized from the stored MXFP4 bytes
            assert r["max_abs_err_vs_grouped_mm"] <= 1e-5
            assert "CUDA devices, not cpu" in r["by_compressed_gemm_not_measured"]["fused"]
        with pytest.raises(SystemExit, match=r"--compressed-gemm fused: .*CUDA"):
            main([*argv, "--compressed-gemm", "fused"])
    finally:
        from pdflash.models.compressed_gemm import set_compressed_gemm

        set_compressed_gemm(None)


@pytest.mark.parametrize("setting", ["both", "all"])
def test_bench_moe_row_sort_both_times_the_counting_sort_beside_the_plan(
    setting: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from pdflash.models.offload import row_sort_mode, set_row_sort

    set_row_sort("sort")  # a setting from before the run, restored after it
    argv = ["moe", "--json", "--arch", "qwen3_moe", "--device", "cpu", "--tokens", "3"]
    argv += ["--repeats", "1", "--all-hit-tokens", "5", "--all-hit-iters", "2"]
    argv += ["--all-hit-rounds", "2", "--cache-fraction", "1.0", "--row-sort", setting]
    try:
        assert main(argv) == 0
        # the run's setting ended with it (back to the default)
        assert row_sort_mode() == "plan_atomic"
    finally:
        set_row_sort(None)
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for r in row["all_hit"]:
        assert r["row_sort"] == "plan_atomic"
        # all: the stable plan too (here, too, the counting sort's calls)
        want = ["counting", "plan"] if setting == "all" else ["counting"]
        assert sorted(r["by_row_sort"]) == want
        stable = r["by_row_sort"].get("plan")
        if stable is not None:
            assert stable["bit_equal_vs_main"] and len(stable["offloaded_all_hit_rounds_us"]) == 2
        other = r["by_row_sort"]["counting"]
        assert other["max_abs_diff_vs_main"] == 0.0  # the same bits
        assert len(other["offloaded_all_hit_rounds_us"]) == 2
        assert other["offloaded_all_hit_us"] > 0 and other["offloaded_all_hit_host_us"] > 0
        # no fused MLP here (bf16 experts on the CPU): the plan is the counting sort's calls
        ops, main_ops = other["offloaded_all_hit_dispatches"], r["offloaded_all_hit_dispatches"]
        assert main_ops["by_op"] == ops["by_op"] and "cumsum" in ops["by_op"]


@pytest.mark.parametrize("recorder", ["eager_backend", "default"])
def test_bench_moe_resident_graphs_both_times_the_recorded_block_beside_the_eager_one(
    recorder: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from functools import partial

    from pdflash.engine.graphs import EagerBackend
    from pdflash.models import offload
    from pdflash.models.resident_graphs import ResidentGraphs, resident_graphs_mode

    monkeypatch.delenv("PDFLASH_RESIDENT_GRAPHS", raising=False)
    if recorder == "eager_backend":  # the engine's CPU stand-in for CUDA graphs
        monkeypatch.setattr(
            offload, "ResidentGraphs", partial(ResidentGraphs, lambda _d: EagerBackend())
        )
    argv = ["moe", "--json", "--arch", "qwen3_moe", "--device", "cpu", "--tokens", "3"]
    argv += ["--repeats", "1", "--all-hit-tokens", "5,7", "--all-hit-iters", "2"]
    argv += ["--all-hit-rounds", "2", "--cache-fraction", "1.0", "--resident-graphs", "both"]
    assert main(argv) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert resident_graphs_mode() == "off"  # the run's setting ended with it
    rows = row["all_hit"]
    for r in rows:
        assert r["resident_graphs"] == "off" and r["by_row_sort"] is None
        assert (r["resident_execution"], r["resident_execution_reason"]) == ("eager", "off")
        other = r["by_resident_graphs"]["on"]
        assert other["bit_equal_vs_main"] is True and other["max_abs_diff_vs_main"] == 0.0
        assert len(other["offloaded_all_hit_rounds_us"]) == 2
        assert other["offloaded_all_hit_us"] > 0 and other["offloaded_all_hit_host_us"] > 0
        if recorder == "default":  # CUDA graphs only: the CPU block ran eagerly, and says why
            assert other["resident_execution"] == "eager"
            assert other["resident_execution_reason"] == "not_cuda"
        else:
            assert other["resident_execution"] == "graph"
            assert other["resident_execution_reason"] is None
    stats = row["resident_graph_stats"]
    if recorder == "default":
        assert stats["captures"] == 0 and stats["eager"]["not_cuda"] > 0
    else:  # one recording per (layer, token count), checked once, then replayed
        assert stats["captures"] == stats["validated"] == len(rows)
        assert stats["mismatches"] == 0 and stats["replays"] > 0


def test_bench_moe_times_its_phases_and_reuses_a_cached_checkpoint(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path / "env-cache"))
    argv = ["moe", "--json", "--arch", "gpt_oss", "--device", "cpu", "--tokens", "3"]
    argv += ["--repeats", "1", "--synthetic-format", "mxfp4", "--all-hit-tokens", "4"]
    argv += ["--all-hit-iters", "1", "--all-hit-rounds", "1"]
    rows = []
    for extra in ([], [], ["--seed", "1"], ["--synthetic-cache", "off"]):
        assert main(argv + extra) == 0
        captured = capsys.readouterr()
        rows.append(json.loads(captured.out.strip().splitlines()[-1]))
        # every phase is noted on stderr as it starts and ends (a timeout's log says where)
        assert "moe [" in captured.err and "checkpoint done in" in captured.err
        assert "all_hit layer 0 tokens 4" in captured.err
    written, reused, _reseeded, temporary = rows
    assert [r["checkpoint"] for r in rows] == ["written", "reused", "written", "temporary"]
    cache = str(tmp_path / "env-cache" / "synthetic-moe")
    assert [r["checkpoint_cache_dir"] for r in rows] == [cache, cache, cache, None]
    assert len(list(Path(cache).iterdir())) == 2  # one per seed
    # the reused checkpoint gives the written one's results
    for key in ("max_abs_err", "moe_max_abs_err", "bytes_moved", "hits", "misses"):
        assert reused[key] == written[key] == temporary[key]
    assert [r["max_abs_err_vs_grouped_mm"] for r in reused["all_hit"]] == [
        r["max_abs_err_vs_grouped_mm"] for r in written["all_hit"]
    ]
    for row in rows:
        setup, run_phases = row["setup_s"], row["phases_s"]
        assert set(setup) >= {"before_run", "checkpoint", "issuer", "load", "resident_blocks"}
        assert set(setup) >= {"link_probe", "hbm_probe"}
        assert "mxfp4_kernel_probes" not in setup  # CUDA only
        assert set(run_phases) == {
            "measure",
            "measure_warmup_repeat",
            "all_hit",
            "mxfp4_dequant_speed",
        }
        assert 0 < run_phases["measure_warmup_repeat"] < run_phases["measure"]
        assert all(v >= 0 for v in [*setup.values(), *run_phases.values()])
        assert setup["load"] == row["load_s"] and setup["checkpoint"] == row["write_s"]
        assert run_phases["measure"] == row["measure_s"] > 0
        assert row["close_adapter_s"] >= 0
        assert row["run_s"] >= sum(v for k, v in setup.items() if k != "before_run")
        for point in row["all_hit"]:
            parts = point["setup_s"]
            assert 0 < parts["first_call"] < parts["point"]
            assert 0 < parts["dense_stack"] < parts["point"]


def test_bench_moe_checkpoint_only_prepares_the_checkpoint_a_run_reuses(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PDFLASH_CACHE", raising=False)
    argv = ["moe", "--json", "--arch", "gpt_oss", "--device", "cpu", "--tokens", "3"]
    argv += ["--repeats", "1", "--synthetic-format", "mxfp4", "--all-hit-tokens", ""]
    with pytest.raises(SystemExit, match="needs a cache"):
        main([*argv, "--checkpoint-only"])
    argv += ["--synthetic-cache", str(tmp_path)]
    outs = []
    for extra in (["--checkpoint-only"], ["--checkpoint-only"], []):
        assert main(argv + extra) == 0
        outs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    prepared, again, row = outs
    assert (prepared["checkpoint"], again["checkpoint"], row["checkpoint"]) == (
        "written",
        "reused",
        "reused",
    )
    assert prepared["path"] == again["path"] and Path(prepared["path"]).parent == tmp_path
    assert set(prepared["setup_s"]) == {"before_run", "checkpoint"}
    assert "per_layer" not in prepared and row["per_layer"]
