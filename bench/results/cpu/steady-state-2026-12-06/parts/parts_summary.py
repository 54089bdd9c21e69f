"""Settled PD and its variants against B1warm, pooled over the processes
here (``rest_summary.print_pairs``: tokens/s ratios and outside-span times).

    python3 parts_summary.py
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# the CPU rest study's pairing and outside-span time (one definition)
sys.path.insert(0, str(HERE.parents[1] / "rest-2026-12-06"))
rest_summary: Any = importlib.import_module("rest_summary")

ARMS = ("PDsettled", "PDsetFull", "PDsetFcfs", "PDsetB1cfg")


def main() -> None:
    rest_summary.print_pairs(sorted(HERE.glob("p[0-9]")), [(num, "B1warm") for num in ARMS])


if __name__ == "__main__":
    main()
