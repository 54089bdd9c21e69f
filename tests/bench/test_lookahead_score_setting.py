"""How PD's stream scores a gate-lookahead expert against its confidence
threshold (``lookahead_score``) as a run setting: a RunSpec field with the
engine's default that reaches the engine configuration, checked, keyed by
the report where the label runs the stream, and settable on an issue-16
arm; the two scores themselves, from the router and from a trace; and
``every``, which lifts the stream's threshold."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bench_fixtures import check_an_issue16_arm_sets
from pdflash.bench.engine_run import RunSpec

from pdflash.engine.config import LOOKAHEAD_SCORE_SETTINGS, LOOKAHEAD_SCORES, EngineConfig
from pdflash.engine.prefetch import ExpertPrefetcher
from pdflash.report.schema import RUN_SETTINGS, row_key, spec_settings
from pdflash.routeahead import NextLayerLookahead

(SETTING,) = [s for s in RUN_SETTINGS if s.name == "lookahead_score"]


def test_the_default_is_the_engines_and_reaches_its_configuration() -> None:
    assert SETTING.default == EngineConfig().lookahead_score == "prob"
    assert LOOKAHEAD_SCORES == ("prob", "share")
    assert LOOKAHEAD_SCORE_SETTINGS == ("prob", "share", "every")
    assert RunSpec(arch="tiny", baseline="PD").lookahead_score == "prob"
    spec = RunSpec(arch="tiny", baseline="PD", lookahead_score="share")
    assert spec.engine_config().lookahead_score == "share"
    every = RunSpec(arch="tiny", baseline="PD", lookahead_score="every")
    every.validate()
    config = every.engine_config()
    assert config.lookahead_score == "every"
    # the lookahead ranks by probability; only the threshold goes
    assert config.lookahead_predictor_score == "prob" and config.stream_lookahead_min_score == 0.0
    for score in LOOKAHEAD_SCORES:
        built = EngineConfig(lookahead_score=score)
        assert built.lookahead_predictor_score == score
        assert built.stream_lookahead_min_score is None


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


class _Shape:
    num_layers, num_experts, top_k = 2, 4, 2


class _FixedNext:
    """A next-layer predictor: experts 0, 1 and 3 of the next layer at
    summed probabilities 0.9, 0.2 and 0.05."""

    def predict_next(self, layer: int, hidden: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        nxt = (layer + 1) * _Shape.num_experts
        return np.array([nxt, nxt + 1, nxt + 3]), np.array([0.9, 0.2, 0.05], dtype=np.float32)


@pytest.mark.parametrize(("score", "fetched"), [("prob", [0]), ("every", [0, 1, 3])])
def test_every_makes_the_stream_copy_every_expert_the_lookahead_predicts(
    score: str, fetched: list[int]
) -> None:
    """Under ``prob`` the stream copies the next layer's experts whose summed
    probability reaches ``0.6 / top_k`` (0.3) and protects the rest; under
    ``every`` it copies them all, as the plain gate lookahead does."""
    config = EngineConfig.preset("PD", lookahead_score=score)
    planner = ExpertPrefetcher(
        _Shape(),  # type: ignore[arg-type]
        object(),  # type: ignore[arg-type]
        config,
        lookahead_predictor=_FixedNext(),
    )
    stream = planner.built_stream
    assert stream is not None
    assert stream.lookahead_min_score == (0.0 if score == "every" else 0.3)
    stream._apply_lookahead(0, torch.zeros(1, 4))
    assert np.flatnonzero(stream.plan[1]).tolist() == [0, 1, 3]
    assert np.flatnonzero(stream.fetch[1]).tolist() == fetched
