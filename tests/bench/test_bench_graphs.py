"""The engine bench's CUDA-graph fields: the row's ``cuda_graphs`` and the
breakdown's ``graphed`` region (the graph runner itself: tests/engine/test_graphs.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from bench_fixtures import load_bench_script
from pdflash.bench.engine_run import RunSpec, _graph_fields, _verify_breakdown

from pdflash.engine.graphs import EagerBackend, GraphRunner


class _Timer:
    method = "host_perf_counter"

    def __init__(self, regions: dict[str, float], total: float, steps: int) -> None:
        self.regions, self.total, self.steps = regions, total, steps

    def kind_count(self, kind: str) -> int:
        return self.steps if kind == "verify" else 0

    def region_s(self, kind: str, name: str) -> float | None:
        return self.regions.get(name) if kind == "verify" else None

    def kind_s(self, kind: str) -> float:
        return self.total if kind == "verify" else 0.0


def test_breakdown_reports_the_graphed_region_only_when_it_ran() -> None:
    with_graphs = _verify_breakdown(_Timer({"graphed": 0.02, "experts": 0.01}, 0.05, 2), True)
    parts = with_graphs["verify_breakdown_ms"]
    assert parts["graphed_ms"] == pytest.approx(10.0) and parts["experts_ms"] == pytest.approx(5.0)
    assert parts["other_and_host_gaps_ms"] == pytest.approx(10.0)
    assert "graphed_note" in parts
    eager = _verify_breakdown(_Timer({"attention": 0.02}, 0.04, 2), True)["verify_breakdown_ms"]
    assert "graphed_ms" not in eager and "graphed_note" not in eager


def test_graph_fields_off_and_on() -> None:
    spec: Any = RunSpec(arch="tiny", baseline="B3")
    off = _graph_fields(SimpleNamespace(runner=SimpleNamespace(graphs=None)), spec)  # type: ignore[arg-type]
    assert off == {"setting": "off", "state": "off", "why_off": "cuda_graphs off"}
    spec = RunSpec(arch="tiny", baseline="B3", cuda_graphs="auto")
    cpu = _graph_fields(SimpleNamespace(runner=SimpleNamespace(graphs=None)), spec)  # type: ignore[arg-type]
    assert cpu["why_off"] == "not a CUDA device"
    graphs = GraphRunner(EagerBackend())
    graphs.stats.replays, graphs.stats.captures = 7, 2
    graphs.stats.fallbacks["prefill"] += 3
    graphs.draft_stats.replays = 5
    row = _graph_fields(SimpleNamespace(runner=SimpleNamespace(graphs=graphs)), spec)  # type: ignore[arg-type]
    assert row["state"] == "on" and row["backend"] == "eager"
    assert row["replays"] == 7 and row["captures"] == 2 and row["eager_fallbacks"] == 3
    assert row["eager_fallback_reasons"] == {"prefill": 3}
    assert row["draft"]["replays"] == 5 and row["graphs_held"] == 0
    assert row["piecewise_buckets_held"] == 0
    # a piecewise run replays pieces only: it is on, not "on_no_replay"
    pieces = GraphRunner(EagerBackend())
    pieces.stats.piecewise_steps, pieces.stats.captures = 15, 8
    row = _graph_fields(SimpleNamespace(runner=SimpleNamespace(graphs=pieces)), spec)  # type: ignore[arg-type]
    assert row["state"] == "on" and row["replays"] == 0 and row["piecewise_steps"] == 15
    idle = GraphRunner(EagerBackend())
    row = _graph_fields(SimpleNamespace(runner=SimpleNamespace(graphs=idle)), spec)  # type: ignore[arg-type]
    assert row["state"] == "on_no_replay"
    with pytest.raises(ValueError, match="cuda_graphs"):
        RunSpec(arch="tiny", baseline="B3", cuda_graphs="on").validate()


def test_cli_choice_lists_match_the_library_and_piecewise_is_a_setting() -> None:
    from pdflash.bench.suites import _common
    from pdflash.bench.suites.engine import _graph_settings

    from pdflash.engine.config import CUDA_GRAPHS

    assert _common.CUDA_GRAPHS == CUDA_GRAPHS  # the CLIs' copy, kept free of torch
    from pdflash.hybrid.kernels import HOST_FORMATS

    assert _common.HOST_FORMATS == HOST_FORMATS  # --host-format offers every host format
    assert _graph_settings("off,auto,piecewise") == ["off", "auto", "piecewise"]
    RunSpec(arch="tiny", baseline="B1", cuda_graphs="piecewise").validate()


def test_the_warm_up_pre_captures_every_bucket_of_the_run(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B3 runs with the graph runner over the eager stand-in backend (the
    CUDA one on a GPU): the warm-up records every verify bucket, the
    measured run records none, and its tokens and routing equal a run
    without graphs."""
    from pdflash.bench import engine_run
    from pdflash.bench.engine_run import run_spec

    from pdflash.engine.engine import Engine

    class GraphedEngine(Engine):
        def __init__(self, *args: Any, **kw: Any) -> None:
            if args[1].cuda_graphs != "off":
                kw["graphs"] = GraphRunner(EagerBackend())
            super().__init__(*args, **kw)

    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    monkeypatch.setattr(engine_run, "Engine", GraphedEngine)
    engine_run.release_targets()
    common: dict[str, Any] = {"arch": "tiny", "baseline": "B3", "device": "cpu"}
    common |= {"concurrency": 3, "num_requests": 5, "block_size": 4, "warmup": "short"}
    common |= {"max_new_tokens": 9, "prompt_len": 5, "prompt_len_max": 8}
    rows = [run_spec(RunSpec(**common, cuda_graphs=g)) for g in ("off", "auto")]
    off, on = rows
    graphs = on.row["cuda_graphs"]
    assert graphs["backend"] == "eager" and graphs["state"] == "on"
    assert graphs["captures_in_run"] == graphs["captures"] == 0 and graphs["validated"] == 0
    assert graphs["replays"] > 0 and set(graphs["eager_fallback_reasons"]) <= {"prefill"}
    warm = on.row["warmup"]["graphs"]
    prepare = warm["prepare"]
    assert prepare["state"] == "on" and prepare["failed"] == 0 and prepare["prepared"] > 0
    # the pre-capture runs after the warm-up's requests: it adds what they did not meet
    assert warm["captures"] == prepare["prepared"] + prepare["already_held"]
    assert prepare["draft"]["prepared"] > 0 and prepare["draft"]["failed"] == 0
    assert graphs["draft_captures_in_run"] == 0 and graphs["draft"]["replays"] > 0
    assert "graphs" not in off.row["warmup"]
    from pdflash.report.schema import validate_row

    assert validate_row(on.row) == [] and validate_row(off.row) == []
    for name in ("committed_tokens", "steps", "verify_forwards", "acceptance_length_mean"):
        assert off.row[name] == on.row[name], name
    assert len(off.routing_trace) == len(on.routing_trace)
    for a, b in zip(off.routing_trace, on.routing_trace, strict=True):
        assert (a == b).all()


