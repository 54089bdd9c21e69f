"""``pdflash-bench moe`` on the CPU (tiny synthetic model, host issuer)."""

from __future__ import annotations

import json

import pytest
from pdflash.bench.cli import main


def test_bench_moe_cpu_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "moe",
            "--json",
            "--arch",
            "gpt_oss",
            "--device",
            "cpu",
            "--cache-fraction",
            "0.5,1.0",
            "--tokens",
            "3",
            "--repeats",
            "2",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    small, full = out["runs"]
    for row in (small, full):
        assert (
            row["weights"] == "synthetic" and row["preset"] == "tiny" and row["arch"] == "gpt_oss"
        )
        assert row["issuer_backend"] == "host" and row["device"] == "cpu"
        assert len(row["per_layer"]) == row["layers"] == 2
        assert all(p["resident_ms"] > 0 and p["offloaded_ms"] > 0 for p in row["per_layer"])
        assert row["max_abs_err"] <= 1e-4 * max(1.0, row["max_abs_logit_resident"])
        assert row["link_gbps"] is None and "link_gbps" in row["not_measured"]
        assert row["bytes_moved"] == row["copies"] * row["expert_nbytes"]
    assert small["cache_slots"] == 8 and full["cache_slots"] == 16
    assert small["misses"] > 0 and small["evictions"] > 0
    # everything fits at fraction 1.0 and the warm-up forward is not counted, so
    # only experts never routed before the measured repeats are copied
    assert full["evictions"] == 0 and full["hit_rate"] > small["hit_rate"]
