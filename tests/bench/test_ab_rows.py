"""bench/h200/ab_rows.py: what the A/B summaries (enginegraphs, width,
fullcache) walk their points and build each point's entry, medians and JSON
file with."""

from __future__ import annotations

import json
from pathlib import Path

from bench_fixtures import load_bench_script

ab_rows = load_bench_script("ab_rows.py")


def test_points_entries_medians_and_the_summary_file(tmp_path: Path) -> None:
    rows = [
        {"arch": "a", "cache_fraction": 0.2, "concurrency": 4, "arm": "PD", "x": 1},
        {"arch": "a", "cache_fraction": 0.2, "concurrency": 1, "arm": "PD", "x": 2},
        {"arch": "a", "cache_fraction": 0.2, "concurrency": 4, "arm": "B3", "x": 3},
        {"arch": "a", "cache_fraction": 0.2, "concurrency": 4, "arm": "PD", "x": 5},
    ]
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert ab_rows.load_rows(tmp_path) == rows
    assert ab_rows.load_rows(tmp_path / "absent") == []
    points = list(ab_rows.point_entries(rows))
    assert [p for p, _, _ in points] == [("a", 0.2, 1), ("a", 0.2, 4)]
    _, entry, by_arm = points[1]
    assert {arm: [r["x"] for r in rs] for arm, rs in by_arm.items()} == {
        "PD": [1, 5],
        "B3": [3],
    }
    assert entry == {"arch": "a", "cache_fraction": 0.2, "concurrency": 4, "arms": {}}
    # each point's entry is its own (a summary fills its arms)
    assert points[0][1]["arms"] is not entry["arms"]
    # the numbers only (None and strings left out); as they are, or as floats
    values = [3, None, 1, "x", 2]
    assert ab_rows.median(values) == 2 and isinstance(ab_rows.median(values), int)
    assert ab_rows.median(values, as_float=True) == 2.0
    assert isinstance(ab_rows.median(values, as_float=True), float)
    assert ab_rows.median([1, 2]) == 1.5
    assert ab_rows.median([None, "x"]) is None and ab_rows.median([]) is None
    ab_rows.write_summary(tmp_path, "demo", [{"arch": "a"}])
    assert json.loads((tmp_path / "demo_summary.json").read_text()) == {"points": [{"arch": "a"}]}
    assert (
        tmp_path / "demo_summary.json"
    ).read_text() == '{\n "points": [\n  {\n   "arch": "a"\n  }\n ]\n}'
