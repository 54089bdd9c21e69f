"""bench/h200/issue16.py's summary: intervals and verdicts (hand-checked)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

# A GPU helper script of the repository, not package code (the wheel leaves
# bench/h200/ out), so it is loaded from the source tree by path.
_SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "h200" / "issue16.py"
_spec = importlib.util.spec_from_file_location("_bench_h200_issue16", _SCRIPT)
assert _spec is not None and _spec.loader is not None
issue16 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(issue16)


def test_interval_hand_checked() -> None:
    out = issue16.interval([1.0, 2.0, 3.0])
    assert (out["n"], out["median"], out["min"], out["max"]) == (3, 2.0, 1.0, 3.0)
    # mean 2, s = 1, t(0.975, 2) = 4.303: 2 -/+ 4.303 / sqrt(3)
    lo, hi = out["mean_ci95"]
    assert lo == pytest.approx(2 - 4.303 / 3**0.5) and hi == pytest.approx(2 + 4.303 / 3**0.5)
    assert "mean_ci95" not in issue16.interval([5.0])
    assert issue16.interval([]) == {"n": 0}


def _row(baseline: str, tps: float, **kw: Any) -> dict[str, Any]:
    row = {
        "arch": "a",
        "cache_fraction": 0.2,
        "concurrency": 1,
        "baseline": baseline,
        "output_tokens_per_s": tps,
        "expert_nbytes": 100,
        "bytes_per_token": 1000.0 if baseline == "PD" else 600.0,
        "wall_s": 10.0,
        "compute_busy_s": 2.0,
        "link_busy_s": 9.0,
    }
    row.update(kw)
    return row


def test_summary_verdicts_and_the_binding_resource() -> None:
    rows = [_row("PD", t) for t in (10.0, 11.0, 12.0)]
    host = dict(host_served_experts=30.0, h2d_bytes=7000.0, host_busy_s=9.5)
    rows += [_row("PD+host", t, **host) for t in (20.0, 21.0, 22.0)]
    (point,) = issue16.summarise(rows)
    assert point["speedup_median"] == pytest.approx(21 / 11)
    assert point["verdict"] == "PD+host faster"
    assert point["bytes_per_token_ratio"] == pytest.approx(0.6)
    ph = point["pd_host"]
    assert ph["host_share_of_misses"] == pytest.approx(30 / (30 + 70))
    assert ph["binding_resource"] == "host_cpu" and ph["cpu_is_bottleneck"]
    # overlapping intervals: within noise
    rows = [_row("PD", t) for t in (10.0, 15.0, 20.0)] + [
        _row("PD+host", t, **host) for t in (12.0, 16.0, 21.0)
    ]
    assert issue16.summarise(rows)[0]["verdict"] == "within noise"


def test_one_run_on_a_side_gives_no_verdict() -> None:
    """A single run has no interval: its ratio is reported, not judged (a
    one-run point once read "PD+host slower" from two bare values)."""
    rows = [_row("PD", 35.0), _row("PD+host", 30.0, host_served_experts=3.0, h2d_bytes=700.0)]
    (point,) = issue16.summarise(rows)
    assert point["speedup_median"] == pytest.approx(30 / 35)
    assert point["verdict"] == "too few runs"
    rows += [_row("PD", 35.2), _row("PD+host", 30.2, host_served_experts=3.0, h2d_bytes=700.0)]
    assert issue16.summarise(rows)[0]["verdict"] == "PD+host slower"