def test_graph_host_times_every_part_of_a_replayed_step() -> None:
    from pdflash.bench.graph_host import PARTS, measure

    out = measure(layers=2, requests=3, block=4, prompt_len=5, steps=4, backend="eager")
    parts = out["parts_us"]
    assert list(parts) == list(PARTS)
    assert all(v > 0 for v in parts.values()), parts
    # the eager stand-in's replay reruns the step: it is most of the forward
    assert parts["replay"] < out["forward_us"]
    assert out["outside_replay_us"] == pytest.approx(out["forward_us"] - parts["replay"])
    assert out["rest_us"] == pytest.approx(out["forward_us"] - sum(parts.values()))
    with pytest.raises(ValueError, match="backend"):
        measure(backend="cuda")


def test_graphs_summary_reports_captures_in_the_run_and_the_pre_capture() -> None:
    summary = load_bench_script("graphs_summary.py")

    def row(setting: str, captures: int, prepared: int, s: float) -> dict[str, Any]:
        graphs: dict[str, Any] = {"setting": setting}
        warmup: dict[str, Any] = {"mode": "workload"}
        if setting != "off":
            graphs |= {"captures": captures, "validated": captures, "replays": 10}
            graphs["draft"] = {"captures": 1}
            warmup["graphs"] = {"prepare": {"prepared": prepared, "already_held": 0, "s": s}}
        return {
            "arch": "gpt-oss-20b",
            "cuda_graphs": graphs,
            "warmup": warmup,
            "output_tokens_per_s": 100.0,
            "verify_breakdown_ms": {"verify_ms": 10.0},
        }

    rows = [row("off", 0, 0, 0), row("auto", 0, 30, 2.0), row("auto", 1, 29, 4.0)]
    table = {e["setting"]: e for e in summary.summarise(rows)["table"]}
    auto = table["auto"]
    assert auto["captures_in_run"] == 1 and auto["validated_in_run"] == 1
    assert auto["draft_captures_in_run"] == 2
    assert auto["prepared_per_run"] == pytest.approx(29.5)
    assert auto["prepare_s_per_run"] == pytest.approx(3.0)
    assert "captures_in_run" not in table["off"]


