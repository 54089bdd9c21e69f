"""bench/h200/trace_baselines_summary.py: PD (and PD+host) at the preset
width against the best B1/B2 configuration per point, with per-repeat ratios
and a verdict."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

from bench_fixtures import load_bench_script


def _module() -> ModuleType:
    return load_bench_script("trace_baselines_summary.py")


def _row(label: str, width: str, repeat: int, tps: float, conc: int = 4) -> dict[str, Any]:
    return {
        "arch": "gpt-oss-20b",
        "cache_fraction": 0.2,
        "concurrency": conc,
        "baseline": label,
        "repeat": repeat,
        "output_tokens_per_s": tps,
        "verify_width": {"setting": width, "mean_width_drafts": 1.0},
        "acceptance_length_mean": 1.5,
        "bytes_per_token": 2e9,
        "routing_source": "trace",
        "acceptance_source": "trace",
    }


def _rows(pd: list[float], b1: list[float], b2: list[float]) -> list[dict[str, Any]]:
    out = []
    for k in range(len(pd)):
        out += [
            _row("PD", "adaptive", k, pd[k]),
            _row("B1", "fixed:1", k, b1[k]),
            _row("B2", "fixed:1", k, b2[k]),
        ]
    return out


def test_pd_is_held_against_the_best_baseline_configuration_per_repeat() -> None:
    mod = _module()
    (point,) = mod.summarize(_rows([10, 11, 12], [9, 10, 11], [20, 22, 24]))
    cmp_ = point["pd_vs_best_baseline"]
    assert cmp_["best"] == "B2 [fixed:1]"
    assert cmp_["pair_ratios"] == [0.5, 0.5, 0.5]
    # three equal ratios: an interval of no width
    assert cmp_["pair_ratio_ci95"] == [0.5, 0.5]
    assert cmp_["verdict"] == "slower"
    assert point["configs"]["PD [adaptive]"]["tokens_per_s"]["median"] == 11
    assert point["configs"]["PD [adaptive]"]["runs_with_captures_in_run"] == 0
    rows = _rows([10, 11, 12], [9, 10, 11], [20, 22, 24])
    rows[0]["cuda_graphs"] = {"captures_in_run": 8, "draft_captures_in_run": 0}
    (captured,) = mod.summarize(rows)
    assert captured["configs"]["PD [adaptive]"]["runs_with_captures_in_run"] == 1


def test_pairs_straddling_one_read_within_noise_and_one_repeat_has_no_verdict() -> None:
    mod = _module()
    (point,) = mod.summarize(_rows([10, 14, 12], [11, 13, 12], [9, 10, 11]))
    assert point["pd_vs_best_baseline"]["verdict"] == "within noise"
    assert point["pd_vs_best_baseline"]["verdict_from"] == "pairs"
    (single,) = mod.summarize(_rows([10], [11], [9]))
    assert single["pd_vs_best_baseline"]["verdict"] == "too few repeats"
    assert single["pd_vs_best_baseline"]["verdict_from"] == "configurations"
    assert single["pd_vs_best_baseline"]["pair_ratio_ci95"] is None


def test_the_verdict_reads_the_pairs_where_repeats_pair() -> None:
    """PD 5% faster in every repeat, while the repeats' spread makes the two
    configurations' intervals overlap: the pairs say faster (the old rule,
    overlap of the configurations' intervals, said within noise)."""
    mod = _module()
    (point,) = mod.summarize(_rows([10.5, 12.6, 14.7], [10, 12, 14], [5, 6, 7]))
    cmp_ = point["pd_vs_best_baseline"]
    assert cmp_["best"] == "B1 [fixed:1]"
    assert cmp_["verdict"] == "faster" and cmp_["verdict_from"] == "pairs"
    assert mod.verdict([10.5, 12.6, 14.7], [10, 12, 14]) == "within noise"


def test_pd_host_is_held_against_the_best_baseline_and_against_pd() -> None:
    mod = _module()
    rows = _rows([10, 11, 12], [9, 10, 11], [8, 9, 10])
    rows += [_row("PD+host", "adaptive", k, tps) for k, tps in enumerate([15, 16.5, 18])]
    (point,) = mod.summarize(rows)
    host = point["pd_host_vs_best_baseline"]
    assert (host["pd"], host["best"]) == ("PD+host [adaptive]", "B1 [fixed:1]")
    assert host["pair_ratios"] == [15 / 9, 16.5 / 10, 18 / 11]
    assert host["verdict"] == "faster"
    assert point["pd_host_vs_pd"]["pair_ratios"] == [1.5, 1.5, 1.5]
    # without PD+host rows neither comparison is made
    (plain,) = mod.summarize(_rows([10, 11, 12], [9, 10, 11], [8, 9, 10]))
    assert "pd_host_vs_best_baseline" not in plain and "pd_host_vs_pd" not in plain


def test_main_writes_the_summary_beside_the_rows(tmp_path: Path) -> None:
    mod = _module()
    (tmp_path / "trace").mkdir()
    rows = _rows([30, 31, 32], [10, 11, 12], [9, 10, 11])
    (tmp_path / "trace" / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    mod.main(tmp_path)
    written = json.loads((tmp_path / "trace_baselines_summary.json").read_text())
    assert written["points"][0]["pd_vs_best_baseline"]["verdict"] == "faster"


def test_points_are_kept_apart_by_workload_and_carry_the_steps() -> None:
    mod = _module()
    burst = _rows([10, 11, 12], [9, 10, 11], [8, 9, 10])
    closed = _rows([20, 21, 22], [19, 20, 21], [18, 19, 20])
    for r in burst:
        r["steps"] = 27
    for r in closed:
        r["workload"] = {"arrivals": "closed", "num_requests": 16}
        r["steps"] = 83 if r["baseline"] == "PD" else 91
    points = mod.summarize(burst + closed)
    assert [(p["arrivals"], p["num_requests"]) for p in points] == [("burst", None), ("closed", 16)]
    assert points[0]["configs"]["PD [adaptive]"]["steps_median"] == 27
    assert points[1]["configs"]["PD [adaptive]"]["steps_median"] == 83
    assert points[1]["configs"]["B1 [fixed:1]"]["steps_median"] == 91
    assert points[1]["pd_vs_best_baseline"]["pair_ratios"] == [20 / 19, 21 / 20, 22 / 21]
    # rows without a step count (older ones) leave it absent, not 0
    (old,) = mod.summarize(_rows([10, 11], [9, 10], [8, 9]))
    assert old["configs"]["PD [adaptive]"]["steps_median"] is None


def test_pd_at_its_fastest_width_is_also_held_against_the_best_baseline() -> None:
    mod = _module()
    rows = _rows([10, 11, 12], [11, 12, 13], [9, 10, 11])
    rows += [_row("PD", "fixed:1", k, tps) for k, tps in enumerate([13, 14.3, 15.6])]
    (point,) = mod.summarize(rows)
    assert point["pd_vs_best_baseline"]["pd"] == "PD [adaptive]"
    best = point["pd_best_vs_best_baseline"]
    assert best["pd"] == "PD [fixed:1]" and best["best"] == "B1 [fixed:1]"
    assert best["pair_ratios"] == [13 / 11, 14.3 / 12, 15.6 / 13]
    # where the preset is PD's fastest width, the second comparison is absent
    (preset_best,) = mod.summarize(_rows([20, 21, 22], [11, 12, 13], [9, 10, 11]))
    assert "pd_best_vs_best_baseline" not in preset_best
