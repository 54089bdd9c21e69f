"""Summarise graphs_check.sh's engine rows: per (arch, cuda_graphs setting),
the mean verify ms and its breakdown, the drafter's ms per verify, tok/s,
and the graph runner's counters (every run listed too).

    python3 bench/h200/graphs_summary.py OUT/b3_gptoss OUT/b3_qwen3 --out summary.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

PARTS = (
    "verify_ms",
    "graphed_ms",
    "attention_ms",
    "router_ms",
    "experts_ms",
    "other_and_host_gaps_ms",
    "draft_ms_per_verify",
)


def _rows(dirs: list[Path]) -> list[dict[str, Any]]:
    rows = []
    for d in dirs:
        path = d / "rows.jsonl"
        if path.exists():
            rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    runs = []
    for row in rows:
        graphs = row.get("cuda_graphs") or {}
        setting = str(graphs.get("setting", "off"))
        arch = str(row.get("arch", row.get("spec", {}).get("arch")))
        groups[(arch, setting)].append(row)
        runs.append(
            {
                "arch": arch,
                "setting": setting,
                "repeat": row.get("spec", {}).get("repeat"),
                "tok_s": row.get("output_tokens_per_s"),
                "breakdown": row.get("verify_breakdown_ms"),
                "cuda_graphs": graphs,
                "warmup_graphs": (row.get("warmup") or {}).get("graphs"),
            }
        )
    table = []
    for (arch, setting), group in sorted(groups.items()):
        entry: dict[str, Any] = {"arch": arch, "setting": setting, "runs": len(group)}
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
    for e in summary["table"]:
        parts = " ".join(f"{p}={e[p]:.2f}" for p in PARTS if p in e)
        print(f"{e['arch']} graphs={e['setting']} runs={e['runs']} tok/s={e['tok_s']} {parts}")
    text = json.dumps(summary)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
