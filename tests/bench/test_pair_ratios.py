"""bench/pair_ratios.py: per-repeat ratios between two configurations, on
hand-made rows and on the committed H200 rows the session-23 README quotes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pdflash.bench import pair_ratios as pr

ROOT = Path(__file__).resolve().parents[2]
SESSION23 = ROOT / "bench" / "results" / "h200" / "session23-2026-12-04"


def _row(config: dict[str, Any], repeat: int, tok_s: float, concurrency: int = 1) -> Any:
    return {
        "arch": "tiny",
        "cache_fraction": 0.2,
        "concurrency": concurrency,
        "repeat": repeat,
        "output_tokens_per_s": tok_s,
        **config,
    }


def test_ratios_pair_repeats_and_keep_points_apart() -> None:
    a, b = {"arm": "a", "baseline": "PD"}, {"arm": "b", "baseline": "PD"}
    rows = [
        _row(a, 0, 20.0),
        _row(b, 0, 10.0),
        _row(a, 1, 30.0),
        _row(b, 1, 20.0),
        _row(a, 2, 99.0),  # no partner in repeat 2: left out
        _row(a, 0, 8.0, concurrency=4),
        _row(b, 0, 10.0, concurrency=4),
    ]
    c1, c4 = pr.pair_ratios(rows, "a", "b")
    assert c1["point"] == ("tiny", 0.2, 1) and c1["repeats"] == [0, 1]
    assert c1["ratios"] == [2.0, 1.5] and c1["median"] == 1.75
    low, high = c1["interval"]
    assert low < 1.5 < 2.0 < high
    # one pair has no interval
    assert c4["ratios"] == [0.8] and c4["interval"] is None


def test_a_matrix_row_is_its_baseline_at_its_width() -> None:
    row = _row({"baseline": "PD", "verify_width": {"setting": "adaptive:beta=one"}}, 0, 1.0)
    assert pr.config_of(row) == "PD[adaptive:beta=one]"
    assert pr.config_of(_row({"baseline": "B3", "verify_width": None}, 0, 1.0)) == "B3"


def test_an_unknown_configuration_is_named_and_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps(_row({"arm": "a", "baseline": "PD"}, 0, 1.0)) + "\n")
    assert pr.main([str(rows), "a/zzz"]) == 1
    assert "no rows for zzz" in capsys.readouterr().out
    assert pr.main([str(rows)]) == 2


def test_the_committed_session23_pairs_read_as_its_readme_says() -> None:
    from pdflash.report.writers import read_jsonl

    c1 = read_jsonl(SESSION23 / "call1-graphs_c1w" / "engine" / "rows.jsonl.gz")
    (best,) = pr.pair_ratios(c1, "hostonpw", "PDpw")
    assert round(best["median"], 2) == 1.42 and len(best["ratios"]) == 10
    assert [round(x, 2) for x in best["interval"]] == [1.32, 1.52]
    (pieces,) = pr.pair_ratios(c1, "PDpw", "PDw")
    assert round(pieces["median"], 2) == 1.11 and pieces["interval"][0] > 1.0
    assert best["captured_repeats"] == []
    # at c=4 the pre-capture stopped short: the pairs whose clocks held captures are named
    c4 = read_jsonl(SESSION23 / "call4-pw_c4" / "engine" / "rows.jsonl.gz")
    (four,) = pr.pair_ratios(c4, "hostonpw", "PDpw")
    clean = [
        r
        for k, r in zip(four["repeats"], four["ratios"], strict=True)
        if k not in four["captured_repeats"]
    ]
    assert four["captured_repeats"] == [1, 2, 3, 5] and [round(r, 2) for r in clean] == [1.34, 1.36]
    width = read_jsonl(SESSION23 / "call3-width_c1" / "trace" / "rows.jsonl.gz")
    (preset,) = pr.pair_ratios(width, "PD[adaptive]", "B1[adaptive:row=wall]")
    assert [round(x, 2) for x in preset["ratios"]] == [0.85, 0.87, 0.87]
    (one,) = pr.pair_ratios(width, "PD[adaptive:beta=one]", "PD[adaptive]")
    assert one["interval"][0] > 1.0


def test_pooled_files_keep_pairs_within_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    a, b = {"arm": "a", "baseline": "PD"}, {"arm": "b", "baseline": "PD"}
    first = [_row(a, 0, 20.0), _row(b, 0, 10.0), _row(a, 1, 30.0), _row(b, 1, 20.0)]
    # the second call's repeat 0 must not pair with the first call's repeat 0
    second = [_row(a, 0, 12.0), _row(b, 0, 10.0), _row(b, 1, 99.0)]
    rows = pr.pooled([first, second])
    assert [r["repeat"] for r in rows] == [0, 0, 1, 1, 2, 2, 3]
    assert first[0]["repeat"] == 0 and second[0]["repeat"] == 0  # copies, not edits
    (c1,) = pr.pair_ratios(rows, "a", "b")
    assert c1["repeats"] == [0, 1, 2] and c1["ratios"] == [2.0, 1.5, 1.2]
    paths = []
    for i, part in enumerate((first, second)):
        path = tmp_path / f"rows{i}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
        paths.append(str(path))
    assert pr.main([*paths, "a/b"]) == 0
    out = capsys.readouterr().out
    assert "a/b median 1.500" in out and "pairs (2.00, 1.50, 1.20)" in out


def test_a_ratio_interval_is_judged_against_1() -> None:
    assert pr.ratio_verdict(1.02, 1.3) == "faster"
    assert pr.ratio_verdict(0.7, 0.97) == "slower"
    assert pr.ratio_verdict(0.9, 1.1) == pr.ratio_verdict(1.0, 1.2) == "within noise"
