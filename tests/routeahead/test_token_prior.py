"""TokenPriorPredictor: the token-conditioned route-ahead prior, its
pure-Python reference, and its replay over proxy traces."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

from pdflash._reference.tokenprior import TokenPriorReference
from pdflash.protocols import DraftedBlock, ExpertPredictor
from pdflash.routeahead import (
    CombinedPredictor,
    PreviousRoundPredictor,
    TokenPriorPredictor,
    predict_batch,
)

L, E, K, B = 3, 16, 2, 8


def _block(request_id: int, tokens: Any) -> DraftedBlock:
    ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
    return DraftedBlock(request_id, ids, torch.arange(ids.numel()))


def _routing_of(tokens: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """A deterministic token -> experts map: ``[T, L, K]``, distinct per row."""
    base = (tokens[:, None] * 5 + np.arange(L)[None, :] * 3) % E
    return np.stack([base, (base + 1 + tokens[:, None] % 3) % E], axis=-1)


def _union(topk: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
    mask = np.zeros((L, E), dtype=np.bool_)
    mask[np.arange(L)[None, :, None], topk] = True
    return mask


def test_satisfies_the_protocol_and_is_silent_before_learning() -> None:
    prior = TokenPriorPredictor(L, E)
    assert isinstance(prior, ExpertPredictor)
    scores = prior.predict(_block(0, [1, 2, 3]))
    assert scores.shape == (L, E) and scores.dtype == np.float32
    assert not (scores > 0).any()  # nothing learned: nothing predicted
    tokens = np.arange(B)
    prior.observe_tokens(tokens, _routing_of(tokens))
    both = prior.raw_scores([_block(0, []), _block(1, tokens)])
    assert not both[0].any() and both[1].max() > 0.5  # an empty block predicts nothing


def test_learns_the_token_to_expert_map_and_calibrates_to_the_floor() -> None:
    rng = np.random.default_rng(0)
    prior = TokenPriorPredictor(L, E, min_calibration=4 * E, precision_target=0.8)
    hits = predicted = routed = 0
    for step in range(60):
        tokens = rng.integers(0, 40, size=B)
        topk = _routing_of(tokens)
        needed = _union(topk)
        chosen = prior.predict(_block(0, tokens)) > 0
        if step >= 30:  # table and calibration warm
            hits += int((chosen & needed).sum())
            predicted += int(chosen.sum())
            routed += int(needed.sum())
        prior.observe(0, needed)
        prior.observe_tokens(tokens, topk)
    # routing is a function of the token: once learned, the prior is near exact
    assert predicted and hits / routed > 0.95 and hits / predicted >= 0.8


def test_precision_floor_trades_coverage_for_precision() -> None:
    def run(target: float) -> tuple[float, float]:
        rng = np.random.default_rng(1)  # the same routing for every target
        prior = TokenPriorPredictor(L, E, min_calibration=E, precision_target=target)
        h = p = u = 0
        for step in range(400):
            tokens = rng.integers(0, 40, size=B)
            topk = _routing_of(tokens)
            # noisy routing: half of the rows route a random pair instead
            noisy = rng.random(B) < 0.5
            topk[noisy] = np.argsort(rng.random((int(noisy.sum()), L, E)), axis=-1)[..., :K]
            needed = _union(topk)
            chosen = prior.predict(_block(0, tokens)) > 0
            if step >= 100:
                h += int((chosen & needed).sum())
                p += int(chosen.sum())
                u += int(needed.sum())
            prior.observe(0, needed)
            prior.observe_tokens(tokens, topk)
        return h / u, h / max(p, 1)

    low_cov, low_prec = run(0.7)
    high_cov, high_prec = run(0.85)
    assert high_prec > low_prec and high_cov < low_cov
    # the floor calibrated on past blocks holds on later ones, within a little
    assert low_prec >= 0.7 - 0.03 and high_prec >= 0.85 - 0.03


def test_predictions_never_see_the_routing_they_predict() -> None:
    """Scores for a block depend only on what was observed before it."""
    rng = np.random.default_rng(2)
    history = [rng.integers(0, 30, size=B) for _ in range(12)]

    def replay(last_routing_seed: int) -> list[npt.NDArray[np.float32]]:
        prior = TokenPriorPredictor(L, E, min_calibration=E)
        out = []
        for i, tokens in enumerate(history):
            out.append(prior.predict(_block(0, tokens)))
            topk = _routing_of(tokens)
            if i == len(history) - 1:  # a different "future" for the last block
                topk = np.argsort(
                    np.random.default_rng(last_routing_seed).random((B, L, E)), axis=-1
                )[..., :K]
            prior.observe(0, _union(topk))
            prior.observe_tokens(tokens, topk)
        out.append(prior.predict(_block(0, history[-1])))
        return out

    a, b = replay(10), replay(11)
    for before_a, before_b in zip(a[:-1], b[:-1], strict=True):
        np.testing.assert_array_equal(before_a, before_b)
    assert not np.array_equal(a[-1], b[-1])  # what it learned afterwards does change it


def test_raw_scores_equal_the_pure_python_reference() -> None:
    rng = np.random.default_rng(3)
    opts = dict(buckets=7, smoothing=1.5, request_decay=0.6, request_weight=0.4, count_cap=5)
    prior = TokenPriorPredictor(L, E, **opts)  # type: ignore[arg-type]
    ref = TokenPriorReference(L, E, **opts)  # type: ignore[arg-type]
    for step in range(25):
        tokens = rng.integers(0, 50, size=int(rng.integers(1, B + 1)))
        topk = np.argsort(rng.random((tokens.size, L, E)), axis=-1)[..., :K]
        rid = int(rng.integers(0, 3))
        # full blocks (one reshape-sum) and, every other step, ragged ones (segmented)
        sizes = [B, B, B] if step % 2 else [B, 1, int(rng.integers(2, B))]
        blocks = [_block(r, rng.integers(0, 50, size=n)) for r, n in enumerate(sizes)]
        got = prior.raw_scores(blocks)
        for r, block in enumerate(blocks):
            want = np.array(ref.raw_score(r, block.token_ids.tolist()), dtype=np.float64)
            np.testing.assert_allclose(got[r], want, rtol=2e-5, atol=2e-6, err_msg=f"step {step}")
        prior.observe_tokens(tokens, topk)
        ref.observe_tokens(tokens.tolist(), topk.tolist())
        routed = _union(topk)
        prior.observe(rid, routed)
        ref.observe(rid, routed.tolist())
    # the cap halved some rows: counts stay bounded by it
    assert int(prior._occurrences.max()) <= opts["count_cap"]


def test_bad_input_raises_and_leaves_the_table_unchanged() -> None:
    prior = TokenPriorPredictor(L, E)
    tokens = np.arange(4)
    prior.observe_tokens(tokens, _routing_of(tokens))
    before = (prior._counts.copy(), prior._occurrences.copy(), prior._layer_counts.copy())
    with pytest.raises(ValueError, match="topk_ids must be"):
        prior.observe_tokens(tokens, _routing_of(tokens)[:, :2])
    with pytest.raises(ValueError, match="out of range"):
        prior.observe_tokens(tokens, _routing_of(tokens) + E)
    with pytest.raises(ValueError, match="token ids must be >= 0"):
        prior.observe_tokens(-tokens - 1, _routing_of(tokens))
    with pytest.raises(ValueError, match="routed must have shape"):
        prior.observe(0, np.zeros((L, E + 1), dtype=np.bool_))
    after = (prior._counts, prior._occurrences, prior._layer_counts)
    for x, y in zip(before, after, strict=True):
        np.testing.assert_array_equal(x, y)
    for bad in (
        dict(buckets=0),
        dict(smoothing=0.0),
        dict(request_decay=1.0),
        dict(precision_target=0.0),
        dict(count_cap=70000),
    ):
        with pytest.raises(ValueError):
            TokenPriorPredictor(L, E, **bad)  # type: ignore[arg-type]


def test_forget_drops_request_state_and_the_table_is_bounded() -> None:
    prior = TokenPriorPredictor(L, E, buckets=64)
    assert prior.table_nbytes == 64 * L * E * 2 + 64 * 8
    tokens = np.arange(B)
    prior.predict(_block(5, tokens))
    prior.observe(5, _union(_routing_of(tokens)))
    prior.predict(_block(5, tokens))
    prior.forget(5)
    assert 5 not in prior._recent and 5 not in prior._pending


def test_combined_predictor_forwards_token_routing_to_its_members() -> None:
    from pdflash.routeahead.predictors import token_learners

    prior = TokenPriorPredictor(L, E)
    combo = CombinedPredictor([(prior, 1.0), (PreviousRoundPredictor(L, E), 0.5)])
    assert token_learners(combo) == [prior]
    assert token_learners(PreviousRoundPredictor(L, E)) == []
    tokens = np.arange(4)
    combo.observe_tokens(tokens, _routing_of(tokens))
    assert int(prior._occurrences.sum()) == 4
    assert predict_batch(combo, [_block(0, tokens)]).shape == (1, L, E)


# ---------------------------------------------------------------- the trace replay


def _synthetic_trace(requests: int = 4, rounds: int = 12, seed: int = 0) -> Any:
    """A valid proxy trace whose routing is a function of the token id."""
    from pdflash.traces import FORMAT, VERSION, ProxyTrace

    rng = np.random.default_rng(seed)
    prompt = 8
    tokens, offsets, verify_tokens, round_request, accepted, rows = [], [0], [], [], [], []
    for r in range(requests):
        out = [int(t) for t in rng.integers(0, 24, size=prompt + 1)]
        for _ in range(rounds):
            block = rng.integers(0, 24, size=B)
            block[0] = out[-1]
            acc = int(rng.integers(1, B + 1))
            verify_tokens.append(block)
            round_request.append(r)
            accepted.append(acc)
            rows.append(B)
            out += [int(t) for t in block[1:acc]] + [int(rng.integers(0, 24))]
        tokens += out
        offsets.append(len(tokens))
    all_tokens = np.array(tokens, dtype=np.uint16)
    vt = np.concatenate(verify_tokens).astype(np.uint16)
    prov = {
        "format": FORMAT,
        "version": VERSION,
        "num_experts": E,
        "top_k": K,
        "num_layers": L,
        "block_size": B,
        "temperature": 1.0,
        "target_weights_sha256": "synthetic",
        "drafter_weights_sha256": "synthetic",
        "target_preset": "synthetic",
        "prompts_source": "synthetic",
    }
    trace = ProxyTrace(
        tokens=all_tokens,
        token_request=np.array(offsets, dtype=np.int64),
        prompt_len=np.full(requests, prompt, dtype=np.int32),
        token_topk=_routing_of(all_tokens.astype(np.int64)).astype(np.uint8),
        round_request=np.array(round_request, dtype=np.int32),
        round_accepted=np.array(accepted, dtype=np.int16),
        round_rows=np.array(rows, dtype=np.int16),
        verify_topk=_routing_of(vt.astype(np.int64)).astype(np.uint8),
        verify_tokens=vt,
        provenance=prov,
    )
    trace.validate()
    return trace


def test_trace_rounds_interleave_requests_in_engine_steps() -> None:
    from pdflash.bench.suites.routeahead_trace import trace_rounds

    trace = _synthetic_trace(requests=3, rounds=2)
    assert trace_rounds(trace, "interleaved") == [[0, 2, 4], [1, 3, 5]]
    assert trace_rounds(trace, "sequential") == [[0], [1], [2], [3], [4], [5]]
    with pytest.raises(ValueError, match="order"):
        trace_rounds(trace, "random")


def test_hindsight_curve_by_hand() -> None:
    from pdflash.bench.suites.routeahead_trace import hindsight_curve

    scores = np.array([0.9, 0.8, 0.7, 0.6, 0.5], dtype=np.float32)
    needed = np.array([True, True, False, True, False])
    curve = hindsight_curve(scores, needed, (0.7, 0.8, 0.9))
    # thresholds keep 1..5 experts: (cov, prec) = (1/3, 1), (2/3, 1), (2/3, 2/3), (1, 3/4), (1, 3/5)
    assert curve["coverage_at_precision_0.7"] == pytest.approx(1.0)
    assert curve["coverage_at_precision_0.8"] == pytest.approx(2 / 3)
    assert curve["coverage_at_precision_0.9"] == pytest.approx(2 / 3)
    assert curve["precision_at_coverage_0.9"] == pytest.approx(0.75)
    # tied scores cannot be split by a threshold
    tied = hindsight_curve(np.ones(4, np.float32), np.array([1, 0, 0, 0], bool), (0.5,))
    assert tied["coverage_at_precision_0.5"] == 0.0


def test_trace_replay_scores_the_history_predictors(tmp_path: Any) -> None:
    from pdflash.bench import cli
    from pdflash.bench.suites import routeahead

    from pdflash.traces import save_trace

    path = save_trace(_synthetic_trace(), tmp_path / "t.npz")
    args = cli.build_parser().parse_args(
        [
            *("routeahead", "--skip-predictors", "--trace", str(path)),
            *("--requests", "4", "--layers", "2", "--experts", "16", "--native-reps", "1"),
            "--reference-reps",
            "1",
        ]
    )
    res = routeahead.run(args)
    json.dumps(res)  # the report is plain JSON
    by_order = res["trace_predictors"][str(path)]
    assert set(by_order) == {"interleaved", "sequential"}
    for order, rep in by_order.items():
        assert rep["blocks_scored"] == 4 * 11, order  # every request's first round unscored
        rows = rep["predictors"]
        assert {"previous_round", "frequency_prior", "token_prior"} <= set(rows)
        token = rows["token_prior"]
        # routing is a function of the token id: full coverage, and the
        # calibration spends precision down to its floor (0.82) on nothing more
        assert token["coverage"] > 0.95 and token["precision"] >= 0.8
        assert token["coverage"] > rows["previous_round"]["coverage"]
        assert set(token["layer_groups"]) == {"early", "middle", "late"}
        assert len(token["per_layer"]) == L
        assert token["hindsight"]["coverage_at_precision_0.8"] > 0.9
        rec = rep["recommendation"]
        assert rec["trust"] in rows and rec["meets_target"]
        assert rows[rec["trust"]]["coverage"] >= token["coverage"]


def test_trace_replay_sizes_are_per_scored_block_in_either_order() -> None:
    """``predicted/routed_per_block_layer`` are per scored block: an
    interleaved step scores every live request's block in one update, so
    dividing by the steps overstated them by the blocks per step."""
    from pdflash.bench.suites.routeahead_trace import score_trace

    trace = _synthetic_trace(requests=4, rounds=12)
    offsets = np.concatenate([[0], np.cumsum(trace.round_rows.astype(np.int64))])
    first = {int(np.flatnonzero(trace.round_request == r)[0]) for r in range(4)}
    sizes = [
        _union(trace.verify_topk[offsets[i] : offsets[i + 1]].astype(np.int64)).sum() / L
        for i in range(trace.round_request.size)
        if i not in first  # a request's first round is not scored
    ]
    for order in ("interleaved", "sequential"):
        rows = score_trace(trace, order=order)["predictors"]
        assert rows["previous_round"]["routed_per_block_layer"] == pytest.approx(
            float(np.mean(sizes))
        ), order
        for name, row in rows.items():
            assert row["predicted_per_block_layer"] <= E, (order, name)


COMMITTED = Path(__file__).resolve().parents[2] / "bench" / "results" / "h200"
#: (proxy folder, trace, order) -> predictor -> (coverage, precision), as
#: bench/results/cpu/tokenprior-2026-12-01/README.md states them
README_FIGURES = {
    ("proxy-2026-12-01", "trace_gpu_t1.npz", "interleaved"): {
        "token_prior": (0.926, 0.816),
        "frequency_prior": (0.862, 0.801),
        "previous_round": (0.834, 0.830),
    },
    ("proxy-2026-12-01", "trace_gpu_greedy.npz", "interleaved"): {
        "token_prior": (0.946, 0.820),
        "frequency_prior": (0.891, 0.705),
        "previous_round": (0.852, 0.849),
    },
    ("proxy-balanced-2026-12-01", "trace_gpu_t1.npz", "interleaved"): {
        "token_prior": (0.550, 0.820),
        "frequency_prior": (0.343, 0.637),
        "previous_round": (0.642, 0.638),
    },
    ("proxy-balanced-2026-12-01", "trace_gpu_greedy.npz", "interleaved"): {
        "token_prior": (0.748, 0.827),
        "frequency_prior": (0.389, 0.506),
        "previous_round": (0.704, 0.700),
    },
}


@pytest.mark.parametrize("key", sorted(README_FIGURES))
def test_committed_trace_replay_reproduces_the_readme(key: tuple[str, str, str]) -> None:
    from pdflash.bench.suites.routeahead_trace import score_trace

    from pdflash.traces import load_trace

    folder, name, order = key
    path = COMMITTED / folder / name
    if not path.is_file():
        pytest.skip(f"{folder}/{name} is not in this checkout")
    rep = score_trace(load_trace(path), order=order)
    for predictor, (coverage, precision) in README_FIGURES[key].items():
        row = rep["predictors"][predictor]
        assert (round(row["coverage"], 3), round(row["precision"], 3)) == (coverage, precision)


def test_warmup_texts_never_repeat_a_scored_text() -> None:
    from pdflash.bench.suites.routeahead import distinct_warmup

    scored = [[1, 2], [3, 4]]
    # a source with 3 windows asked for 6 wraps around: 3 4 | 5 6 1 2 3 4
    assert distinct_warmup(scored, [[5, 6], [1, 2], [3, 4], [5, 6]]) == [[5, 6]]
    assert distinct_warmup(scored, []) == []
