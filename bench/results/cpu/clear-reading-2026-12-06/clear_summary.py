"""PD / B1 pooled over the four processes of each tree (per-repeat ratios of
interleaved runs; mean with a normal 95% interval, and the median) and the
width's host time a run from its cost books.

    python3 clear_summary.py
"""

from __future__ import annotations

import gzip
import json
import math
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    for tree in ("new", "old"):
        ratios, width_ms, decided = [], [], []
        for folder in sorted(HERE.glob(f"{tree}[0-9]")):
            by_repeat: dict[int, dict[str, float]] = {}
            with gzip.open(folder / "rows.jsonl.gz", "rt") as lines:
                for line in lines:
                    row = json.loads(line)
                    by_repeat.setdefault(row["repeat"], {})[row["arm"]] = row["output_tokens_per_s"]
                    if row["arm"] == "PD":
                        books = row["verify_width"]["cost_gate"]
                        decided.append(books["decided_steps"])
                        width_ms.append(
                            books["decided_steps"] * books["host_ms_per_decided_step"]
                            + books["stood_down_steps"]
                            * (books["host_ms_per_stood_down_step"] or 0.0)
                        )
            ratios += [d["PD"] / d["B1"] for d in by_repeat.values() if {"PD", "B1"} <= set(d)]
        mean = statistics.mean(ratios)
        half = 1.96 * statistics.stdev(ratios) / math.sqrt(len(ratios))
        print(
            f"{tree}: PD/B1 over {len(ratios)} pairs: median {statistics.median(ratios):.3f}, "
            f"mean {mean:.3f} [{mean - half:.3f}, {mean + half:.3f}]; the width's decided steps "
            f"a run {statistics.median(decided):.0f}, its host time {statistics.median(width_ms):.2f} ms a run"
        )


if __name__ == "__main__":
    main()
