"""bench/h200/hostahead_ab.py's summary: per-repeat ratios, verdicts and the
per-arm books (hand-checked)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

# A GPU helper script of the repository, not package code (the wheel leaves
# bench/h200/ out), so it is loaded from the source tree by path (it imports
# issue16.py beside it).
_DIR = Path(__file__).resolve().parents[2] / "bench" / "h200"
sys.path.insert(0, str(_DIR))
_spec = importlib.util.spec_from_file_location("_bench_h200_hostahead_ab", _DIR / "hostahead_ab.py")
assert _spec is not None and _spec.loader is not None
ab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ab)


def _row(arm: str, rep: int, tps: float, **kw: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "cache_fraction": 0.2,
        "concurrency": 4,
        "repeat": rep,
        "ab_arm": arm,
        "output_tokens_per_s": tps,
        "wall_s": 10.0,
        "link_busy_s": 7.0,
    }
    if arm != "PD":
        row["host_busy_s"] = 2.0
        row["host_service"] = {
            "planner": {"ahead": arm},
            "ahead_outcome": {"seen": 10, "routed": 7, "hosted": 5},
            "ahead_fraction": {"value": 0.75 if arm == "weighted" else 0.7},
        }
    row.update(kw)
    return row


def test_ratios_verdicts_and_books() -> None:
    rows = [
        _row("PD", 0, 100.0),
        _row("certain", 0, 130.0),
        _row("weighted", 0, 156.0),
        _row("PD", 1, 100.0),
        _row("certain", 1, 132.0),
        _row("weighted", 1, 158.4),
        _row("PD", 2, 101.0),
        _row("certain", 2, 131.0),
        _row("weighted", 2, 157.2),
    ]
    (p,) = ab.summarise(rows)
    assert p["pair_ratios_weighted_over_certain"] == pytest.approx([1.2, 1.2, 1.2])
    # certain/PD per repeat: 1.3, 1.32, 131 / 101 = 1.297
    assert p["pair_ratio_median_certain_over_PD"] == pytest.approx(1.3)
    assert p["verdict_weighted_vs_certain"] == "weighted faster"
    assert p["verdict_certain_vs_PD"] == "certain faster"
    w = p["by_arm"]["weighted"]
    assert w["ahead_outcome"] == {"seen": 30, "routed": 21, "hosted": 15}
    assert w["ahead_fraction_end"] == [0.75, 0.75, 0.75]
    assert w["host_ahead_recorded"] == ["weighted"]
    assert w["busy_fraction"]["link"] == pytest.approx(0.7)
    assert w["busy_fraction"]["host_cpu"] == pytest.approx(0.2)
    # PD has no host: its host share is absent, not 0
    assert p["by_arm"]["PD"]["busy_fraction"]["host_cpu"] is None
    lines = ab.table({"device": "x", "runs": 9, "runs_not_started_budget": 0, "points": [p]})
    assert any("weighted/certain: median 1.20 (weighted faster)" in line for line in lines)


def test_one_run_per_arm_has_no_verdict() -> None:
    (p,) = ab.summarise([_row("certain", 0, 130.0), _row("weighted", 0, 120.0)])
    assert p["verdict_weighted_vs_certain"] == "too few runs"
    assert p["pair_ratios_weighted_over_certain"] == pytest.approx([120 / 130])
    # no PD run: no ratio against it
    assert p["pair_ratios_weighted_over_PD"] == []
    assert p["pair_ratio_median_weighted_over_PD"] is None
