"""The scaling simulation over measured rows (pdflash.distributed.simulate,
``pdflash-bench scale``): labelled simulated, N = 1 reproduces the row, more
GPUs never slow a link-bound row down under NVLink, PCIe exchange bytes load
the link."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdflash.distributed.simulate import ScaleParams, bytes_at_fraction, simulate_row

ROWS = Path(__file__).resolve().parents[2] / "bench" / "results" / "h200-matrix"


def _row(**over: object) -> dict[str, object]:
    row: dict[str, object] = {
        "arch": "gpt-oss-20b",
        "baseline": "PD",
        "concurrency": 16,
        "block_size": 16,
        "layers": 8,
        "cache_fraction": 0.2,
        "wall_s": 2.7,
        "compute_busy_s": 1.3,
        "exposed_fetch_s": 1.3,
        "link_busy_s": 2.4,
        "h2d_bytes": 1.2e11,
        "committed_tokens": 512.0,
        "output_tokens_per_s": 512.0 / 2.7,
        "top_k": 4,
        "token_budget": 256,
        "num_requests": 16,
        "prompt_len": 32,
        "verify_forwards": 12,
    }
    row.update(over)
    return row


def test_one_gpu_reproduces_the_measured_row_and_is_labelled() -> None:
    sim = simulate_row(_row(), 1, ScaleParams())
    assert sim["simulated"] is True and "simulated" in sim["kind"]
    assert sim["simulated_tokens_per_s_low"] == pytest.approx(512.0 / 2.7)
    assert sim["simulated_tokens_per_s_high"] == pytest.approx(512.0 / 2.7)
    assert sim["simulated_all_to_all_s"] == 0.0


def test_more_gpus_speed_up_a_link_bound_row_within_bounds() -> None:
    params = ScaleParams(interconnect="nvlink")
    one, two, four = (simulate_row(_row(), n, params) for n in (1, 2, 4))
    assert two["simulated_link_busy_s_per_rank"] == pytest.approx(1.2)
    for sim in (two, four):
        assert sim["simulated_tokens_per_s_low"] <= sim["simulated_tokens_per_s_high"]
        assert sim["simulated_all_to_all_s"] > 0
    assert one["simulated_tokens_per_s_high"] < two["simulated_tokens_per_s_low"]
    # compute is not divided: the speedup is capped by wall / (compute + other)
    assert four["simulated_speedup_high"] <= 2.7 / 1.4 + 1e-9


def test_pcie_exchange_loads_the_link_and_slow_latency_costs() -> None:
    nv = simulate_row(_row(), 2, ScaleParams(interconnect="nvlink"))
    pc = simulate_row(_row(), 2, ScaleParams(interconnect="pcie"))
    assert pc["simulated_link_busy_s_per_rank"] > nv["simulated_link_busy_s_per_rank"]
    assert pc["simulated_tokens_per_s_low"] < nv["simulated_tokens_per_s_low"]
    slow = simulate_row(_row(), 2, ScaleParams(latency_s=1e-3))
    assert slow["simulated_all_to_all_s"] > nv["simulated_all_to_all_s"] * 10


def test_aggregate_cache_interpolates_measured_rows_or_says_why_not() -> None:
    rows = [_row(cache_fraction=0.2, h2d_bytes=100.0), _row(cache_fraction=0.5, h2d_bytes=40.0)]
    assert bytes_at_fraction(rows, rows[0], 0.4) == pytest.approx(60.0)
    assert bytes_at_fraction(rows, rows[0], 0.8) is None
    p = ScaleParams(bytes_model="aggregate_cache")
    sim = simulate_row(rows[0], 2, p, rows)
    assert sim["simulated_h2d_bytes_total"] == pytest.approx(60.0)
    assert "not_simulated" in simulate_row(rows[0], 4, p, rows)
    assert "not_simulated" in simulate_row(rows[0], 8, p, rows)  # aggregate >= 1


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="interconnect"):
        simulate_row(_row(), 2, ScaleParams(interconnect="carrier-pigeon"))
    with pytest.raises(ValueError, match="imbalance"):
        simulate_row(_row(), 2, ScaleParams(imbalance=0.5))
    with pytest.raises(ValueError, match="wall_s"):
        simulate_row(_row(wall_s=None), 2, ScaleParams())


@pytest.mark.skipif(not ROWS.is_dir(), reason="committed H200 rows not in this checkout")
def test_scale_cli_on_the_committed_h200_rows(tmp_path: Path) -> None:
    from pdflash.bench.cli import main

    out = tmp_path / "scale"
    rc = main(
        [
            "scale",
            str(ROWS / "rows-gpt-oss-20b.jsonl"),
            "--cache-fraction",
            "0.2",
            "--gpus",
            "1,2",
            "--out",
            str(out),
            "--json",
        ]
    )
    assert rc == 0
    rows = [json.loads(x) for x in Path(f"{out}.jsonl").read_text().splitlines()]
    assert rows and all(r["simulated"] is True for r in rows)
    assert Path(f"{out}.md").read_text().startswith("SIMULATED")
    for r in rows:
        if r["gpus"] == 1:
            assert r["simulated_tokens_per_s_low"] == pytest.approx(
                r["measured_output_tokens_per_s"], rel=1e-6
            )
