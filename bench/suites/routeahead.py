"""``pdflash-bench routeahead``: route-ahead bookkeeping speed and predictor quality.

Two parts, both on synthetic inputs (labelled ``"synthetic": true``):

1. **accumulator** — one verify step of 256 requests x 16 tokens x top-8 over
   48 layers x 128 experts: the native accumulator against the pure-Python
   reference (``speedup``) and against a vectorized numpy version of the same
   step (``speedup_vs_numpy``), timed side by side in this run (medians),
   plus checks that all three produce the same counters on the same step. Routing is synthetic with
   realistic overlap: per layer a Zipf-like expert popularity, per request a
   persistent affinity, per token Gumbel noise (top-k of the sum); the
   prediction is the same model with independent noise.
2. **predictors** — each predictor on tiny random-weight models of the four
   architectures (``pdflash.models`` synthetic checkpoints written to a temp
   dir, read through ``pdflash.models`` adapters), scored against the
   routing captured from the transformers forward of the same checkpoint
   over one random sequence of 16-token blocks: ``coverage``, ``precision``
   and ``predict_us`` (median per block).

   With ``--weights DIR`` (a trained checkpoint, e.g. the proxy target) the
   predictors are scored on its learned routing instead: ``--sequences``
   held-out texts (``--prompts``, default the checkpoint's held-out ``eval``
   split) of ``--blocks-per-sequence`` blocks, teacher-forced (one fp32
   transformers forward per text), with a per-layer summary, the predictor
   PD's engine uses before a verify (``pd_engine_union``) and a computed
   ``recommendation``: the source PD should trust (coverage >= 0.9 at
   precision >= 0.8, else the best trade-off). Rows say ``"synthetic": false``.
   ``--prior-warmup-sequences N`` more texts are routed first and only
   learned from (frequency prior, token prior).
3. **trace** (``--trace A.npz[,B.npz]``) — the history-based predictors
   (previous round, frequency prior, token prior) replayed over a proxy
   trace's verify rounds (:mod:`.routeahead_trace`): learned routing without
   weights, per ``--trace-order`` (interleaved / sequential steps).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

ARCHS = ("qwen3_moe", "gpt_oss", "mixtral", "olmoe")
HELP = "route-ahead: native vs reference bookkeeping speed; predictor coverage/precision"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=16, help="tokens per request (block)")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--native-reps", type=int, default=30)
    parser.add_argument("--reference-reps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--device",
        default="auto",
        help="torch device for the predictor part (auto: cuda if present)",
    )
    parser.add_argument("--skip-predictors", action="store_true")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=0,
        help="torch intra-op threads for the predictor part (0: 1 on CPU, torch's default on CUDA)",
    )
    parser.add_argument(
        "--weights",
        default=None,
        help="a trained checkpoint (e.g. the proxy target): score the predictors on its learned "
        "routing over held-out text instead of the synthetic models",
    )
    parser.add_argument(
        "--prompts",
        default=None,
        help="with --weights: 'heldout[:ROLE]' (default), a trace .npz or a text file",
    )
    parser.add_argument("--sequences", type=int, default=16, help="with --weights: texts scored")
    parser.add_argument(
        "--blocks-per-sequence", type=int, default=8, help="with --weights: blocks per text"
    )
    parser.add_argument(
        "--prior-warmup-sequences",
        type=int,
        default=0,
        help="with --weights: texts (after the scored ones, disjoint) whose routing the "
        "history-based predictors learn from before scoring (earlier traffic); 0: none",
    )
    parser.add_argument(
        "--trace",
        default=None,
        help="comma-separated proxy trace .npz files: replay their verify rounds to score the "
        "history-based predictors (previous_round, frequency_prior, token_prior) on learned "
        "routing without weights",
    )
    parser.add_argument(
        "--trace-order",
        default="interleaved,sequential",
        help="with --trace: comma-separated step orders (interleaved: every request's next "
        "round per step; sequential: one request after another)",
    )
    parser.add_argument(
        "--predictor-archs",
        default=",".join(ARCHS),
        help="comma-separated architectures for the predictor part (first = headline)",
    )


# ----------------------------------------------------------------------------
# Part 1: the accumulator
# ----------------------------------------------------------------------------


def _gumbel_topk(
    logits: npt.NDArray[np.float32], k: int, rng: np.random.Generator
) -> npt.NDArray[np.int64]:
    noisy = logits + rng.gumbel(size=logits.shape).astype(np.float32)
    return np.argpartition(-noisy, k - 1, axis=-1)[..., :k].astype(np.int64)


def synthetic_step(
    requests: int, tokens: int, top_k: int, layers: int, experts: int, seed: int
) -> dict[str, Any]:
    """Routed top-k ids ``(L, R*T, k)``, routed/predicted masks ``(R, L, E)``
    and a resident mask ``(L, E)`` (the more popular half of each layer)."""
    rng = np.random.default_rng(seed)
    ranks = np.argsort(rng.random((layers, experts)), axis=1)
    log_pop = (-1.0 * np.log1p(ranks)).astype(np.float32)  # Zipf-like popularity
    affinity = rng.normal(0.0, 1.0, (requests, layers, experts)).astype(np.float32)
    topk = np.empty((layers, requests * tokens, top_k), dtype=np.int64)
    routed = np.zeros((requests, layers, experts), dtype=np.bool_)
    predicted = np.zeros_like(routed)
    r_idx = np.repeat(np.arange(requests), tokens)
    for layer in range(layers):
        base = log_pop[layer][None, :] + affinity[:, layer, :]  # (R, E)
        per_token = np.repeat(base, tokens, axis=0)  # (R*T, E)
        ids = _gumbel_topk(per_token, top_k, rng)
        topk[layer] = ids
        routed[r_idx[:, None], layer, ids] = True
        guess = _gumbel_topk(per_token, top_k, rng)  # same tendencies, other noise
        predicted[r_idx[:, None], layer, guess] = True
    resident = ranks < experts // 2
    owner = r_idx.astype(np.int64)
    return {
        "topk": topk,
        "owner": owner,
        "routed": routed,
        "predicted": predicted,
        "resident": resident,
    }


def _median_us(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm-up: first-call allocations are not part of a step
    times = []
    for _ in range(reps):
        start = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1e3


class NumpyAccumulator:
    """The same step as the native accumulator in vectorized numpy (uniform
    expert size only): a second yardstick, stronger than the pure-Python
    reference. Its counters are checked against the native ones."""

    def __init__(self, layers: int, experts: int, nbytes: int, decay: float) -> None:
        from pdflash_native import _routeahead

        self.names = _routeahead.COUNTER_NAMES
        self.counts = {n: np.zeros(layers, dtype=np.int64) for n in self.names}
        self.freq = np.zeros((layers, experts), dtype=np.float32)
        self.pending = np.zeros((layers, experts), dtype=np.bool_)
        self.nbytes, self.decay = nbytes, np.float32(decay)

    def _add(self, name: str, mask: Any, axes: tuple[int, ...]) -> None:
        n = np.asarray(mask).sum(axis=axes)
        self.counts[name] += n
        self.counts[name + "_bytes"] += n * self.nbytes

    def update(
        self,
        p: npt.NDArray[np.bool_],
        u: npt.NDArray[np.bool_],
        res: npt.NDArray[np.bool_],
    ) -> None:
        req = (0, 2)
        self._add("req_predicted", p, req)
        self._add("req_routed", u, req)
        self._add("req_hits", p & u, req)
        self._add("req_wasted", p & ~u, req)
        self._add("req_missed", u & ~p, req)
        bp, bu = p.any(axis=0), u.any(axis=0)
        issued = bp & ~res
        one = (1,)
        for name, mask in (
            ("predicted", bp),
            ("routed", bu),
            ("hits", bp & bu),
            ("wasted", bp & ~bu),
            ("missed", bu & ~bp),
            ("resident_routed", bu & res),
            ("prefetch_issued", issued),
            ("prefetch_used", issued & bu),
            ("prefetch_unused", issued & ~bu),
            ("demand_loads", bu & ~bp & ~res),
            ("late_used", self.pending & bu),
        ):
            self._add(name, mask, one)
        self.pending = (self.pending & ~bu) | (issued & ~bu)
        self.freq = self.freq * self.decay + u.sum(axis=0, dtype=np.int32).astype(np.float32)

    def counters(self) -> npt.NDArray[np.int64]:
        return np.stack([self.counts[n] for n in self.names])


def bench_accumulator(args: argparse.Namespace) -> dict[str, Any]:
    from pdflash._reference.routeahead import RouteAheadReference
    from pdflash.routeahead import RouteAheadStats, pack_masks, routed_bitsets_from_topk

    L, E = args.layers, args.experts
    step = synthetic_step(args.requests, args.tokens, args.top_k, L, E, args.seed)
    nbytes = 3 * 2048 * 768 * 2  # a Qwen3-30B-A3B-sized bf16 expert; any size works
    pred, routed, resident = step["predicted"], step["routed"], step["resident"]

    # correctness on this very step first: the same counters from both
    native = RouteAheadStats(L, E, nbytes)
    reference = RouteAheadReference(L, E, nbytes, 0.9)
    native.update(pred, routed, resident)
    reference.update_masks(pred, routed, resident)
    agree = bool((native._acc.counters() == reference.counters()).all())
    snap = native.snapshot()

    timed = RouteAheadStats(L, E, nbytes)
    native_us = _median_us(lambda: timed.update(pred, routed, resident), args.native_reps)
    pred_bits, resident_bits = pack_masks(pred), pack_masks(resident)
    routed_bits = pack_masks(routed)
    bitsets_us = _median_us(
        lambda: timed.update_bitsets(pred_bits, routed_bits, resident_bits), args.native_reps
    )

    def from_topk() -> None:
        bits = routed_bitsets_from_topk(step["topk"], step["owner"], args.requests, E)
        timed.update_bitsets(pack_masks(pred), bits, resident_bits)

    topk_us = _median_us(from_topk, args.native_reps)
    vectorized = NumpyAccumulator(L, E, nbytes, 0.9)
    vectorized.update(pred, routed, resident)
    numpy_agrees = bool((vectorized.counters() == native._acc.counters()).all())
    numpy_us = _median_us(lambda: vectorized.update(pred, routed, resident), args.native_reps)
    slow = RouteAheadReference(L, E, nbytes, 0.9)
    reference_us = _median_us(
        lambda: slow.update_masks(pred, routed, resident), args.reference_reps
    )
    return {
        "synthetic": True,
        "routing": "Zipf-like popularity + per-request affinity + per-token Gumbel noise",
        "requests": args.requests,
        "tokens_per_request": args.tokens,
        "top_k": args.top_k,
        "layers": L,
        "experts": E,
        "native_us_per_step": native_us,
        "reference_us_per_step": reference_us,
        "speedup": reference_us / native_us,
        "native_bitsets_us_per_step": bitsets_us,
        "native_from_topk_us_per_step": topk_us,
        "native_reps": args.native_reps,
        "reference_reps": args.reference_reps,
        "native_equals_reference": agree,
        "numpy_us_per_step": numpy_us,
        "speedup_vs_numpy": numpy_us / native_us,
        "numpy_equals_native": numpy_agrees,
        "mean_routed_per_request_layer": float(routed.sum(axis=2).mean()),
        "mean_routed_union_per_layer": float(routed.any(axis=0).sum(axis=1).mean()),
        "synthetic_prediction": snap.request.to_json(),
    }


# ----------------------------------------------------------------------------
# Part 2: predictors on a tiny random-weight model
# ----------------------------------------------------------------------------

TINY = dict(layers=8, experts=64, top_k=4, blocks=16, block=16)
_EXPERT_COUNT_KEY = {
    "qwen3_moe": "num_experts",
    "olmoe": "num_experts",
    "mixtral": "num_local_experts",
    "gpt_oss": "num_local_experts",
}


def _capture(model: Any, router_attr: str, ids: Any) -> tuple[list[Any], list[Any]]:
    """Routed top-k ids ``[T, k]`` and the residual after each layer ``[T, H]``
    from the transformers forward (hooks on the router modules)."""
    import torch

    routed: list[Any] = []
    outs: list[Any] = []
    hooks = []

    def on_router(_m: Any, _a: Any, output: Any) -> None:
        routed.append(output[2].clone())

    def on_layer(_m: Any, _a: Any, output: Any) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        outs.append(hidden.reshape(-1, hidden.shape[-1]).clone())

    for layer in model.model.layers:
        hooks.append(getattr(layer.mlp, router_attr).register_forward_hook(on_router))
        hooks.append(layer.register_forward_hook(on_layer))
    try:
        with torch.inference_mode():
            model(input_ids=ids[None, :], use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return [r.reshape(-1, r.shape[-1]) for r in routed], outs


def bench_predictors_on(
    arch: str, root: str, device: str, seed: int, batch_blocks: int
) -> dict[str, Any]:
    """Every predictor on one tiny synthetic checkpoint of ``arch``."""
    import torch
    from transformers import AutoModelForCausalLM

    from pdflash.models import load_adapter, write_synthetic_checkpoint

    L, E, K, B = TINY["layers"], TINY["experts"], TINY["top_k"], TINY["block"]
    path = write_synthetic_checkpoint(
        f"{root}/{arch}",
        arch,
        "tiny",
        num_layers=L,
        dtype=torch.float32,
        seed=seed,
        config_overrides={_EXPERT_COUNT_KEY[arch]: E, "num_experts_per_tok": K},
    )
    adapter = load_adapter(path, device=device, dtype=torch.float32)
    resident = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    )
    resident = resident.eval().to(device)
    gen = torch.Generator().manual_seed(seed + 1)
    vocab = int(adapter.vocab_size)
    sequence = torch.randint(3, vocab, (TINY["blocks"] * B,), generator=gen).to(device)
    try:
        scored = score_predictors(adapter, resident, [sequence], device, B, batch_blocks)
    finally:
        adapter.close()
    return scored["predictors"]


def score_predictors(
    adapter: Any,
    resident: Any,
    sequences: list[Any],
    device: str,
    block_len: int,
    batch_blocks: int,
    warmup: list[Any] | None = None,
) -> dict[str, Any]:
    """Every predictor over ``block_len``-token blocks of each sequence (a
    1-D id tensor on ``device``), scored against the routing of one
    transformers forward of the sequence (teacher-forced: the block's tokens
    are the ones a fully accepted draft would verify). Stateful predictors
    see each sequence as one request; its first block is not scored; they
    learn from a block's routing only after it was scored. ``warmup``
    sequences (disjoint from ``sequences``) are routed first and only
    learned from (earlier traffic of a serving engine).
    Returns ``{"predictors": {name: figures}, "per_layer": {name: [..]}}``."""
    import torch

    from pdflash.engine.predict import BatchedUnionPredictor
    from pdflash.protocols import DraftedBlock, ExpertPredictor
    from pdflash.routeahead import (
        ApproxRouterPredictor,
        CombinedPredictor,
        FrequencyPriorPredictor,
        NextLayerLookahead,
        PreviousRoundPredictor,
        RouteAheadStats,
        TokenPriorPredictor,
    )

    L, E, K, B = (
        int(adapter.num_layers),
        int(adapter.num_experts),
        int(adapter.top_k),
        block_len,
    )
    nbytes = int(adapter.expert_nbytes)
    freq_stats = RouteAheadStats(L, E, nbytes, decay=0.9)
    previous = PreviousRoundPredictor(L, E)
    approx = ApproxRouterPredictor(adapter, proxy="embed")
    frequency = FrequencyPriorPredictor(freq_stats, per_layer=2 * B)
    # NOTE: the combined predictor may prefetch half of the model's experts per
    # block; it ranks the union of its members and keeps the best that fit.
    budget = (L * E // 2) * nbytes
    token_prior = TokenPriorPredictor(L, E)
    predictors: dict[str, ExpertPredictor] = {
        "approx_router": approx,
        "approx_router_wide": ApproxRouterPredictor(
            adapter, proxy="embed", experts_per_token=2 * K, name="approx_router_wide"
        ),
        "approx_block_attention": ApproxRouterPredictor(
            adapter, proxy="block_attention", name="approx_block_attention"
        ),
        "previous_round": previous,
        "frequency_prior": frequency,
        # the same budget for the approximate router alone: the yardstick for "combined"
        "approx_router_budget": CombinedPredictor(
            [(approx, 1.0)], expert_nbytes=nbytes, byte_budget=budget, name="approx_router_budget"
        ),
        # NOTE: weights picked on synthetic models (agreement with the
        # previous round / the prior breaks ties among the router's guesses)
        "combined": CombinedPredictor(
            [(approx, 1.0), (previous, 0.15), (frequency, 0.05)],
            expert_nbytes=nbytes,
            byte_budget=budget,
        ),
        # what PD's engine predicts before a verify (engine_run), minus the
        # drafter-hidden proxy (no drafter here: the embedding proxy instead)
        "pd_engine_union": BatchedUnionPredictor(
            [(approx, 1.0), (previous, 0.5)], name="pd_engine_union"
        ),
        # token id -> experts learned online from the routed rows of earlier
        # blocks (the engine's ``--route-ahead-source token_prior``)
        "token_prior": token_prior,
    }

    names = [*predictors, "next_layer"]
    stats = {name: RouteAheadStats(L, E, nbytes) for name in names}
    times: dict[str, list[float]] = {name: [] for name in names}
    look = NextLayerLookahead(adapter)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    warm = DraftedBlock(1 << 30, sequences[0][:B], torch.arange(B, device=device))
    for predictor in predictors.values():  # warm-up: lazy init is not a prediction
        predictor.predict(warm)
        predictor.forget(1 << 30)
    router_attr = type(adapter).router_attr
    for warm_index, sequence in enumerate(warmup or []):
        # earlier traffic, never scored: the token learners predict each block
        # (their calibration learns from it, as in an engine) and learn its routing
        request = -1 - warm_index
        routed_ids, _ = _capture(resident, router_attr, sequence)
        topk = torch.stack(routed_ids, dim=1).cpu().numpy()  # [T, L, k]
        tokens = sequence.cpu().numpy()
        for index in range(int(sequence.numel()) // B):
            rows = slice(index * B, (index + 1) * B)
            block = DraftedBlock(
                request, sequence[rows], torch.arange(rows.start, rows.stop, device=device)
            )
            routed = np.zeros((L, E), dtype=np.bool_)
            routed[np.arange(L)[None, :, None], topk[rows]] = True
            token_prior.predict(block)
            token_prior.observe(request, routed)
            token_prior.observe_tokens(tokens[rows], topk[rows])
            freq_stats.update(np.zeros_like(routed), routed)
        token_prior.forget(request)
    for seq_index, sequence in enumerate(sequences):
        routed_ids, layer_out = _capture(resident, router_attr, sequence)
        seq_topk = torch.stack(routed_ids, dim=1).cpu().numpy()  # [T, L, k]
        seq_tokens = sequence.cpu().numpy()
        look.predict_next(0, layer_out[0][:B])
        for index in range(int(sequence.numel()) // B):
            rows = slice(index * B, (index + 1) * B)
            block = DraftedBlock(
                seq_index, sequence[rows], torch.arange(rows.start, rows.stop, device=device)
            )
            routed = np.zeros((L, E), dtype=np.bool_)
            for layer in range(L):
                ids = routed_ids[layer][rows]
                routed[layer, ids.reshape(-1).long().cpu().numpy()] = True
            for name, predictor in predictors.items():
                sync()
                start = time.perf_counter_ns()
                scores = predictor.predict(block)  # returns host numpy: includes the sync
                times[name].append((time.perf_counter_ns() - start) / 1e3)
                if index > 0:  # stateful predictors know nothing before block 0
                    stats[name].update(np.asarray(scores) > 0, routed)
            nxt = np.zeros((L, E), dtype=np.bool_)
            sync()
            start = time.perf_counter_ns()
            for layer in range(L - 1):
                flat, _ = look.predict_next(layer, layer_out[layer][rows])
                nxt.reshape(-1)[flat] = True
            times["next_layer"].append((time.perf_counter_ns() - start) / 1e3)
            # layer 0 has no previous layer: the lookahead is scored on layers 1..L-1
            later = routed.copy()
            later[0] = False
            stats["next_layer"].update(nxt, later)
            # (the engine union's stateful member is ``previous`` itself)
            previous.observe(seq_index, routed)
            token_prior.observe(seq_index, routed)
            token_prior.observe_tokens(seq_tokens[rows], seq_topk[rows])
            freq_stats.update(np.zeros_like(routed), routed)
    out: dict[str, Any] = {}
    per_layer: dict[str, list[dict[str, Any]]] = {}
    for name, st in stats.items():
        snap = st.snapshot()
        row = snap.request.to_json()
        out[name] = {
            "coverage": row["coverage"],
            "precision": row["precision"],
            "predict_us": statistics.median(times[name]),
            "predict_us_min": min(times[name]),
            "predicted_per_block": snap.request.predicted / snap.steps if snap.steps else None,
            "routed_per_block": snap.request.routed / snap.steps if snap.steps else None,
            "blocks_scored": snap.steps,
        }
        reasons: dict[str, str] = dict(row.get("not_measured") or {})  # type: ignore[call-overload]
        if not snap.steps:
            reasons["predicted_per_block"] = reasons["routed_per_block"] = "no block scored"
        if reasons:
            out[name]["not_measured"] = reasons
        per_layer[name] = [
            {
                "layer": layer,
                "coverage": counts.to_json()["coverage"],
                "precision": counts.to_json()["precision"],
            }
            for layer, counts in enumerate(snap.request_layers)
        ]
    # the engine's per-step call: one batched pass over every request's block
    first = sequences[0]
    nblocks = max(1, int(first.numel()) // B)
    many = [
        DraftedBlock(r, first[(r % nblocks) * B :][:B], torch.arange(B, device=device) + r)
        for r in range(batch_blocks)
    ]
    for name in ("approx_router", "approx_block_attention"):
        batched = predictors[name]
        assert isinstance(batched, ApproxRouterPredictor)
        batched.predict_batch(many)  # warm-up
        laps = []
        for _ in range(3):
            sync()
            start = time.perf_counter_ns()
            batched.predict_batch(many)
            laps.append((time.perf_counter_ns() - start) / 1e3)
        out[name]["predict_batch_us"] = statistics.median(laps)
        out[name]["predict_batch_blocks"] = batch_blocks
    return {"predictors": out, "per_layer": per_layer}


#: route-ahead target (issue 14): coverage and precision of the source PD
#: uses before a verify
TARGET_COVERAGE = 0.9
TARGET_PRECISION = 0.8


def recommend(predictors: dict[str, Any]) -> dict[str, Any]:
    """Which measured source PD should trust before a verify, and why: the
    predictor of highest coverage among those reaching coverage >=
    :data:`TARGET_COVERAGE` at precision >= :data:`TARGET_PRECISION`; when
    none does, the best trade-off (largest ``min(coverage / 0.9, precision /
    0.8)``, the fraction of the target it reaches on its weaker side).
    ``next_layer`` is excluded: it predicts during the forward, not before."""
    scored = {
        name: (row["coverage"], row["precision"])
        for name, row in predictors.items()
        if name != "next_layer"
        and isinstance(row.get("coverage"), (int, float))
        and isinstance(row.get("precision"), (int, float))
    }
    target = f"coverage >= {TARGET_COVERAGE} at precision >= {TARGET_PRECISION}"
    if not scored:
        return {"trust": None, "target": target, "reason": "no predictor could be scored"}
    meets = {
        n: cp for n, cp in scored.items() if cp[0] >= TARGET_COVERAGE and cp[1] >= TARGET_PRECISION
    }
    if meets:
        best = max(meets, key=lambda n: (meets[n][0], meets[n][1]))
        cov, prec = meets[best]
        return {
            "trust": best,
            "meets_target": True,
            "target": target,
            "reaching_target": sorted(meets),
            "reason": f"{best} reaches the target with the highest coverage "
            f"({cov:.3f} at precision {prec:.3f})",
        }

    def closeness(n: str) -> float:
        cov, prec = scored[n]
        return min(cov / TARGET_COVERAGE, prec / TARGET_PRECISION)

    best = max(scored, key=closeness)
    cov, prec = scored[best]
    return {
        "trust": best,
        "meets_target": False,
        "target": target,
        "reaching_target": [],
        "reason": f"none reaches the target; best trade-off {best}: coverage {cov:.3f}, "
        f"precision {prec:.3f} ({closeness(best):.2f} of the target on its weaker side)",
    }


def distinct_warmup(scored: list[list[int]], warmup: list[list[int]]) -> list[list[int]]:
    """The warm-up texts that repeat neither a scored text nor an earlier
    warm-up text (a prompt source with too few windows wraps around; a
    predictor must not learn the routing of a text it is scored on)."""
    seen = {tuple(t) for t in scored}
    out = []
    for text in warmup:
        key = tuple(text)
        if key not in seen:
            seen.add(key)
            out.append(text)
    return out


def bench_predictors_learned(args: argparse.Namespace) -> dict[str, Any]:
    """Every predictor on a trained checkpoint (``--weights``) over
    teacher-forced blocks of held-out text (``--prompts``, default the
    checkpoint's held-out ``eval`` split)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pdflash.models import load_adapter

    from ..realtext import load_prompts

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    weights = str(args.weights)
    B = args.tokens
    window = B * args.blocks_per_sequence
    adapter = load_adapter(weights, device=device, dtype=torch.float32)
    try:
        if args.prior_warmup_sequences < 0:
            raise SystemExit("--prior-warmup-sequences must be >= 0")
        prompts = load_prompts(
            args.prompts or "heldout",
            [window] * (args.sequences + args.prior_warmup_sequences),
            int(adapter.vocab_size),
            weights,
        )
        resident = AutoModelForCausalLM.from_pretrained(
            weights,
            dtype=torch.float32,
            attn_implementation="eager",
            experts_implementation="eager",
        )
        resident = resident.eval().to(device)
        scored_texts = prompts.prompts[: args.sequences]
        warm_texts = distinct_warmup(scored_texts, prompts.prompts[args.sequences :])
        seqs = [torch.tensor(p, dtype=torch.int64, device=device) for p in scored_texts]
        warmup = [torch.tensor(p, dtype=torch.int64, device=device) for p in warm_texts]
        scored = score_predictors(adapter, resident, seqs, device, B, args.requests, warmup)
    finally:
        adapter.close()
    provenance = {}
    prov_file = Path(weights) / "provenance.json"
    if prov_file.is_file():
        prov = json.loads(prov_file.read_text())
        provenance = {k: prov.get(k) for k in ("preset", "steps", "final_heldout_loss", "device")}
    return {
        "synthetic": False,
        "weights": weights,
        "weights_provenance": provenance,
        "routing": "learned: the checkpoint's routers over held-out text, one fp32 transformers "
        "forward per sequence (teacher-forced blocks)",
        "prompts_source": prompts.source,
        "device": device,
        "torch_threads": torch.get_num_threads(),
        "layers": int(adapter.num_layers),
        "experts": int(adapter.num_experts),
        "top_k": int(adapter.top_k),
        "block": B,
        "sequences": len(seqs),
        "blocks_per_sequence": args.blocks_per_sequence,
        "prior_warmup_sequences": len(warmup),
        "prior_warmup_requested": args.prior_warmup_sequences,
        "combined_byte_budget": "half of the model's experts per block",
        "predictors": scored["predictors"],
        "per_layer": scored["per_layer"],
        "recommendation": recommend(scored["predictors"]),
    }


def bench_predictors(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    threads = args.torch_threads
    if threads == 0 and device == "cpu":
        # NOTE: a tiny model's ops are latency-bound; intra-op threads only add
        # synchronisation (and, on a shared machine, wait for busy cores).
        threads = 1
    if threads > 0:
        torch.set_num_threads(threads)
    archs = [a for a in args.predictor_archs.split(",") if a]
    for arch in archs:
        if arch not in ARCHS:
            raise SystemExit(f"--predictor-archs: unknown arch {arch!r}; choose from {ARCHS}")
    with tempfile.TemporaryDirectory(prefix="pdflash-routeahead-") as root:
        by_arch: dict[str, dict[str, Any]] = {}
        for arch in archs:
            # NOTE: one arch failing (say, on a new device) must not hide the
            # others; its row says why it was not measured.
            try:
                by_arch[arch] = bench_predictors_on(arch, root, device, args.seed, args.requests)
            except Exception as exc:
                by_arch[arch] = {"not_measured": f"{type(exc).__name__}: {exc}"}
    return {
        "synthetic": True,
        "model": "pdflash.models synthetic 'tiny' checkpoints (random weights), "
        "scored against the transformers forward of the same checkpoint over one "
        "sequence of 16-token blocks (routing depends on context the predictors do not see)",
        "device": device,
        "torch_threads": torch.get_num_threads(),
        **TINY,
        "combined_byte_budget": "half of the model's experts per block",
        "by_arch": by_arch,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pdflash_native import _build_info

    acc = bench_accumulator(args)
    result: dict[str, Any] = {
        "suite": "routeahead",
        "native_us_per_step": acc["native_us_per_step"],
        "reference_us_per_step": acc["reference_us_per_step"],
        "speedup": acc["speedup"],
        "accumulator": acc,
        "build": _build_info.summary(),
    }
    traces = [t for t in (getattr(args, "trace", None) or "").split(",") if t]
    if traces:
        from pdflash.traces import load_trace

        from .routeahead_trace import score_trace

        orders = [o for o in args.trace_order.split(",") if o]
        result["trace_predictors"] = {
            path: {order: score_trace(load_trace(path), order=order) for order in orders}
            for path in traces
        }
        for by_order in result["trace_predictors"].values():
            for rep in by_order.values():
                rep["recommendation"] = recommend(rep["predictors"])
    if getattr(args, "weights", None):
        learned = bench_predictors_learned(args)
        result["predictors"] = learned["predictors"]
        result["recommendation"] = learned["recommendation"]
        result["predictor_model"] = learned
    elif not args.skip_predictors:
        model = bench_predictors(args)
        # headline: the first arch measured; every arch under predictor_model.by_arch
        measured = [row for row in model["by_arch"].values() if "not_measured" not in row]
        if measured:
            result["predictors"] = measured[0]
        else:
            result["predictors"] = {"not_measured": "no architecture could be measured"}
        result["predictor_model"] = model
    return result
