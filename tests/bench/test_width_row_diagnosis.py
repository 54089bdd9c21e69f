"""bench/width_row_diagnosis.py: the adaptive-vs-fixed:1 pairs and the
step cost of a further verified draft, on hand-made rows and on the
committed H200 closed-loop rows the session-22 README quotes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pdflash.bench import width_row_diagnosis as diag

from pdflash.report.writers import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
SESSION22 = ROOT / "bench" / "results" / "h200" / "session22-2026-12-04"


def _row(baseline: str, width: str, drafts: float, ms_per_step: float, steps: int = 100) -> Any:
    return {
        "baseline": baseline,
        "steps": steps,
        "wall_s": ms_per_step * steps / 1e3,
        "output_tokens_per_s": 30.0,
        "verify_width": {"setting": width, "mean_verified_drafts": drafts},
    }


def test_the_step_cost_of_a_draft_is_the_slope_across_widths() -> None:
    rows = [
        _row("B1", "fixed:1", 1.0, 46.0),
        _row("B1", "adaptive", 2.0, 52.0),
        _row("B1", "adaptive", 3.0, 58.0),
        _row("PD", "fixed:1", 1.0, 40.0),  # one width: no slope
        _row("PD", "fixed:1", 1.0, 41.0),
        _row("PD", "fixed:1", 1.0, 42.0),
        {"baseline": "B3", "steps": 10, "wall_s": 1.0, "verify_width": None},
    ]
    (line,) = diag.step_cost_per_draft(rows)
    assert line["baseline"] == "B1" and line["runs"] == 3
    assert line["slope_ms_per_draft"] == pytest.approx(6.0)
    assert line["intercept_ms_per_step"] == pytest.approx(40.0)
    assert line["drafts_a_round"] == [1.0, 3.0]


@pytest.mark.parametrize(
    ("folder", "expect"),
    [("call3-width_c1", {"B1": 5.78, "PD": 6.3}), ("call4-width_c4", {"B1": 5.9, "PD": 11.27})],
)
def test_the_committed_closed_loops_give_the_quoted_step_costs(
    folder: str, expect: dict[str, float]
) -> None:
    rows = read_jsonl(SESSION22 / folder / "trace" / "rows.jsonl.gz")
    got = {d["baseline"]: d["slope_ms_per_draft"] for d in diag.step_cost_per_draft(rows)}
    assert got == pytest.approx(expect, abs=0.01)
    # every label ran four widths, three repeats each
    assert {d["runs"] for d in diag.step_cost_per_draft(rows)} == {12}


def test_pairs_report_the_rows_own_tokens_per_second() -> None:
    rows = read_jsonl(SESSION22 / "call3-width_c1" / "trace" / "rows.jsonl.gz")
    got = diag.pairs(rows)
    assert len(got) == 6  # B1 and PD, three repeats each
    for d in got:
        a, f = d["tok_s"]
        assert 15.0 < a < 60.0 and 15.0 < f < 60.0
