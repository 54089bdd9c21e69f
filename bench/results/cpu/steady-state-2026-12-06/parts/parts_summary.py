"""Settled PD and its variants against B1warm, pooled over the three
processes here, at each concurrency: the tokens/s ratio (per-repeat ratios
of interleaved runs; mean with a normal 95% interval, and the median) and
the host time a step outside the forwards' spans beyond B1warm's (mean with
a normal 95% interval; ``rest_summary.outside_spans_ms``).

    python3 parts_summary.py
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
    "rest_summary", HERE.parents[1] / "rest-2026-12-06" / "rest_summary.py"
)
assert _spec is not None and _spec.loader is not None
rest_summary: Any = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rest_summary)

ARMS = ("PDsettled", "PDsetFull", "PDsetFcfs", "PDsetB1cfg")


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
        for num in ARMS:
            ratios, outside = [], []
            for (_, c, _), arms in runs.items():
                if c == conc and {num, "B1warm"} <= set(arms):
                    a, b = arms[num], arms["B1warm"]
                    ratios.append(a["output_tokens_per_s"] / b["output_tokens_per_s"])
                    outside.append(
                        rest_summary.outside_spans_ms(a) - rest_summary.outside_spans_ms(b)
                    )
            mean, half = _interval(ratios)
            out_mean, out_half = _interval(outside)
            print(
                f"c={conc} {num}/B1warm ({len(ratios)} pairs): median "
                f"{statistics.median(ratios):.3f}, mean {mean:.3f} [{mean - half:.3f}, "
                f"{mean + half:.3f}]; outside the spans {out_mean:+.3f} +- {out_half:.3f} ms a step"
            )


if __name__ == "__main__":
    main()
