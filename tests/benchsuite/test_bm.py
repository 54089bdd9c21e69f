"""BM suite: dispatch, absent-with-reason on CPU, the overlap arithmetic."""

from __future__ import annotations

import json

import pytest
from pdflash.bench import cli
from pdflash.bench.suites import bm


def test_interval_overlap_hand_computed() -> None:
    copies = [(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)]  # union [0, 2] + [3, 4]
    compute = [(1.5, 3.5)]
    # both busy: [1.5, 2.0] and [3.0, 3.5]
    assert bm.interval_overlap(copies, compute) == pytest.approx(1.0)
    assert bm.interval_overlap(compute, copies) == pytest.approx(1.0)
    assert bm.interval_overlap([(0.0, 1.0)], [(1.0, 2.0)]) == 0.0
    assert bm.interval_overlap([], compute) == 0.0


def test_bm_needs_a_routine(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["bm"])
    assert exc.value.code == 2
    assert "--routine" in capsys.readouterr().err


def test_bm4_on_cpu_is_absent_with_reason(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bm4", "--device", "cpu", "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["routine"] == "bm4" and result["measured"] is False
    assert "CUDA" in result["reason"]
    assert not any(k.endswith("_s") or k.endswith("fraction") for k in result)
    assert captured.err.strip() == "BM4: NOT MEASURED — " + result["reason"]


def test_routine_option_and_subcommand_agree(capsys: pytest.CaptureFixture[str]) -> None:
    cli.main(["bm", "--routine", "bm4", "--device", "cpu", "--json"])
    a = json.loads(capsys.readouterr().out)
    cli.main(["bm4", "--device", "cpu", "--json"])
    b = json.loads(capsys.readouterr().out)
    assert a == b
