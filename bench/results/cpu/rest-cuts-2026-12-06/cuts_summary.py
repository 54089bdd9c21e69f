"""PD / B1 pooled over the four processes of each tree (per-repeat ratios of
interleaved runs; mean with a normal 95% interval, and the median) and PD's
host time a step outside the forwards' spans beyond B1's (the mean over
pairs with a normal 95% interval; ``rest_summary.outside_spans_ms``).

    python3 cuts_summary.py
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import math
import statistics
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location(
    "rest_summary", HERE.parent / "rest-2026-12-06" / "rest_summary.py"
)
assert _spec is not None and _spec.loader is not None
rest_summary: Any = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rest_summary)


def _interval(values: list[float]) -> tuple[float, float]:
    mean = statistics.mean(values)
    return mean, 1.96 * statistics.stdev(values) / math.sqrt(len(values))


def main() -> None:
    for tree in ("new", "old"):
        ratios, outside = [], []
        for folder in sorted(HERE.glob(f"{tree}[0-9]")):
            by_repeat: dict[int, dict[str, dict[str, Any]]] = {}
            with gzip.open(folder / "rows.jsonl.gz", "rt") as lines:
                for line in lines:
                    row = json.loads(line)
                    by_repeat.setdefault(row["repeat"], {})[row["arm"]] = row
            for pair in by_repeat.values():
                if {"PD", "B1"} <= set(pair):
                    pd, b1 = pair["PD"], pair["B1"]
                    ratios.append(pd["output_tokens_per_s"] / b1["output_tokens_per_s"])
                    outside.append(
                        rest_summary.outside_spans_ms(pd) - rest_summary.outside_spans_ms(b1)
                    )
        mean, half = _interval(ratios)
        out_mean, out_half = _interval(outside)
        print(
            f"{tree}: PD/B1 over {len(ratios)} pairs: median {statistics.median(ratios):.3f}, "
            f"mean {mean:.3f} [{mean - half:.3f}, {mean + half:.3f}]; PD - B1 outside the "
            f"spans {out_mean:.3f} +- {out_half:.3f} ms a step"
        )


if __name__ == "__main__":
    main()
