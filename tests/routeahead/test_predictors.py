"""Predictors on tiny random-weight HF MoE models, scored against the exact
routed sets of a real forward (captured from the gate modules)."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

from pdflash.metrics import NotMeasured
from pdflash.protocols import DraftedBlock, ExpertPredictor
from pdflash.routeahead import (
    AcceptanceHorizon,
    ApproxRouterPredictor,
    CombinedPredictor,
    FrequencyPriorPredictor,
    NextLayerLookahead,
    PreviousRoundPredictor,
    RouteAheadStats,
    predict_batch,
    select_under_budget,
)

BLOCK = 16


def _block(request_id: int, ids: torch.Tensor, **kw: Any) -> DraftedBlock:
    return DraftedBlock(request_id, ids, torch.arange(ids.shape[0]), **kw)


def _blocks(hf: Any, count: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, hf.vocab, (BLOCK,), generator=gen) for _ in range(count)]


def test_predictors_satisfy_the_protocol(hf: Any) -> None:
    adapter = hf.adapter(hf.build("qwen3_moe"), "qwen3_moe")
    stats = RouteAheadStats.for_adapter(adapter)
    for p in (
        ApproxRouterPredictor(adapter),
        PreviousRoundPredictor(hf.layers, hf.experts),
        FrequencyPriorPredictor(stats, per_layer=4),
        CombinedPredictor([(PreviousRoundPredictor(hf.layers, hf.experts), 1.0)]),
    ):
        assert isinstance(p, ExpertPredictor), p


def test_embed_proxy_is_exact_when_attention_and_experts_add_nothing(hf: Any, arch: str) -> None:
    # The attention-free residual proxy *is* the residual stream of a model
    # whose attention and experts output zero: then it must match exactly.
    model = hf.build(arch)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.experts.down_proj.zero_()
    adapter = hf.adapter(model, arch)
    ids = _blocks(hf, 1, seed=5)[0]
    routed = hf.real_forward(model, ids).routed_mask()
    scores = ApproxRouterPredictor(adapter, proxy="embed").predict(_block(0, ids))
    assert scores.dtype == np.float32 and scores.shape == (hf.layers, hf.experts)
    np.testing.assert_array_equal(scores > 0, routed)


def test_drafter_proxy_uses_drafter_hidden(hf: Any, arch: str) -> None:
    # A drafter hidden state equal to layer 0's true MoE input reproduces
    # layer 0's routing exactly: the drafter path applies the real router.
    model = hf.build(arch)
    adapter = hf.adapter(model, arch)
    ids = _blocks(hf, 1, seed=6)[0]
    fwd = hf.real_forward(model, ids)
    block = _block(0, ids, drafter_hidden=fwd.moe_input[0])
    for proxy in ("drafter", "auto"):
        scores = ApproxRouterPredictor(adapter, proxy=proxy).predict(block)  # type: ignore[arg-type]
        np.testing.assert_array_equal(scores[0] > 0, fwd.routed_mask()[0])
    with pytest.raises(ValueError, match="no drafter_hidden"):
        ApproxRouterPredictor(adapter, proxy="drafter").predict(_block(0, ids))


def test_scores_are_summed_gate_probabilities(hf: Any) -> None:
    adapter = hf.adapter(hf.build("mixtral"), "mixtral")
    ids = _blocks(hf, 1, seed=7)[0]
    scores = ApproxRouterPredictor(adapter, proxy="embed").predict(_block(0, ids))
    # each position adds its top-k probabilities (each in (0, 1], summing to <= 1)
    per_layer = scores.sum(axis=1)
    assert (per_layer > 0).all() and (per_layer <= BLOCK + 1e-4).all()
    assert ((scores > 0).sum(axis=1) <= BLOCK * hf.top_k).all()


def test_horizon_limits_positions(hf: Any) -> None:
    adapter = hf.adapter(hf.build("olmoe"), "olmoe")
    ids = _blocks(hf, 1, seed=8)[0]
    predictor = ApproxRouterPredictor(adapter, proxy="embed")
    short = predictor.predict(_block(0, ids, horizon=3))
    np.testing.assert_array_equal(short, predictor.predict(_block(0, ids[:3])))
    assert (short > 0).sum() < (predictor.predict(_block(0, ids)) > 0).sum()
    with pytest.raises(ValueError, match="horizon must be positive"):
        predictor.predict(_block(0, ids, horizon=0))


def test_predict_batch_matches_single_predictions(hf: Any) -> None:
    adapter = hf.adapter(hf.build("qwen3_moe"), "qwen3_moe")
    predictor = ApproxRouterPredictor(adapter)
    blocks = [
        _block(i, ids, horizon=h)
        for i, (ids, h) in enumerate(zip(_blocks(hf, 3, 9), (None, 5, 16), strict=True))
    ]
    batched = predict_batch(predictor, blocks)
    assert batched.shape == (3, hf.layers, hf.experts)
    for i, block in enumerate(blocks):
        np.testing.assert_allclose(batched[i], predictor.predict(block), rtol=1e-5, atol=1e-6)
    prev = PreviousRoundPredictor(hf.layers, hf.experts)
    assert predict_batch(prev, blocks).shape == (3, hf.layers, hf.experts)


def test_next_layer_lookahead_applies_the_next_router(hf: Any, arch: str) -> None:
    model = hf.build(arch)
    adapter = hf.adapter(model, arch)
    fwd = hf.real_forward(model, _blocks(hf, 1, seed=10)[0])
    look = NextLayerLookahead(adapter)
    routed = fwd.routed_mask()
    for layer in range(hf.layers - 1):
        # fed layer l+1's true MoE input, the lookahead is layer l+1's exact routing
        ids, scores = look.predict_next(layer, fwd.moe_input[layer + 1])
        assert (np.diff(scores) <= 0).all() and (scores > 0).all()
        assert ((ids // hf.experts) == layer + 1).all()
        np.testing.assert_array_equal(np.sort(ids % hf.experts), np.flatnonzero(routed[layer + 1]))
    ids, scores = look.predict_next(hf.layers - 1, fwd.layer_output[-1])
    assert ids.size == 0 and scores.size == 0
    with pytest.raises(ValueError, match="layer must be in"):
        look.predict_next(hf.layers, fwd.layer_output[-1])


def test_previous_round_predicts_last_routed_set(hf: Any) -> None:
    prev = PreviousRoundPredictor(hf.layers, hf.experts)
    block = _block(7, _blocks(hf, 1, seed=11)[0])
    assert not prev.predict(block).any()  # nothing observed: no prediction
    routed = np.zeros((hf.layers, hf.experts), dtype=bool)
    routed[1, 3] = routed[2, 60] = True
    prev.observe(7, routed)
    routed[0, 0] = True  # the predictor holds a copy, not the caller's array
    np.testing.assert_array_equal(prev.predict(block) > 0, routed & ~(np.arange(hf.experts) == 0))
    assert not prev.predict(_block(8, block.token_ids)).any()
    prev.forget(7)
    assert not prev.predict(block).any()
    with pytest.raises(ValueError, match="routed must have shape"):
        prev.observe(7, routed[:1])


def test_frequency_prior_reads_the_stats() -> None:
    stats = RouteAheadStats(2, 8, 1, decay=1.0)
    routed = np.zeros((2, 8), dtype=bool)
    routed[0, [1, 2]] = routed[1, 5] = True
    stats.update(routed, routed)
    routed[0, 2] = False
    stats.update(routed, routed)
    prior = FrequencyPriorPredictor(stats, per_layer=1)
    scores = prior.predict(_block(0, torch.zeros(1, dtype=torch.int64)))
    assert scores[0, 1] == 1.0 and scores[1, 5] == 1.0
    assert (scores > 0).sum() == 2
    # never-routed experts are never predicted, even when per_layer allows
    assert (
        FrequencyPriorPredictor(stats, per_layer=8).predict(_block(0, torch.zeros(1))) > 0
    ).sum() == 3


def test_select_under_budget_ranks_then_cuts() -> None:
    scores = np.array([[0.5, 0.0, 0.9], [0.5, 0.2, 0.0]], dtype=np.float32)
    assert select_under_budget(scores, 10, 100).tolist() == [2, 0, 3, 4]  # tie: earlier layer
    assert select_under_budget(scores, 10, 25).tolist() == [2, 0]
    assert select_under_budget(scores, 10, 9).tolist() == []
    nbytes = np.array([[1, 1, 50], [1, 1, 1]])
    assert select_under_budget(scores, nbytes, 10).tolist() == []  # the top one does not fit
    with pytest.raises(ValueError, match="byte_budget"):
        select_under_budget(scores, 1, -1)


def test_combined_rank_union_and_budget(hf: Any) -> None:
    a = PreviousRoundPredictor(1, 4, name="a")
    b = PreviousRoundPredictor(1, 4, name="b")
    a.observe(0, np.array([[1, 1, 0, 0]], bool))
    b.observe(0, np.array([[0, 1, 1, 0]], bool))
    block = _block(0, torch.zeros(2, dtype=torch.int64))
    ranked = CombinedPredictor([(a, 1.0), (b, 2.0)]).predict(block)
    np.testing.assert_allclose(ranked, [[1.0, 3.0, 2.0, 0.0]])
    union = CombinedPredictor([(a, 1.0), (b, 2.0)], mode="union").predict(block)
    np.testing.assert_allclose(union, [[1.0, 2.0, 2.0, 0.0]])
    budget = CombinedPredictor([(a, 1.0), (b, 2.0)], expert_nbytes=10, byte_budget=20)
    np.testing.assert_allclose(budget.predict(block), [[0.0, 3.0, 2.0, 0.0]])
    budget.forget(0)
    assert not budget.predict(block).any()
    with pytest.raises(ValueError, match="weight"):
        CombinedPredictor([(a, 0.0)])


def test_acceptance_horizon() -> None:
    hz = AcceptanceHorizon(16, window=4, quantile=0.75, margin=1)
    block = _block(3, torch.zeros(16, dtype=torch.int64))
    assert hz.horizon(3) is None and hz.apply(block).horizon is None
    for a in (2, 9, 4, 3, 5):  # window keeps 9, 4, 3, 5
        hz.observe(3, a)
    # nearest rank: ceil(0.75 * 4) = 3rd smallest of [3, 4, 5, 9] = 5; + margin 1
    assert hz.horizon(3) == 6
    assert hz.apply(block).horizon == 6 and block.horizon is None
    hz.observe(3, 16)
    hz.observe(3, 16)
    assert hz.horizon(3) == 16  # clamped to the block
    hz.forget(3)
    assert hz.horizon(3) is None
    with pytest.raises(ValueError, match="acceptance_length"):
        hz.observe(3, 0)


def _score(predicted: npt.NDArray[np.bool_], routed: npt.NDArray[np.bool_]) -> tuple[int, int, int]:
    return int((predicted & routed).sum()), int(predicted.sum()), int(routed.sum())


def test_report_coverage_and_precision_per_predictor(hf: Any, arch: str) -> None:
    """Per predictor, over consecutive 16-token blocks of one request on a
    random-weight model (synthetic): coverage and precision against the real
    routing, with a random predictor of the same size as the yardstick."""
    model = hf.build(arch)
    adapter = hf.adapter(model, arch)
    stats = RouteAheadStats.for_adapter(adapter, decay=0.95)
    previous = PreviousRoundPredictor(hf.layers, hf.experts)
    predictors: dict[str, ExpertPredictor] = {
        "approx_router": ApproxRouterPredictor(adapter),
        "previous_round": previous,
        "frequency_prior": FrequencyPriorPredictor(stats, per_layer=2 * BLOCK),
    }
    totals = {name: [0, 0, 0] for name in [*predictors, "next_layer", "random_same_size"]}
    rng = np.random.default_rng(0)
    look = NextLayerLookahead(adapter)
    for step, ids in enumerate(_blocks(hf, 12, seed=100 + len(arch))):
        fwd = hf.real_forward(model, ids)
        routed = fwd.routed_mask()
        block = _block(0, ids)
        for name, p in predictors.items():
            scored = _score(p.predict(block) > 0, routed)
            if step > 0:  # previous/frequency have nothing to say at step 0
                totals[name] = [t + s for t, s in zip(totals[name], scored, strict=True)]
        nxt = np.zeros_like(routed)
        for layer in range(hf.layers - 1):
            flat, _ = look.predict_next(layer, fwd.layer_output[layer])
            nxt.reshape(-1)[flat] = True
        scored = _score(nxt[1:], routed[1:])
        totals["next_layer"] = [t + s for t, s in zip(totals["next_layer"], scored, strict=True)]
        approx = predictors["approx_router"].predict(block) > 0
        shuffled = np.stack([rng.permutation(row) for row in approx])
        if step > 0:
            scored = _score(shuffled, routed)
            totals["random_same_size"] = [
                t + s for t, s in zip(totals["random_same_size"], scored, strict=True)
            ]
        stats.update(approx, routed)
        previous.observe(0, routed)
    report = {
        name: (
            hits / routed if routed else NotMeasured("none"),
            hits / pred if pred else NotMeasured("none"),
        )
        for name, (hits, pred, routed) in totals.items()
    }
    print(f"\n{arch}: (coverage, precision) per predictor on a synthetic random model")
    for name, (cov, prec) in report.items():
        print(f"  {name:18s} coverage={cov:.3f} precision={prec:.3f}")
    for cov, prec in report.values():
        assert 0.0 <= cov <= 1.0 and 0.0 <= prec <= 1.0
    # the real router on the embeddings must beat a random set of the same size
    assert report["approx_router"][0] > report["random_same_size"][0]
    # layer l+1's router on layer l's output must too (it is much closer)
    assert report["next_layer"][0] > report["random_same_size"][0]
    # the stats saw the same approx-router predictions
    snap = stats.snapshot()
    assert snap.steps == 12 and isinstance(snap.coverage, float)
