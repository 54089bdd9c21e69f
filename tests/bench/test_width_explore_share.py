"""bench/h200/width_explore_share.py: the exploration decisions' share of the
verified drafts and of the modeled link time, from a row's histogram."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
from bench_fixtures import load_bench_script


def _module() -> ModuleType:
    return load_bench_script("width_explore_share.py")


def _row(hist: list[int], explored: int, policy: str = "adaptive") -> dict[str, Any]:
    return {
        "arch": "qwen3-30b-a3b",
        "concurrency": 4,
        "baseline": "PD",
        "layers": 2,
        "top_k": 2,
        "expert_nbytes": 1000,
        "wall_s": 2.0,
        "committed_tokens": 100.0,
        "verify_width": {
            "policy": policy,
            "decisions": sum(hist),
            "width_histogram": hist,
            "exploration_decisions": explored,
            "estimates": {
                "miss_rate": 1.0,
                "link_bytes_per_s": 1e6,  # 1 ms per expert
                "union_novelty": 1.0,  # every row adds S - top_k experts
                "union_saturation": 4.0,
                "link_exposed_share": 0.5,
                "survival_global": [0.5, 0.25, 0.125],
            },
        },
    }


def test_the_widest_decisions_bound_the_exploration_share() -> None:
    mod = _module()
    # widths 1, 1, 1, 5: one exploring decision at most 5 of 8 drafts
    got = mod.analyze_row(_row([0, 3, 0, 0, 0, 1], 1))
    assert got["explored_widths"] == [5] and got["other_median_width"] == 1
    assert got["explore_draft_share"] == pytest.approx(5 / 8)
    # novelty 1: the first drafted row adds 2 experts a layer, later ones none
    assert got["explore_link_share"] == pytest.approx(1 / 4)
    # S(2..5) with the last continuation (0.5) inherited past the recorded 3
    bought = 0.25 + 0.125 + 0.0625 + 0.03125
    assert got["tokens_bought"] == pytest.approx(bought)
    assert got["s_per_token_bought"] == 0.0  # rows past the first add no copies
    assert got["s_per_token_run"] == pytest.approx(0.02)
    assert mod.analyze_row(_row([0, 4], 0, policy="fixed:1")) is None


def test_the_summary_takes_medians_over_repeats() -> None:
    mod = _module()
    rows = [_row([0, 3, 0, 0, 0, 1], 1), _row([0, 7, 0, 0, 0, 1], 1), _row([0, 3, 0, 0, 0, 1], 1)]
    (entry,) = mod.summarize(rows)
    assert entry["repeats"] == 3
    assert entry["explore_draft_share"] == pytest.approx(5 / 8)
    assert entry["mean_width"] == pytest.approx(2.0)
