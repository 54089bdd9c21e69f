"""Predictors on tiny random-weight MoE models of all four architectures
(``pdflash.models`` adapters over synthetic checkpoints), scored against the
exact routed sets of the transformers forward of the same checkpoint."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

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


def test_predictors_satisfy_the_protocol(tiny_moes: Any) -> None:
    tiny = tiny_moes("qwen3_moe")
    adapter = tiny.adapter
    stats = RouteAheadStats.for_adapter(adapter)
    for p in (
        ApproxRouterPredictor(adapter),
        ApproxRouterPredictor(adapter, proxy="block_attention"),
        PreviousRoundPredictor(tiny.layers, tiny.experts),
        FrequencyPriorPredictor(stats, per_layer=4),
        CombinedPredictor([(PreviousRoundPredictor(tiny.layers, tiny.experts), 1.0)]),
    ):
        assert isinstance(p, ExpertPredictor), p


def test_embed_proxy_is_exact_when_attention_and_experts_add_nothing(
    tiny: Any, helpers: Any
) -> None:
    # The attention-free residual proxy *is* the residual stream of a model
    # whose attention and experts output zero: then it must match exactly.
    model = tiny.resident(fresh=True)
    helpers.zero_attention(model)
    helpers.zero_experts(model)
    ids = tiny.tokens(1, BLOCK, seed=5)[0]
    routed = tiny.real_forward(ids, model).routed_mask()
    scores = ApproxRouterPredictor(tiny.adapter, proxy="embed").predict(_block(0, ids))
    assert scores.dtype == np.float32 and scores.shape == (tiny.layers, tiny.experts)
    np.testing.assert_array_equal(scores > 0, routed)


def test_block_attention_proxy_is_exact_when_experts_add_nothing(tiny: Any, helpers: Any) -> None:
    # A block starting the sequence has no context before it, so embeddings
    # carried through each layer's (block-only) attention with the experts
    # skipped are the true residual stream of a model whose experts add 0.
    model = tiny.resident(fresh=True)
    helpers.zero_experts(model)
    ids = tiny.tokens(1, BLOCK, seed=12)[0]
    routed = tiny.real_forward(ids, model).routed_mask()
    block_attn = ApproxRouterPredictor(tiny.adapter, proxy="block_attention")
    np.testing.assert_array_equal(block_attn.predict(_block(0, ids)) > 0, routed)
    # while the attention-free proxy is not exact on the same model
    embed_only = ApproxRouterPredictor(tiny.adapter, proxy="embed").predict(_block(0, ids)) > 0
    assert (embed_only != routed).any()
    # batching blocks of different lengths keeps each block to itself
    other = tiny.tokens(1, 7, seed=13)[0]
    both = predict_batch(block_attn, [_block(0, other), _block(1, ids)])
    np.testing.assert_array_equal(both[1] > 0, routed)
    np.testing.assert_allclose(both[0], block_attn.predict(_block(0, other)), rtol=1e-5, atol=1e-6)


def test_drafter_proxy_uses_drafter_hidden(tiny: Any) -> None:
    # A drafter hidden state equal to layer 0's true MoE input reproduces
    # layer 0's routing exactly: the drafter path applies the real router.
    ids = tiny.tokens(1, BLOCK, seed=6)[0]
    fwd = tiny.real_forward(ids)
    block = _block(0, ids, drafter_hidden=fwd.moe_input[0])
    for proxy in ("drafter", "auto"):
        scores = ApproxRouterPredictor(tiny.adapter, proxy=proxy).predict(block)  # type: ignore[arg-type]
        np.testing.assert_array_equal(scores[0] > 0, fwd.routed_mask()[0])
    with pytest.raises(ValueError, match="no drafter_hidden"):
        ApproxRouterPredictor(tiny.adapter, proxy="drafter").predict(_block(0, ids))


def test_scores_are_summed_gate_probabilities(tiny_moes: Any) -> None:
    tiny = tiny_moes("mixtral")
    ids = tiny.tokens(1, BLOCK, seed=7)[0]
    scores = ApproxRouterPredictor(tiny.adapter, proxy="embed").predict(_block(0, ids))
    # each position adds its top-k probabilities (each in (0, 1], summing to <= 1)
    per_layer = scores.sum(axis=1)
    assert (per_layer > 0).all() and (per_layer <= BLOCK + 1e-4).all()
    assert ((scores > 0).sum(axis=1) <= BLOCK * tiny.top_k).all()
    wide = ApproxRouterPredictor(tiny.adapter, proxy="embed", experts_per_token=6)
    assert ((wide.predict(_block(0, ids)) > 0) >= (scores > 0)).all()
    with pytest.raises(ValueError, match="experts_per_token"):
        ApproxRouterPredictor(tiny.adapter, experts_per_token=tiny.experts + 1)
    with pytest.raises(ValueError, match="proxy must be one of"):
        ApproxRouterPredictor(tiny.adapter, proxy="nope")  # type: ignore[arg-type]


def test_horizon_limits_positions(tiny_moes: Any) -> None:
    tiny = tiny_moes("olmoe")
    ids = tiny.tokens(1, BLOCK, seed=8)[0]
    for proxy in ("embed", "block_attention"):
        predictor = ApproxRouterPredictor(tiny.adapter, proxy=proxy)  # type: ignore[arg-type]
        short = predictor.predict(_block(0, ids, horizon=3))
        np.testing.assert_allclose(short, predictor.predict(_block(0, ids[:3])), rtol=1e-5)
        assert (short > 0).sum() < (predictor.predict(_block(0, ids)) > 0).sum()
        with pytest.raises(ValueError, match="horizon must be positive"):
            predictor.predict(_block(0, ids, horizon=0))


def test_predict_batch_matches_single_predictions(tiny_moes: Any) -> None:
    tiny = tiny_moes("gpt_oss")
    predictor = ApproxRouterPredictor(tiny.adapter, proxy="block_attention")
    tokens = tiny.tokens(3, BLOCK, seed=9)
    blocks = [
        _block(i, ids, horizon=h)
        for i, (ids, h) in enumerate(zip(tokens, (None, 5, 16), strict=True))
    ]
    batched = predict_batch(predictor, blocks)
    assert batched.shape == (3, tiny.layers, tiny.experts)
    for i, block in enumerate(blocks):
        np.testing.assert_allclose(batched[i], predictor.predict(block), rtol=1e-5, atol=1e-6)
    prev = PreviousRoundPredictor(tiny.layers, tiny.experts)
    assert predict_batch(prev, blocks).shape == (3, tiny.layers, tiny.experts)


def test_next_layer_lookahead_applies_the_next_router(tiny: Any) -> None:
    fwd = tiny.real_forward(tiny.tokens(1, BLOCK, seed=10)[0])
    look = NextLayerLookahead(tiny.adapter)
    routed = fwd.routed_mask()
    for layer in range(tiny.layers - 1):
        # fed layer l+1's true MoE input, the lookahead is layer l+1's exact routing
        ids, scores = look.predict_next(layer, fwd.moe_input[layer + 1])
        assert (np.diff(scores) <= 0).all() and (scores > 0).all()
        assert ((ids // tiny.experts) == layer + 1).all()
        np.testing.assert_array_equal(
            np.sort(ids % tiny.experts), np.flatnonzero(routed[layer + 1])
        )
    ids, scores = look.predict_next(tiny.layers - 1, fwd.layer_output[-1])
    assert ids.size == 0 and scores.size == 0
    with pytest.raises(ValueError, match="layer must be in"):
        look.predict_next(tiny.layers, fwd.layer_output[-1])


def test_previous_round_predicts_last_routed_set() -> None:
    layers, experts = 3, 64
    prev = PreviousRoundPredictor(layers, experts)
    block = _block(7, torch.arange(BLOCK))
    assert not prev.predict(block).any()  # nothing observed: no prediction
    routed = np.zeros((layers, experts), dtype=bool)
    routed[1, 3] = routed[2, 60] = True
    prev.observe(7, routed)
    routed[0, 0] = True  # the predictor holds a copy, not the caller's array
    expect = routed.copy()
    expect[0, 0] = False
    np.testing.assert_array_equal(prev.predict(block) > 0, expect)
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


def test_combined_rank_union_and_budget() -> None:
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


class _PerRequestScores:
    """Fixed scores per request id (some negative, one block all zero)."""

    name = "fixed"

    def __init__(self, table: dict[int, npt.NDArray[np.float32]]) -> None:
        self.table = table

    def predict(self, block: DraftedBlock) -> npt.NDArray[np.float32]:
        return self.table[block.request_id]

    def observe(self, request_id: int, routed: npt.NDArray[np.bool_]) -> None:
        pass

    def forget(self, request_id: int) -> None:
        pass


def test_combined_batch_equals_per_block_and_engine_union() -> None:
    """One home for the scaling and the union: the batched call equals the
    per-block one exactly, in every mode, and the engine's union predictor
    is the union mode of the same code."""
    from pdflash.engine.predict import BatchedUnionPredictor

    rng = np.random.default_rng(3)
    tables = [{r: rng.normal(size=(2, 5)).astype(np.float32) for r in range(3)} for _ in range(2)]
    tables[0][1][:] = 0.0  # a block with no positive score contributes nothing
    members: list[tuple[ExpertPredictor, float]] = [
        (_PerRequestScores(tables[0]), 0.3),
        (_PerRequestScores(tables[1]), 1.7),
    ]
    blocks = [_block(r, torch.zeros(2, dtype=torch.int64)) for r in range(3)]
    for kwargs in ({}, {"mode": "union"}, {"expert_nbytes": 10, "byte_budget": 30}):
        combined = CombinedPredictor(members, **kwargs)
        batch = combined.predict_batch(blocks)
        assert batch.shape == (3, 2, 5) and batch.dtype == np.float32
        for i, block in enumerate(blocks):
            np.testing.assert_array_equal(batch[i], combined.predict(block))
    union = CombinedPredictor(members, mode="union")
    engine_union = BatchedUnionPredictor(members)
    np.testing.assert_array_equal(engine_union.predict_batch(blocks), union.predict_batch(blocks))
    np.testing.assert_array_equal(engine_union.predict(blocks[2]), union.predict(blocks[2]))
    assert (union.predict(blocks[1]) > 0).sum() == (tables[1][1] > 0).sum()


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


def test_report_coverage_and_precision_per_predictor(tiny: Any) -> None:
    """Per predictor, over 12 consecutive 16-token blocks of one sequence on
    a random-weight model (synthetic): coverage and precision against the
    routing of one real forward over the whole sequence (so each block's
    routing depends on its context, which the block predictors do not see),
    with a random predictor of the same size as the yardstick."""
    adapter = tiny.adapter
    stats = RouteAheadStats.for_adapter(adapter, decay=0.95)
    previous = PreviousRoundPredictor(tiny.layers, tiny.experts)
    predictors: dict[str, ExpertPredictor] = {
        "approx_router": ApproxRouterPredictor(adapter),
        "approx_block_attention": ApproxRouterPredictor(adapter, proxy="block_attention"),
        "previous_round": previous,
        "frequency_prior": FrequencyPriorPredictor(stats, per_layer=2 * BLOCK),
    }
    names = [*predictors, "next_layer", "random_same_size"]
    scoring = {name: RouteAheadStats.for_adapter(adapter) for name in names}
    rng = np.random.default_rng(0)
    look = NextLayerLookahead(adapter)
    blocks = 12
    sequence = torch.cat(tiny.tokens(blocks, BLOCK, seed=100))
    fwd = tiny.real_forward(sequence)
    for step in range(blocks):
        rows = slice(step * BLOCK, (step + 1) * BLOCK)
        routed = fwd.routed_mask(rows)
        block = DraftedBlock(0, sequence[rows], torch.arange(rows.start, rows.stop))
        approx = predictors["approx_router"].predict(block) > 0
        for name, p in predictors.items():
            if step > 0:  # previous/frequency have nothing to say at step 0
                scoring[name].update(p.predict(block) > 0, routed)
        nxt = np.zeros_like(routed)
        for layer in range(tiny.layers - 1):
            flat, _ = look.predict_next(layer, fwd.layer_output[layer][rows])
            nxt.reshape(-1)[flat] = True
        later = routed.copy()
        later[0] = False  # layer 0 has no previous layer to look ahead from
        scoring["next_layer"].update(nxt, later)
        if step > 0:
            shuffled = np.stack([rng.permutation(row) for row in approx])
            scoring["random_same_size"].update(shuffled, routed)
        stats.update(approx, routed)
        previous.observe(0, routed)
    report = {
        name: (st.snapshot().coverage, st.snapshot().precision) for name, st in scoring.items()
    }
    print(f"\n{tiny.arch}: (coverage, precision) per predictor, synthetic random-weight model")
    for name, (cov, prec) in report.items():
        assert isinstance(cov, float) and isinstance(prec, float)
        assert 0.0 <= cov <= 1.0 and 0.0 <= prec <= 1.0
        print(f"  {name:24s} coverage={cov:.3f} precision={prec:.3f}")

    def coverage(name: str) -> float:
        return float(report[name][0])

    # the router-based predictors must beat a random set of the same size
    for name in ("approx_router", "next_layer"):
        assert coverage(name) > coverage("random_same_size"), name
    assert stats.snapshot().steps == blocks


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_batched_block_attention_equals_reference_per_block(
    window: int | None, with_sinks: bool
) -> None:
    from pdflash.models.attention import reference_attention
    from pdflash.protocols import AttentionSpec
    from pdflash.routeahead.predictors import batched_block_attention

    gen = torch.Generator().manual_seed(0)
    spec = AttentionSpec(
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        scaling=8**-0.5,
        sliding_window=window,
        has_sinks=with_sinks,
    )
    q = torch.randn(3, 6, 4, 8, generator=gen)
    k = torch.randn(3, 6, 2, 8, generator=gen)
    v = torch.randn(3, 6, 2, 8, generator=gen)
    sinks = torch.randn(4, generator=gen) if with_sinks else None
    got = batched_block_attention(q, k, v, spec, sinks)
    pos = torch.arange(100, 106)  # absolute positions do not matter, only their order
    for g in range(3):
        want = reference_attention(q[g], k[g], v[g], spec, pos, pos, sinks)
        torch.testing.assert_close(got[g], want, rtol=1e-5, atol=1e-6)


def test_block_attention_handles_non_consecutive_positions(tiny_moes: Any) -> None:
    tiny = tiny_moes("gpt_oss")
    predictor = ApproxRouterPredictor(tiny.adapter, proxy="block_attention")
    ids = tiny.tokens(2, 8, seed=21)
    gappy = DraftedBlock(0, ids[0], torch.tensor([0, 1, 2, 5, 6, 7, 9, 10]))
    plain = _block(1, ids[1])
    both = predict_batch(predictor, [gappy, plain])
    np.testing.assert_allclose(both[0], predictor.predict(gappy), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(both[1], predictor.predict(plain), rtol=1e-5, atol=1e-6)
    # the gap changes what the window (4 on even layers) lets each token see
    assert not np.allclose(both[0], predictor.predict(_block(0, ids[0])))


def _predict_next_on_device(
    look: NextLayerLookahead, layer: int, hidden: torch.Tensor
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    """The reference: the ranking done on the device (a stable descending
    sort and a mask), as ``predict_next`` did before ranking on the host."""
    from pdflash.routeahead.predictors import _topk_gate_scores

    adapter = look.adapter
    e, nxt = adapter.num_experts, layer + 1
    logits = adapter.router_logits(nxt, adapter.moe_norm(nxt, hidden))
    ids, probs = _topk_gate_scores(logits, look.experts_per_token, e)
    scores = torch.zeros(e, dtype=torch.float32)
    scores.index_add_(0, ids.reshape(-1), probs.reshape(-1))
    order = torch.argsort(scores, descending=True, stable=True)
    order = order[scores[order] > 0]
    return (order + nxt * e).numpy().astype(np.int64), scores[order].numpy()


@pytest.mark.parametrize("experts_per_token", [1, 2])
def test_next_layer_lookahead_ranks_on_the_host_as_the_device_did(
    tiny: Any, experts_per_token: int
) -> None:
    # one token and top-1: most experts score 0 (dropped); a zero hidden
    # state gives every expert the same gate probability (ties keep id order)
    look = NextLayerLookahead(tiny.adapter, experts_per_token=experts_per_token)
    gen = torch.Generator().manual_seed(4)
    hidden_size = tiny.adapter.hidden_size
    with torch.no_grad():
        for rows in (1, 3, BLOCK):
            for hidden in (
                torch.randn(rows, hidden_size, generator=gen),
                torch.zeros(rows, hidden_size),
            ):
                for layer in range(tiny.layers - 1):
                    ids, scores = look.predict_next(layer, hidden)
                    ref_ids, ref_scores = _predict_next_on_device(look, layer, hidden)
                    assert ids.dtype == np.int64 and scores.dtype == np.float32
                    np.testing.assert_array_equal(ids, ref_ids)
                    np.testing.assert_array_equal(scores, ref_scores)