def test_graphs_summary_keys_by_baseline_and_reports_the_roofline() -> None:
    summary = load_bench_script("graphs_summary.py")

    def row(baseline: str, verify_ms: float, roof_ms: float | None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "arch": "qwen3-30b-a3b",
            "baseline": baseline,
            "repeat": 0,
            "cuda_graphs": {"setting": "auto"},
            "output_tokens_per_s": 100.0,
            "verify_breakdown_ms": {"verify_ms": verify_ms},
            "verify_roofline": {
                "verify_ms": verify_ms,
                "bytes_per_forward": {"experts": 3e9, "kv_cache": 1e6},
                "total_bytes_per_forward": 3.001e9,
            },
        }
        if roof_ms is None:
            out |= {"hbm_gbps": None, "hbm_roofline_ms": None, "verify_over_roofline": None}
            out["not_measured"] = {"hbm_roofline_ms": "no CUDA device (cpu)"}
        else:
            out |= {"hbm_gbps": 4000.0, "hbm_roofline_ms": roof_ms}
            out["verify_over_roofline"] = verify_ms / roof_ms
        return out

    rows = [row("B3", 7.0, 2.0), row("B3", 7.4, 2.0), row("B1", 84.0, 2.5), row("B2", 9.0, None)]
    mx = row("B3", 5.0, 1.0) | {"expert_format": "mxfp4", "compressed_gemm": "fused"}
    entries = summary.summarise([*rows, mx])["table"]
    table = {e["baseline"]: e for e in entries if e["expert_format"] == "dense"}
    (mx_entry,) = [e for e in entries if e["expert_format"] == "mxfp4"]  # never with bf16's
    assert mx_entry["runs"] == 1 and mx_entry["compressed_gemm"] == ["fused"]
    assert mx_entry["verify_over_roofline"] == pytest.approx(5.0)
    assert table["B3"]["runs"] == 2 and table["B1"]["runs"] == 1  # B1 not averaged into B3
    assert table["B3"]["verify_ms"] == pytest.approx(7.2)
    assert table["B3"]["hbm_roofline_ms"] == pytest.approx(2.0)
    assert table["B3"]["verify_over_roofline"] == pytest.approx(3.6)
    assert table["B1"]["verify_over_roofline"] == pytest.approx(84.0 / 2.5)
    assert table["B3"]["experts_bytes"] == 3e9 and table["B3"]["hbm_gbps"] == 4000.0
    # unmeasured: no roofline figure, the reason instead (never 0)
    assert "hbm_roofline_ms" not in table["B2"] and "verify_over_roofline" not in table["B2"]
    assert table["B2"]["roofline_not_measured"] == ["no CUDA device (cpu)"]
    assert table["B2"]["total_bytes"] == pytest.approx(3.001e9)
    runs = summary.summarise(rows)["runs"]
    assert [r["roofline"].get("verify_over_roofline") for r in runs][:2] == [3.5, 3.7]
