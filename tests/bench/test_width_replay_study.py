"""bench/width_replay_study.py: the replayed closed loop on a committed
proxy trace, its fixed widths' books and the adaptive settings' reports."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pdflash.bench import width_replay_study as study

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "bench" / "results" / "h200" / "proxy-balanced-2026-12-01" / "trace_gpu_greedy.npz"


@pytest.fixture(scope="module")
def rounds() -> list[list[tuple[int, np.ndarray]]]:
    from pdflash.traces import load_trace

    return study.request_rounds(load_trace(TRACE))


def _loop(setting: str, rounds: list[list[tuple[int, np.ndarray]]], **kw: object) -> dict:
    args = dict(
        block=16,
        layers=8,
        num_experts=128,
        top_k=8,
        tokens=32,
        t_fixed=0.038,
        link_s_per_expert=1.23e-4,
        exposed=0.58,
        miss=0.53,
        expert_bytes=13_236_736,
    )
    args.update(kw)
    return study.run_loop(setting, rounds, [0, 1, 2, 3], **args)


def test_the_rounds_are_the_traces_whole_blocks(rounds: list) -> None:
    assert len(rounds) == 12 and all(rounds)
    a, unions = rounds[0][0]
    assert 0 <= a <= 15 and unions.shape == (16,)
    # one row routes top-8 on each of 8 layers; the union only grows
    assert unions[0] == 8 * 8 and np.all(np.diff(unions) >= 0) and unions[-1] <= 8 * 128


def test_fixed_widths_commit_what_the_trace_accepted(rounds: list) -> None:
    one, full = _loop("fixed:1", rounds), _loop("full", rounds)
    assert one["verified_per_round"] <= 1.0 and full["verified_per_round"] > 5.0
    assert one["accepted_per_round"] < full["accepted_per_round"]
    # a wider verify never takes more rounds for the same tokens
    assert full["steps"] <= one["steps"]
    assert "acceptance_calibration" not in one


def test_adaptive_settings_report_their_calibration(rounds: list) -> None:
    plain, cal = _loop("adaptive", rounds), _loop("adaptive:cal=1", rounds)
    for r in (plain, cal):
        assert 0.1 <= r["acceptance_calibration"] <= 1.0 and r["tokens_per_s"] > 0
    # the calibration narrows (or keeps) the widths, never widens them on average
    assert cal["verified_per_round"] <= plain["verified_per_round"] + 1e-9


def test_free_copies_make_every_draft_worth_verifying(rounds: list) -> None:
    """With copies short and none of them waited for, a step costs t_fixed
    whatever its rows, so the adaptive width verifies (nearly) every draft,
    as full does."""
    free = _loop("adaptive", rounds, exposed=0.0, link_s_per_expert=1e-7)
    full = _loop("full", rounds, exposed=0.0, link_s_per_expert=1e-7)
    assert free["verified_per_round"] >= 0.9 * full["verified_per_round"]
    assert free["tokens_per_s"] == pytest.approx(full["tokens_per_s"], rel=0.05)


def test_the_marginal_share_and_row_compute_charge_only_the_drafts_past_the_first(
    rounds: list,
) -> None:
    """``marginal_exposed`` applies to the experts the drafts past the first
    add: a width of one draft costs the same whatever it is, a wider one
    more; ``row_compute_s`` adds compute per verified draft."""
    plain = _loop("fixed:1", rounds, exposed=0.5)
    assert _loop("fixed:1", rounds, exposed=0.5, marginal_exposed=1.0) == plain
    wide, wide_marginal = (
        _loop("fixed:3", rounds, exposed=0.5),
        _loop("fixed:3", rounds, exposed=0.5, marginal_exposed=1.0),
    )
    assert wide_marginal["steps"] == wide["steps"]
    assert wide_marginal["tokens_per_s"] < wide["tokens_per_s"]
    slower = _loop("fixed:1", rounds, exposed=0.5, row_compute_s=0.01)
    assert slower["steps"] == plain["steps"] and slower["tokens_per_s"] < plain["tokens_per_s"]
    # the charged costs reach the policy (charging the steps' average exposed
    # share: the default would charge the half-exposed copies in full either
    # way): it verifies fewer drafts
    cheap = _loop("adaptive:beta=average", rounds, exposed=0.5)
    dear = _loop(
        "adaptive:beta=average", rounds, exposed=0.5, marginal_exposed=1.0, row_compute_s=0.01
    )
    assert dear["verified_per_round"] < cheap["verified_per_round"]
