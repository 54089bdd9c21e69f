"""The bare default's scheduler lines say how often the 2-D batch differed
from the token-only one and how often the PD controller executed it and
route-ahead."""

from __future__ import annotations

from pdflash.bench.suites.default import scheduler_lines


def test_scheduler_line_reports_what_the_controller_executed() -> None:
    row = {
        "baseline": "PD",
        "concurrency": 4,
        "max_running": 8,
        "token_budget": 64,
        "block_size": 16,
        "byte_budget": 66611,
        "byte_budget_verify_compute_s": 0.0067,
        "token_only_differing_step_fraction": 0.78,
        "steps": 80,
        "batch_missing_bytes_2d": 2.0e6,
        "batch_missing_bytes_token_only": 2.5e6,
        "pd_parts": {
            "on_fraction": {"scheduler_2d": 0.25, "stream": 0.9, "route_ahead": 0.95},
            "decisions": [
                {"step": 14, "part": "scheduler_2d", "on": False, "switched": True, "why": "x"},
                {"step": 30, "part": "stream", "on": True, "switched": False, "why": "y"},
            ],
        },
    }
    (line,) = scheduler_lines([row, {**row, "baseline": "B2"}])
    assert "differed from the token-only one in 78% of 80 steps" in line
    assert "M hard" in line
    marginal = scheduler_lines([{**row, "fixed_step_bytes": 180000}])[0]
    assert "marginal rule, F = " in marginal and "M hard" not in marginal
    assert line.endswith(
        "the PD controller executed the 2-D batch in 25% of steps, route-ahead in 95% "
        "(switched: scheduler_2d off at step 14)"
    )
    no_route = {**row["pd_parts"], "on_fraction": {"scheduler_2d": 0.25}}
    assert scheduler_lines([{**row, "pd_parts": no_route}])[0].endswith(
        "in 25% of steps (switched: scheduler_2d off at step 14)"
    )
    del row["pd_parts"]
    assert "controller" not in scheduler_lines([row])[0]
