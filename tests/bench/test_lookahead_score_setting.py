"""How PD's stream scores a gate-lookahead expert against its confidence
threshold (``lookahead_score``) as a run setting: a RunSpec field with the
engine's default that reaches the engine configuration, checked, keyed by
the report where the label runs the stream, and settable on an issue-16
arm; and the two scores themselves, from the router and from a trace."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bench_fixtures import check_an_issue16_arm_sets
from pdflash.bench.engine_run import RunSpec

from pdflash.engine.config import LOOKAHEAD_SCORES, EngineConfig
from pdflash.report.schema import RUN_SETTINGS, row_key, spec_settings
from pdflash.routeahead import NextLayerLookahead

(SETTING,) = [s for s in RUN_SETTINGS if s.name == "lookahead_score"]


def test_the_default_is_the_engines_and_reaches_its_configuration() -> None:
    assert SETTING.default == EngineConfig().lookahead_score == "prob"
    assert LOOKAHEAD_SCORES == ("prob", "share")
    assert RunSpec(arch="tiny", baseline="PD").lookahead_score == "prob"
    spec = RunSpec(arch="tiny", baseline="PD", lookahead_score="share")
    assert spec.engine_config().lookahead_score == "share"


def test_a_bad_score_is_refused() -> None:
    with pytest.raises(ValueError, match="lookahead_score"):
        RunSpec(arch="tiny", baseline="PD", lookahead_score="logit").validate()
    with pytest.raises(ValueError, match="lookahead_score"):
        EngineConfig(lookahead_score="logit")


def test_specs_and_rows_are_keyed_by_it_where_the_stream_runs() -> None:
    base = {"arch": "tiny", "baseline": "PD", "concurrency": 1, "cache_fraction": 0.2}
    assert spec_settings(base) == spec_settings({**base, "lookahead_score": "prob"})
    assert spec_settings(base) != spec_settings({**base, "lookahead_score": "share"})
    plain = {**base, "baseline": "B1"}  # no stream: nothing thresholds the score
    assert spec_settings(plain) == spec_settings({**plain, "lookahead_score": "share"})
    row = {"arch": "tiny", "baseline": "PD", "concurrency": 1, "cache_fraction": 0.2}
    assert SETTING.of_row(row) == SETTING.of_row({**row, "lookahead_score": None}) == "prob"
    assert row_key({**row, "lookahead_score": "share"}) != row_key(row)


def test_an_issue16_arm_sets_it() -> None:
    check_an_issue16_arm_sets("lookahead_score", "share", "share")


class _Routers:
    """Router access with fixed logits: 2 layers, 6 experts, top-2."""

    num_layers, num_experts, top_k = 2, 6, 2

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits

    def moe_norm(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def router_logits(self, layer: int, normed: torch.Tensor) -> torch.Tensor:
        return self.logits


def test_share_scores_each_rows_top_k_shares_prob_their_probabilities() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 3.0, 3.0, 0.0]])
    probs = torch.softmax(logits, dim=-1)
    hidden = torch.zeros(2, 4)
    by_prob = NextLayerLookahead(_Routers(logits))  # type: ignore[arg-type]
    by_share = NextLayerLookahead(_Routers(logits), score="share")  # type: ignore[arg-type]
    ids, scores = by_prob.predict_next(0, hidden)
    want = {6 + 0: probs[0, 0], 6 + 1: probs[0, 1], 6 + 3: probs[1, 3], 6 + 4: probs[1, 4]}
    assert sorted(ids.tolist()) == sorted(want)
    for i, s in zip(ids.tolist(), scores.tolist(), strict=True):
        assert s == pytest.approx(float(want[i]), rel=1e-6)
    ids, scores = by_share.predict_next(0, hidden)
    top0 = probs[0, :2] / probs[0, :2].sum()
    share = {6 + 0: top0[0], 6 + 1: top0[1], 6 + 3: 0.5, 6 + 4: 0.5}
    for i, s in zip(ids.tolist(), scores.tolist(), strict=True):
        assert s == pytest.approx(float(share[i]), rel=1e-6)
    assert np.all(np.diff(scores) <= 0)
    assert scores.sum() == pytest.approx(2.0)  # one per row
    with pytest.raises(ValueError, match="score"):
        NextLayerLookahead(_Routers(logits), score="logit")  # type: ignore[arg-type]
