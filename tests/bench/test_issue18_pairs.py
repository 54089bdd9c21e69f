"""bench/h200/issue18_pairs.py: N-GPU over 1-GPU tokens/s, paired by point
and seed across issue18.sh's rounds, on rows the test writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from bench_fixtures import load_bench_script

issue18_pairs = load_bench_script("issue18_pairs.py")


def _row(seed: int, conc: int, tok_s: float, gpus: int | None, **extra: Any) -> dict[str, Any]:
    return {
        "arch": "gpt-oss-20b",
        "baseline": "PD",
        "cache_fraction": 0.2,
        "concurrency": conc,
        "seed": seed,
        "output_tokens_per_s": tok_s,
        "gpus": gpus,
        "wall_s": 2.0,
        **extra,
    }


def _write(out: Path, step: str, rows: list[dict[str, Any]]) -> None:
    (out / step).mkdir(parents=True, exist_ok=True)
    with open(out / step / "rows.jsonl", "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def test_pairs_by_point_and_seed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ones = [
        _row(1, 4, 100.0, None, exposed_fetch_s=1.2),
        _row(2, 4, 110.0, None, exposed_fetch_s=1.4),
        _row(3, 4, 90.0, None, exposed_fetch_s=1.0),  # no 2-GPU run with seed 3: unpaired
        _row(1, 16, 300.0, None, exposed_fetch_s=0.2),
    ]
    twos = [
        _row(1, 4, 190.0, 2, aggregate_link_gbps=100.0, all_to_all_share=0.1),
        _row(2, 4, 198.0, 2, aggregate_link_gbps=104.0, all_to_all_share=0.3),
        _row(1, 16, 330.0, 2, aggregate_link_gbps=90.0, all_to_all_share=0.2),
        _row(4, 16, 999.0, 2),  # no 1-GPU run with seed 4
    ]
    _write(tmp_path, "gpt_oss_20b_g1", ones)
    _write(tmp_path, "gpt_oss_20b_g2", twos)
    (tmp_path / "scale_gpt_oss_20b").mkdir()  # other step folders are ignored
    result = issue18_pairs.pairs(issue18_pairs.load(tmp_path))
    assert [(p["point"][3], p["gpus"], p["seeds"]) for p in result] == [
        (4, 2, [1, 2]),
        (16, 2, [1]),
    ]
    c4, c16 = result
    assert c4["ratios"] == pytest.approx([1.9, 1.8])
    assert c4["median"] == pytest.approx(1.85)
    assert c4["interval"] is not None and c4["interval"][0] < 1.85 < c4["interval"][1]
    assert c4["exposed_fetch_share_1gpu"] == pytest.approx(0.65)  # (0.6 + 0.7) / 2
    assert c4["aggregate_link_gbps"] == pytest.approx(102.0)
    assert c4["all_to_all_share"] == pytest.approx(0.2)
    assert c16["interval"] is None and c16["verdict"] is None  # one pair: no interval

    assert issue18_pairs.main([str(tmp_path), "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "c=4: g2/g1 median 1.850" in lines[0] and "faster" in lines[0]
    assert "one pair: no interval" in lines[1]
    assert json.loads(lines[-1])["pairs"][0]["seeds"] == [1, 2]


def test_slower_and_refusals(tmp_path: Path) -> None:
    _write(tmp_path, "a_g1", [_row(1, 4, 100.0, None), _row(2, 4, 100.0, None)])
    _write(tmp_path, "a_g2", [_row(1, 4, 60.0, 2), _row(2, 4, 62.0, 2)])
    (p,) = issue18_pairs.pairs(issue18_pairs.load(tmp_path))
    assert p["verdict"] == "slower"

    _write(tmp_path, "b_g2", [_row(1, 4, 60.0, 4)])  # the row contradicts its folder
    with pytest.raises(ValueError, match="gpus=4"):
        issue18_pairs.load(tmp_path)


def test_no_pairs_is_an_error(tmp_path: Path) -> None:
    _write(tmp_path, "a_g2", [_row(1, 4, 60.0, 2)])  # no 1-GPU rows
    assert issue18_pairs.main([str(tmp_path)]) == 1
    assert issue18_pairs.main([str(tmp_path / "missing")]) == 2


def test_baselines_pair_apart(tmp_path: Path) -> None:
    # BASELINES=PD,PD+host: each label's N-GPU rows pair with its own 1-GPU rows
    _write(
        tmp_path,
        "a_g1",
        [_row(1, 4, 100.0, None), _row(1, 4, 150.0, None, baseline="PD+host")],
    )
    _write(
        tmp_path,
        "a_g2",
        [_row(1, 4, 180.0, 2), _row(1, 4, 210.0, 2, baseline="PD+host")],
    )
    result = issue18_pairs.pairs(issue18_pairs.load(tmp_path))
    assert {p["point"][1]: p["ratios"] for p in result} == {
        "PD": pytest.approx([1.8]),
        "PD+host": pytest.approx([1.4]),
    }
