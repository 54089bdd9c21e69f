"""Pairs and run medians of this folder's trace-replay A/B
(``rows.jsonl.gz``: every run of ``trace_ab.py``; pairs are the runs of one
repeat at one concurrency, arms interleaved and rotated per repeat). Rows
without ``arch`` ran on small-qwen3_moe with 4 MoE layers (calls 1-3).

    python3 bench/results/cpu/trace-replay-2026-12-07/trace_summary.py
"""

from __future__ import annotations

import gzip
import json
import statistics
from pathlib import Path
from typing import Any

from pdflash.report.stats import interval

HERE = Path(__file__).resolve().parent
PAIRS = [
    ("PD", "B1f1"),
    ("PD", "B1"),
    ("PDf1", "B1f1"),
    ("PD", "PDf1"),
    ("PDnoraf1", "B1f1"),
    ("PDf1", "PDnoraf1"),
    ("PDf1evra", "B1f1"),
    ("PDf1evra", "PDf1"),
]
ARMS = ["B1", "B1f1", "PD", "PDf1", "PDnoraf1", "PDf1evra"]


def main() -> None:
    with gzip.open(HERE / "rows.jsonl.gz", "rt") as lines:
        rows = [json.loads(line) for line in lines]
    for r in rows:
        r.setdefault("arch", "small-qwen3_moe")
        r.setdefault("layers", 4)
    for target in sorted({(r["arch"], r["layers"]) for r in rows}):
        print(f"{target[0]}, {target[1]} MoE layers:")
        _target([r for r in rows if (r["arch"], r["layers"]) == target])


def _target(rows: list[dict[str, Any]]) -> None:
    for conc in sorted({r["concurrency"] for r in rows}):
        for call in sorted({r["call"] for r in rows}):
            by_rep: dict[int, dict[str, float]] = {}
            for r in rows:
                if r["concurrency"] == conc and r["call"] == call:
                    by_rep.setdefault(r["repeat"], {})[r["arm"]] = r["output_tokens_per_s"]
            for num, den in PAIRS:
                ratios = [d[num] / d[den] for d in by_rep.values() if num in d and den in d]
                if len(ratios) >= 3:
                    iv = interval(ratios)
                    print(
                        f"c={conc} call {call} {num}/{den} ({len(ratios)} pairs): "
                        f"{iv.median:.3f} [{iv.low:.3f}, {iv.high:.3f}]"
                    )
        for arm in ARMS:
            runs = [r for r in rows if r["concurrency"] == conc and r["arm"] == arm]
            if not runs:
                continue

            def med(key: str, runs: list[dict[str, Any]] = runs) -> float:
                vals = [r[key] for r in runs if r.get(key) is not None]
                return statistics.median(vals) if vals else float("nan")

            print(
                f"  c={conc} {arm} ({len(runs)} runs): {med('output_tokens_per_s'):.2f} tok/s, "
                f"{med('bytes_per_token') / 1e6:.1f} MB/token, hit {med('expert_cache_hit_rate'):.2f}, "
                f"exposed fetch {med('exposed_fetch_s'):.2f} s, route-ahead coverage "
                f"{med('routeahead_batch_coverage'):.2f} precision "
                f"{med('routeahead_batch_precision'):.2f}, p99 round "
                f"{med('round_latency_p99_s') * 1e3:.0f} ms, wall {med('wall_s'):.2f} s"
            )


if __name__ == "__main__":
    main()
