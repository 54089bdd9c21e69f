"""Settled PD and its variants against B1warm, pooled over the three
processes here, at each concurrency: the tokens/s ratio (per-repeat ratios
of interleaved runs; mean with a normal 95% interval, and the median) and
the host time a step outside the forwards' spans beyond B1warm's (mean with
a normal 95% interval; ``rest_summary.pooled_pairs``).

    python3 parts_summary.py
"""

from __future__ import annotations

import importlib
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# the CPU rest study's pairing and outside-span time (one definition)
sys.path.insert(0, str(HERE.parents[1] / "rest-2026-12-06"))
rest_summary: Any = importlib.import_module("rest_summary")

ARMS = ("PDsettled", "PDsetFull", "PDsetFcfs", "PDsetB1cfg")


def main() -> None:
    folders = sorted(HERE.glob("p[0-9]"))
    for conc in (1, 4):
        for num in ARMS:
            ratios, outside = rest_summary.pooled_pairs(folders, num, "B1warm", conc)
            mean, half = rest_summary.interval(ratios)
            out_mean, out_half = rest_summary.interval(outside)
            print(
                f"c={conc} {num}/B1warm ({len(ratios)} pairs): median "
                f"{statistics.median(ratios):.3f}, mean {mean:.3f} [{mean - half:.3f}, "
                f"{mean + half:.3f}]; outside the spans {out_mean:+.3f} +- {out_half:.3f} ms a step"
            )


if __name__ == "__main__":
    main()
