"""`pdflash-bench sched` runs end to end on a tiny shape (speed targets are
measured by the benchmark itself, never asserted here)."""

from __future__ import annotations

import json

import pytest
from pdflash.bench import cli

pytestmark = pytest.mark.native


def test_sched_suite_prints_one_json_object(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["sched", "--json", "--requests", "8,12", "--layers", "4", "--experts", "16"]
    argv += ["--steps", "6", "--ref-steps", "3", "--warmup", "2", "--expert-bytes", "1000000"]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("requests", "layers", "experts", "native_us_per_step", "reference_us_per_step"):
        assert key in out
    assert out["requests"] == 8 and out["layers"] == 4 and out["experts"] == 16
    assert out["speedup"] == pytest.approx(
        out["reference_us_per_step"] / out["native_us_per_step"], rel=0.05
    )
    assert [row["requests"] for row in out["sweep"]] == [8, 12]
    assert all(row["native_equals_reference"] for row in out["sweep"])
    assert out["workload"] == "synthetic"
