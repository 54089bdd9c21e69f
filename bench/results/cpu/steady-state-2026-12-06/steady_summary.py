"""Cold and steady-state PD and B1, pooled over the processes here
(``rest_summary.print_pairs``: tokens/s ratios and outside-span times).

    python3 steady_summary.py
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

PAIRS = (("PD", "B1"), ("PDsettled", "B1warm"), ("PDsettled", "PD"), ("B1warm", "B1"))


def main() -> None:
    rest_summary.print_pairs(sorted(HERE.glob("p[0-9]")), PAIRS)


if __name__ == "__main__":
    main()
