"""The default suite end to end with the real engine, on CPU, at --quick size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pdflash.bench import cli


def test_default_quick_real_engine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "results"
    code = cli.main(["default", "--quick", "--no-progress", "--device", "cpu", "--out", str(out)])
    printed = capsys.readouterr().out
    summary = json.loads(printed[printed.rindex("\n{") :])
    report = json.loads((out / "report.json").read_text())
    assert report["problems"] == [], report["problems"][:5]
    assert code == 0 and summary["failed"] == 0 and summary["runs"] == 10
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert sorted((r["baseline"], r["concurrency"]) for r in rows) == sorted(
        (b, c) for b in ("B0", "B1", "B2", "B3", "PD") for c in (1, 4)
    )
    for row in rows:
        # a workload where the scheduler decides: more live requests than a step takes
        assert row["max_running"] == 2 * row["concurrency"]
        assert row["max_running"] > row["token_budget"] // row["requested_block_size"]
        if row["baseline"] == "PD":
            # M from the step (link x measured verify compute), and the 2-D vs
            # token-only comparison measured
            assert row["byte_budget_from"] == "verify"
            assert row["byte_budget"] == pytest.approx(
                row["link_gbps_measured"] * 1e9 * row["byte_budget_verify_compute_s"], rel=0.01
            )
            assert row["token_only_differing_step_fraction"] is not None
        assert row["device"].startswith("cpu")
        assert row["weights_source"].startswith("synthetic")
        assert row["committed_tokens"] > 0
        # the matrix's Belady replay of the run's own routing trace
        assert row["belady_bytes"] is not None and row["routed_expert_bytes"] > 0
    assert summary["verdict"] in ("GO", "NO-GO")
    assert report["verdict"]["reasons"]
    for name in ("money_plot.png", "tokens_vs_concurrency.png", "report.md", "rows.csv"):
        assert (out / name).stat().st_size > 0
