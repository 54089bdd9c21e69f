"""Pooled over the three processes here, at each concurrency: the pairs'
ratios of tokens/s (per-repeat ratios of interleaved runs; mean with a
normal 95% interval, and the median) and the numerator's host time a step
outside the forwards' spans beyond the denominator's (mean with a normal
95% interval; ``rest_summary.pooled_pairs``).

    python3 rest_b1_summary.py
"""

from __future__ import annotations

import importlib
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# the CPU rest study's pairing and outside-span time (one definition)
sys.path.insert(0, str(HERE.parent / "rest-2026-12-06"))
rest_summary: Any = importlib.import_module("rest_summary")

PAIRS = (
    ("PDsettled", "B1warm"),
    ("PDsetBusy", "B1warm"),
    ("PDsettled", "PDsetBusy"),
    ("PD", "B1"),
    ("PDbusyrest", "B1"),
    ("PD", "PDbusyrest"),
)


def main() -> None:
    folders = sorted(HERE.glob("p[0-9]"))
    for conc in (1, 4):
        for num, den in PAIRS:
            ratios, outside = rest_summary.pooled_pairs(folders, num, den, conc)
            mean, half = rest_summary.interval(ratios)
            out_mean, out_half = rest_summary.interval(outside)
            print(
                f"c={conc} {num}/{den} ({len(ratios)} pairs): median "
                f"{statistics.median(ratios):.3f}, mean {mean:.3f} [{mean - half:.3f}, "
                f"{mean + half:.3f}]; outside the spans {out_mean:+.3f} +- {out_half:.3f} ms a step"
            )


if __name__ == "__main__":
    main()
