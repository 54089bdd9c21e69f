"""Summarise graphs_check.sh's (and roofline_check.sh's) engine rows: per
(arch, expert format, baseline, cuda_graphs setting), the mean verify ms and its breakdown,
the drafter's ms per verify, tok/s, the HBM roofline of a verify forward
(``hbm_roofline_ms``, its byte parts, the measured bandwidth) and
``verify_over_roofline``, and the graph runner's counters (every run listed
too). Runs of different baselines or expert formats are never averaged
together.

    python3 bench/h200/graphs_summary.py OUT/b3_gptoss OUT/b3_qwen3 --out summary.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from pdflash.report.writers import read_jsonl, results_path

PARTS = (
    "verify_ms",
    "graphed_ms",
    "attention_ms",
    "router_ms",
    "experts_ms",
    "other_and_host_gaps_ms",
    "draft_ms_per_verify",
)
#: the roofline columns (means over a group's runs that have them)
ROOFLINE_COLUMNS = (
    "hbm_roofline_ms",
    "verify_over_roofline",
    "hbm_gbps",
    "non_expert_params_bytes",
    "embedding_rows_bytes",
    "experts_bytes",
    "kv_cache_bytes",
    "total_bytes",
)


def _rows(dirs: list[Path]) -> list[dict[str, Any]]:
    rows = []
    for d in dirs:
        path = results_path(d / "rows.jsonl")
        if path.exists():
            rows += read_jsonl(path)
    return rows


def _fmean(values: list[Any]) -> float | None:
    nums = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return statistics.fmean(nums) if nums else None


def _roofline(row: dict[str, Any]) -> dict[str, Any]:
    """One run's roofline columns (absent ones left out; their reasons are
    in the row's not_measured)."""
    roof = row.get("verify_roofline") or {}
    out: dict[str, Any] = {}
    for name in ("hbm_gbps", "hbm_roofline_ms", "verify_over_roofline"):
        if isinstance(row.get(name), (int, float)):
            out[name] = row[name]
    if isinstance(roof.get("verify_ms"), (int, float)):
        out["verify_ms"] = roof["verify_ms"]
    for part, nbytes in (roof.get("bytes_per_forward") or {}).items():
        out[f"{part}_bytes"] = nbytes
    if isinstance(roof.get("total_bytes_per_forward"), (int, float)):
        out["total_bytes"] = roof["total_bytes_per_forward"]
    missing = row.get("not_measured") or {}
    if "hbm_roofline_ms" in missing:
        out["roofline_not_measured"] = missing["hbm_roofline_ms"]
    return out


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    groups: dict[tuple[str, str, str, str], list[dict[str, Any]]] = defaultdict(list)
    runs = []
    for row in rows:
        graphs = row.get("cuda_graphs") or {}
        setting = str(graphs.get("setting", "off"))
        spec = row.get("spec") or {}
        arch = str(row.get("arch", spec.get("arch")))
        baseline = str(row.get("baseline", spec.get("baseline")))
        fmt = str(row.get("expert_format", "dense"))
        groups[(arch, fmt, baseline, setting)].append(row)
        runs.append(
            {
                "arch": arch,
                "expert_format": fmt,
                "compressed_gemm": row.get("compressed_gemm"),
                "baseline": baseline,
                "setting": setting,
                "repeat": row.get("repeat", spec.get("repeat")),
                "tok_s": row.get("output_tokens_per_s"),
                "breakdown": row.get("verify_breakdown_ms"),
                "roofline": _roofline(row),
                "cuda_graphs": graphs,
                "warmup_graphs": (row.get("warmup") or {}).get("graphs"),
            }
        )
    table = []
    for (arch, fmt, baseline, setting), group in sorted(groups.items()):
        entry: dict[str, Any] = {
            "arch": arch,
            "expert_format": fmt,
            "compressed_gemm": sorted({str(r.get("compressed_gemm")) for r in group}),
            "baseline": baseline,
            "setting": setting,
            "runs": len(group),
        }
        roofs = [_roofline(r) for r in group]
        for name in ROOFLINE_COLUMNS:
            value = _fmean([r.get(name) for r in roofs])
            if value is not None:
                entry[name] = value
        why = sorted({r["roofline_not_measured"] for r in roofs if "roofline_not_measured" in r})
        if why:
            entry["roofline_not_measured"] = why
        for part in PARTS:
            values = [
                r["verify_breakdown_ms"][part]
                for r in group
                if r.get("verify_breakdown_ms") and part in r["verify_breakdown_ms"]
            ]
            if values:
                entry[part] = statistics.fmean(values)
        toks = [r["output_tokens_per_s"] for r in group if r.get("output_tokens_per_s")]
        entry["tok_s"] = statistics.fmean(toks) if toks else None
        entry["replays"] = sum((r.get("cuda_graphs") or {}).get("replays", 0) for r in group)
        entry["eager_fallbacks"] = sum(
            (r.get("cuda_graphs") or {}).get("eager_fallbacks", 0) for r in group
        )
        if setting != "off":
            # recordings (and their first-replay checks) inside the measured
            # runs, and what each run's warm-up pre-captured
            for name in ("captures", "validated"):
                entry[f"{name}_in_run"] = sum(
                    (r.get("cuda_graphs") or {}).get(name, 0) for r in group
                )
            entry["draft_captures_in_run"] = sum(
                ((r.get("cuda_graphs") or {}).get("draft") or {}).get("captures", 0) for r in group
            )
            prepared = [
                r["warmup"]["graphs"]["prepare"]
                for r in group
                if ((r.get("warmup") or {}).get("graphs") or {}).get("prepare")
            ]
            if prepared:
                entry["prepared_per_run"] = statistics.fmean(
                    p.get("prepared", 0) + p.get("already_held", 0) for p in prepared
                )
                entry["prepare_s_per_run"] = statistics.fmean(p.get("s", 0.0) for p in prepared)
        table.append(entry)
    return {"table": table, "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    summary = summarise(_rows(args.dirs))
    for r in summary["runs"]:
        roof = r["roofline"]
        cols = " ".join(
            f"{k}={roof[k]:.3f}"
            for k in ("verify_ms", "hbm_roofline_ms", "verify_over_roofline")
            if k in roof
        )
        if "total_bytes" in roof:
            cols += f" bytes_per_forward={roof['total_bytes']:.4g}"
        why = roof.get("roofline_not_measured")
        why = f" (roofline not measured: {why})" if why else ""
        print(
            f"run {r['arch']} {r['expert_format']} {r['baseline']} graphs={r['setting']} "
            f"repeat={r['repeat']} {cols}{why}"
        )
    for e in summary["table"]:
        parts = " ".join(f"{p}={e[p]:.2f}" for p in PARTS if p in e)
        roof = " ".join(
            f"{k}={e[k]:.3f}" for k in ("hbm_roofline_ms", "verify_over_roofline") if k in e
        )
        print(
            f"{e['arch']} {e['expert_format']} {e['baseline']} graphs={e['setting']} "
            f"runs={e['runs']} "
            f"tok/s={e['tok_s']} {parts} {roof}"
        )
    text = json.dumps(summary)
    if args.out is None:
        print(text)
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    # the file holds every run; stdout's last line (run.sh's step result) the table
    print(json.dumps({"table": summary["table"], "out": str(args.out)}))


if __name__ == "__main__":
    main()
