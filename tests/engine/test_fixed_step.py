"""The marginal rule's F from the engine's online step-time fit
(pdflash.engine.fixed_step): F follows a usable fit, a degenerate fit keeps
the F in force, the adaptive width's fit is the one its widths use (floored
there, not here), and an engine run applies the fit it ends with."""

from __future__ import annotations

import math
from typing import Any

import pytest

from pdflash.engine.batching import DeficitBatcher
from pdflash.engine.config import EngineConfig
from pdflash.engine.engine import Engine, RequestState
from pdflash.engine.fixed_step import (
    FixedStepFeed,
    StepTimeFit,
    StepTimeFitSource,
    follow_step_time_fit,
)
from pdflash.engine.verify_width import AdaptiveWidth, WidthOutcome, WidthStep

from .conftest import make_batcher_and_predictor

LINK = 1e9  # bytes/s
CALIBRATED = 40_000_000  # the calibration's F (40 ms of link)


class FakeFit:
    def __init__(self) -> None:
        self.fit: StepTimeFit | None = None

    def step_time_fit(self) -> StepTimeFit | None:
        return self.fit


def _batcher(fixed: int | None = CALIBRATED) -> DeficitBatcher:
    b = DeficitBatcher(
        token_budget=32, byte_budget=10**6, num_layers=2, num_experts=8, expert_nbytes=1000
    )
    b.set_byte_budget(10**6, fixed)
    return b


def _fit(t_fixed: float, steps: int = 10, vary: bool = True, mean: float = 0.1) -> StepTimeFit:
    return StepTimeFit(t_fixed, 0.001, steps, vary, mean)


def test_f_follows_a_fake_fit() -> None:
    src, b = FakeFit(), _batcher()
    feed = FixedStepFeed(src, b, LINK, min_steps=8)
    assert isinstance(src, StepTimeFitSource)
    assert feed.fields()["fixed_step_bytes_source"] == "calibration"
    src.fit = _fit(0.012)
    assert feed.after_step() == 12_000_000
    assert b.fixed_step_bytes == b.scheduler.fixed_step_bytes == 12_000_000
    src.fit = _fit(0.02)
    feed.after_step()
    assert b.fixed_step_bytes == 20_000_000
    # bounded by the bytes the link moves in the mean step
    src.fit = _fit(0.5, mean=0.1)
    assert feed.after_step() == 100_000_000
    f = feed.fields()
    assert f["fixed_step_bytes_source"] == "online_fit"
    assert f["fixed_step_bytes_final"] == 100_000_000
    book = f["fixed_step_fit"]
    assert book["calibration_bytes"] == CALIBRATED
    assert book["fitted_steps"] == 3 and book["updates"] == 3 and book["t_fixed_s"] == 0.5
    src.fit = _fit(0.5, mean=0.1)  # the same fit again: applied, F unchanged
    feed.after_step()
    assert feed.fitted_steps == 4 and feed.updates == 3


@pytest.mark.parametrize(
    ("fit", "reason"),
    [
        (None, "too few measured steps"),
        (_fit(0.01, steps=7), "too few measured steps"),
        (_fit(0.01, vary=False), "one row count (intercept not identified)"),
        (_fit(-0.003), "intercept <= 0 or not finite"),
        (_fit(0.0), "intercept <= 0 or not finite"),
        (_fit(math.nan), "intercept <= 0 or not finite"),
        (_fit(math.inf), "intercept <= 0 or not finite"),
        (_fit(0.01, mean=0.0), "no positive mean step"),
    ],
)
def test_a_degenerate_fit_keeps_the_f_in_force(fit: StepTimeFit | None, reason: str) -> None:
    src, b = FakeFit(), _batcher()
    feed = FixedStepFeed(src, b, LINK, min_steps=8)
    src.fit = fit
    assert feed.after_step() is None
    assert b.fixed_step_bytes == CALIBRATED  # the calibration's
    assert feed.kept == {reason: 1}
    assert feed.fields()["fixed_step_bytes_source"] == "calibration"
    # after a usable fit, a degenerate one keeps the fitted F
    src.fit = _fit(0.007)
    feed.after_step()
    src.fit = fit
    assert feed.after_step() is None
    assert b.fixed_step_bytes == 7_000_000
    assert feed.fields()["fixed_step_bytes_source"] == "online_fit"


def test_an_f_the_scheduler_refuses_is_not_applied() -> None:
    src, b = FakeFit(), _batcher()
    feed = FixedStepFeed(src, b, 1e30)  # t_fixed x this overflows int64 products
    src.fit = _fit(0.01, mean=1.0)
    assert feed.after_step() is None
    assert b.fixed_step_bytes == CALIBRATED
    assert feed.kept == {"out of the scheduler's int64 range": 1}


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="marginal rule is off"):
        FixedStepFeed(FakeFit(), _batcher(None), LINK)
    with pytest.raises(ValueError, match="link_bytes_per_s"):
        FixedStepFeed(FakeFit(), _batcher(), math.nan)
    with pytest.raises(ValueError, match="min_steps"):
        FixedStepFeed(FakeFit(), _batcher(), LINK, min_steps=1)
    with pytest.raises(ValueError, match="marginal rule is off"):
        _batcher(None).set_fixed_step_bytes(5)
    b = _batcher()
    with pytest.raises(ValueError, match="fixed_step_bytes"):
        b.set_fixed_step_bytes(-1)
    assert b.fixed_step_bytes == CALIBRATED


