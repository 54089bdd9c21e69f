"""Pooled over the three processes here, at each concurrency: the pairs'
ratios of tokens/s (per-repeat ratios of interleaved runs; mean with a
normal 95% interval, and the median) and the numerator's host time a step
outside the forwards' spans beyond the denominator's (mean with a normal
95% interval; ``rest_summary.outside_spans_ms``).

    python3 steady_summary.py
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

PAIRS = (("PD", "B1"), ("PDsettled", "B1warm"), ("PDsettled", "PD"), ("B1warm", "B1"))


def _interval(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), 1.96 * statistics.stdev(values) / math.sqrt(len(values))


def main() -> None:
    runs: dict[tuple[str, int, int], dict[str, dict[str, Any]]] = {}
    for folder in sorted(HERE.glob("p[0-9]")):
        with gzip.open(folder / "rows.jsonl.gz", "rt") as lines:
            for line in lines:
                row = json.loads(line)
                key = (folder.name, row["concurrency"], row["repeat"])
                runs.setdefault(key, {})[row["arm"]] = row
    for conc in sorted({c for _, c, _ in runs}):
        for num, den in PAIRS:
            ratios, outside = [], []
            for (_, c, _), arms in runs.items():
                if c == conc and {num, den} <= set(arms):
                    a, b = arms[num], arms[den]
                    ratios.append(a["output_tokens_per_s"] / b["output_tokens_per_s"])
                    outside.append(
                        rest_summary.outside_spans_ms(a) - rest_summary.outside_spans_ms(b)
                    )
            mean, half = _interval(ratios)
            out_mean, out_half = _interval(outside)
            print(
                f"c={conc} {num}/{den} ({len(ratios)} pairs): median "
                f"{statistics.median(ratios):.3f}, mean {mean:.3f} [{mean - half:.3f}, "
                f"{mean + half:.3f}]; outside the spans {out_mean:+.3f} +- {out_half:.3f} ms a step"
            )


if __name__ == "__main__":
    main()
