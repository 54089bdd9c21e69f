"""PD / B1 pooled over the four processes of each tree (per-repeat ratios of
interleaved runs; mean with a normal 95% interval, and the median) and PD's
host time a step outside the forwards' spans beyond B1's (the mean over
pairs with a normal 95% interval; ``rest_summary.pooled_pairs``).

    python3 cuts_summary.py
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# the CPU rest study's pairing and outside-span time (one definition)
sys.path.insert(0, str(HERE.parent / "rest-2026-12-06"))
rest_summary: Any = importlib.import_module("rest_summary")


def main() -> None:
    for tree in ("new", "old"):
        folders = sorted(HERE.glob(f"{tree}[0-9]"))
        n, median, (mean, half), (out_mean, out_half) = rest_summary.pair_summary(
            folders, "PD", "B1"
        )
        print(
            f"{tree}: PD/B1 over {n} pairs: median {median:.3f}, "
            f"mean {mean:.3f} [{mean - half:.3f}, {mean + half:.3f}]; PD - B1 outside the "
            f"spans {out_mean:.3f} +- {out_half:.3f} ms a step"
        )


if __name__ == "__main__":
    main()