def _observe(pol: AdaptiveWidth, rows: int, wall: float, compute: float) -> None:
    outs = (WidthOutcome(1, rows - 1, 0),)
    pol.observe(
        WidthStep(outs, wall_s=wall, verify_compute_s=compute, exposed_fetch_s=0.0, union_experts=4)
    )


def test_the_adaptive_width_fit_recovers_the_fixed_time_unfloored() -> None:
    # no bytes copied (expert_bytes 0): step = 50 ms + 2 ms per row
    pol = AdaptiveWidth(block_size=16, num_layers=2, num_experts=8, top_k=2, expert_bytes=0)
    assert pol.step_time_fit() is None
    for rows in (3, 9, 5, 12, 7):
        _observe(pol, rows, 0.05 + 0.002 * rows, 0.002 * rows)
    fit = pol.step_time_fit()
    assert fit is not None and fit.steps == 5 and fit.rows_vary
    assert fit.t_fixed_s == pytest.approx(0.05) and fit.t_row_s == pytest.approx(0.002)
    assert pol.time_fit() == pytest.approx((0.05, 0.002))
    # a negative intercept: the width's fit floors it, F's feed sees it
    neg = AdaptiveWidth(block_size=16, num_layers=2, num_experts=8, top_k=2, expert_bytes=0)
    for rows in (5, 9, 13):
        _observe(neg, rows, 0.003 * rows - 0.01, 0.003 * rows)
    nf = neg.step_time_fit()
    assert nf is not None and nf.t_fixed_s == pytest.approx(-0.01)
    t_fixed, _ = neg.time_fit() or (0.0, 0.0)
    assert t_fixed == pytest.approx(AdaptiveWidth.FIXED_FLOOR * nf.mean_step_s)
    b = _batcher()
    feed = FixedStepFeed(neg, b, LINK, min_steps=2)
    assert feed.after_step() is None and b.fixed_step_bytes == CALIBRATED


def _run_fed(
    adapter: Any, drafter: Any, **changes: Any
) -> tuple[Engine, DeficitBatcher, FixedStepFeed]:
    """PD (no controller: its parts as ``changes`` leave them) with F fed
    from its width's fit, run over four requests to the end."""
    cfg = EngineConfig.preset("PD", block_size=6, max_running=3, token_budget=11)
    cfg = cfg.replace(parts_controller=False, **changes)
    batcher, predictor = make_batcher_and_predictor(cfg, adapter)
    assert isinstance(batcher, DeficitBatcher)
    batcher.set_byte_budget(6 * adapter.expert_nbytes, CALIBRATED)
    eng = Engine(
        adapter, cfg, drafter=drafter, batcher=batcher, predictor=predictor, max_seq_len=64
    )
    feed = follow_step_time_fit(eng, batcher, LINK, min_steps=2)
    assert feed is not None and eng.fixed_step is feed
    ids = [eng.add_request([1 + i, 2, 3, 4], max_new_tokens=12) for i in range(4)]
    done = eng.run_until_done(max_steps=500)
    assert all(done[i].state == RequestState.FINISHED for i in ids)
    return eng, batcher, feed


def test_an_engine_run_follows_its_width_fit(adapter: Any, drafter: Any) -> None:
    # route-ahead on throughout (no controller to switch it off): F is
    # refitted after every step
    eng, batcher, feed = _run_fed(adapter, drafter)
    assert eng.config.verify_width == "adaptive"
    # one decision per step, and the F in force is the last usable fit's
    assert feed.fitted_steps + sum(feed.kept.values()) == eng.steps
    assert eng.width is not None and isinstance(eng.width.policy, AdaptiveWidth)
    fit = eng.width.policy.step_time_fit()
    assert fit is not None and fit.steps >= 2
    if feed.fitted_steps and feed._unusable(fit) is None:
        want = int(min(fit.t_fixed_s * LINK, LINK * fit.mean_step_s))
        assert batcher.fixed_step_bytes == want
        assert feed.fields()["fixed_step_bytes_source"] == "online_fit"
    else:
        assert feed.kept


def test_without_route_ahead_f_is_not_refitted(adapter: Any, drafter: Any) -> None:
    """No predictions, no predicted bytes: F changes no choice, so the feed
    reads no fit; every step counts as kept for that reason, F stays."""
    eng, batcher, feed = _run_fed(adapter, drafter, route_ahead=False, streaming_prefetch=False)
    assert feed.kept == {FixedStepFeed.NO_PREDICTED_BYTES: eng.steps} and feed.fitted_steps == 0
    assert batcher.fixed_step_bytes == CALIBRATED


def test_no_fit_no_feed(adapter: Any, drafter: Any) -> None:
    # every draft verified: no width policy, so no fit
    cfg = EngineConfig.preset("PD-full-width", block_size=6, max_running=3, token_budget=11)
    assert cfg.verify_width == "full"
    batcher, predictor = make_batcher_and_predictor(cfg, adapter)
    eng = Engine(
        adapter, cfg, drafter=drafter, batcher=batcher, predictor=predictor, max_seq_len=64
    )
    assert follow_step_time_fit(eng, _batcher(), LINK) is None and eng.fixed_step is None
