"""bench/firstuse_summary.py: each point's first repeat against its later
median, and the excess seconds per new SDPA shape, on hand-made rows and on
the committed session-24 forced-width rows its README quotes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pdflash.bench import firstuse_summary as fu

from pdflash.report.writers import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
FORCED_WIDTH = ROOT / "bench/results/h200/session24-2026-12-04/call2-forced_width/rows.jsonl.gz"


def _row(width: str, repeat: int, ms: float, forwards: int, new: int | None) -> dict[str, Any]:
    row: dict[str, Any] = {
        "arch": "tiny",
        "baseline": "PD",
        "concurrency": 1,
        "cache_fraction": 0.2,
        "verify_width": {"setting": width},
        "repeat": repeat,
        "verify_s": ms * forwards / 1000.0,
        "verify_forwards": forwards,
        "sdpa_backends": "auto",
    }
    if new is not None:
        row["sdpa_shapes"] = {"new_in_run": new, "process_total": 99}
    return row


def test_excess_follows_new_shapes_exactly_when_each_costs_the_same() -> None:
    # 30 ms of excess per new shape at both points: slope 0.03 s, correlation 1
    rows = [
        _row("adaptive", 0, 100.0, 10, 10),
        _row("adaptive", 1, 70.0, 10, 0),
        _row("adaptive", 2, 70.0, 10, 0),
        _row("fixed:1", 0, 85.0, 10, 5),
        _row("fixed:1", 1, 70.0, 10, 0),
        _row("fixed:1", 2, 70.0, 10, 0),
    ]
    s = fu.summary(rows)
    assert s["sdpa_backends"] == ["auto"] and s["runs"] == 6
    assert s["excess_s_per_new_shape"] == pytest.approx(0.03)
    assert s["correlation"] == pytest.approx(1.0)
    first = {p["point"][-1]: p for p in s["points"]}
    assert first["adaptive"]["first_ratio"] == pytest.approx(100 / 70)
    assert first["adaptive"]["first_excess_s"] == pytest.approx(0.3)
    assert first["fixed:1"]["first_new_shapes"] == 5
    assert first["fixed:1"]["later_new_shapes_median"] == 0


def test_rows_without_a_shape_count_or_a_later_repeat_are_left_out() -> None:
    rows = [
        _row("adaptive", 0, 90.0, 10, None),  # predates the count
        _row("adaptive", 1, 70.0, 10, None),
        _row("fixed:1", 0, 60.0, 10, 3),  # one repeat: no reference
    ]
    s = fu.summary(rows)
    assert s["runs"] == 2 and s["counted_runs"] == 0
    assert s["excess_s_per_new_shape"] is None and s["correlation"] is None
    assert [p["point"][-1] for p in s["points"]] == ["adaptive"]


def test_runs_under_different_backends_are_summarised_apart(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Runs that set sdpa_backends per run (one process, interleaved): one
    summary per setting; summary() refuses the mix, whose slope would pool
    two backends' setup costs."""
    auto = [_row("adaptive", i, ms, 10, n) for i, (ms, n) in enumerate([(100, 10), (70, 0)])]
    math_only = [
        {**_row("adaptive", i, ms, 10, n), "sdpa_backends": "math"}
        for i, (ms, n) in enumerate([(75, 10), (70, 0)])
    ]
    with pytest.raises(ValueError, match="2 SDPA backends settings"):
        fu.summary(auto + math_only)
    split = fu.by_backends(math_only + auto)
    assert [s["sdpa_backends"] for s in split] == [["auto"], ["math"]]
    assert [s["points"][0]["first_ratio"] for s in split] == pytest.approx([100 / 70, 75 / 70])
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in auto + math_only))
    assert fu.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "sdpa_backends ['auto'], 2 runs" in out and "sdpa_backends ['math'], 2 runs" in out


def test_committed_forced_width_rows_match_the_matrix_first_use_and_the_readme() -> None:
    s = fu.summary(read_jsonl(FORCED_WIDTH))
    assert s["runs"] == 17 and s["counted_runs"] == 17
    # the matrix's own first_use printed a max ratio of 1.4304 for these rows
    assert max(p["first_ratio"] for p in s["points"]) == pytest.approx(1.4304, abs=1e-4)
    assert 0.015 < s["excess_s_per_new_shape"] < 0.030
    assert s["correlation"] == pytest.approx(0.61, abs=0.02)


def test_main_prints_each_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert fu.main([str(FORCED_WIDTH)]) == 0
    out = capsys.readouterr().out
    assert "excess per new shape" in out and "first repeat 1.43x" in out
