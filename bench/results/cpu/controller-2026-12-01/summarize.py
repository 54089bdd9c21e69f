"""Median tables of a rows.jsonl written by ``run_default.py`` or
``bench/results/width-cpu/run.py`` (relative CPU figures only). Usage:

    python bench/results/cpu/controller-2026-12-01/summarize.py ROWS.jsonl [--best B1,B2]

Per (concurrency, label, width): tokens/s median (min-max), τ, mean drafts
verified, and for PD rows the fraction of steps each part ran and the
switches; then PD over the best of the ``--best`` labels, per repeat (the
labels of one repeat ran interleaved, so a ratio cancels some of the box's
load swings).
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from pdflash.report.writers import read_jsonl


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("rows", type=Path)
    ap.add_argument("--best", default="B1,B2")
    args = ap.parse_args()
    rows = read_jsonl(args.rows)
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        width = (r.get("verify_width") or {}).get("setting", "full")
        groups[(r["concurrency"], r["baseline"], width)].append(r)
    print(
        "| c | label | width | runs | tokens/s median (min-max) | τ | drafts verified | "
        "PD parts on (sched / stream / route-ahead) | switches |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for key in sorted(groups):
        rs = groups[key]
        tps = [r["output_tokens_per_s"] for r in rs]
        tau = statistics.median(r["acceptance_length_mean"] for r in rs)
        vw: list[float | None] = [
            (r.get("verify_width") or {}).get("mean_verified_drafts") for r in rs
        ]
        drafts = [v for v in vw if v is not None]
        width = "every" if len(drafts) < len(vw) else f"{statistics.median(drafts):.2f}"
        parts, sw = "—", "—"
        books: list[dict[str, Any]] = [r["pd_parts"] for r in rs if r.get("pd_parts")]
        if books and books[0].get("policy") != "fixed":
            on = {
                p: statistics.median(b["on_fraction"][p] for b in books)
                for p in ("scheduler_2d", "stream", "route_ahead")
            }
            parts = " / ".join(f"{on[p]:.2f}" for p in ("scheduler_2d", "stream", "route_ahead"))
            sw = ", ".join(
                "; ".join(
                    f"{d['part']} {'on' if d['on'] else 'off'} @{d['step']}"
                    for d in b["decisions"]
                    if d["switched"]
                )
                or "none"
                for b in books
            )
        print(
            f"| {key[0]} | {key[1]} | {key[2]} | {len(rs)} | {statistics.median(tps):.4g} "
            f"({min(tps):.4g}-{max(tps):.4g}) | {tau:.2f} | {width} | {parts} | {sw} |"
        )
    best = args.best.split(",")
    print()
    by: dict[tuple[Any, ...], dict[str, float]] = defaultdict(dict)
    for r in rows:
        width = (r.get("verify_width") or {}).get("setting", "full")
        label = r["baseline"] if r["baseline"] != "B2" or width == "full" else f"B2 {width}"
        by[(r["concurrency"], r["repeat"])][label] = r["output_tokens_per_s"]
    for c in sorted({k[0] for k in by}):
        ratios = []
        for (cc, _repeat), d in sorted(by.items()):
            have = [d[b] for b in best if b in d]
            if cc == c and "PD" in d and have:
                ratios.append(d["PD"] / max(have))
        if ratios:
            print(
                f"c={c}: PD / best of {best} per repeat: "
                + ", ".join(f"{x:.3f}" for x in ratios)
                + f" (median {statistics.median(ratios):.3f}, > 1 in "
                f"{sum(x > 1 for x in ratios)}/{len(ratios)})"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
