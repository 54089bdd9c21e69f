"""The new rest and the old, settled and cold, pooled over the processes
here (``rest_summary.print_pairs``: tokens/s ratios and outside-span times).

    python3 rest_b1_summary.py
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

PAIRS = (
    ("PDsettled", "B1warm"),
    ("PDsetBusy", "B1warm"),
    ("PDsettled", "PDsetBusy"),
    ("PD", "B1"),
    ("PDbusyrest", "B1"),
    ("PD", "PDbusyrest"),
)


def main() -> None:
    rest_summary.print_pairs(sorted(HERE.glob("p[0-9]")), PAIRS)


if __name__ == "__main__":
    main()
