"""``pdflash-bench routeahead``: route-ahead bookkeeping speed and predictor quality.

Two parts, both on synthetic inputs (labelled ``"synthetic": true``):

1. **accumulator** — one verify step of 256 requests x 16 tokens x top-8 over
   48 layers x 128 experts: the native accumulator against the pure-Python
   reference, timed side by side in this run (medians), plus a check that
   both produce the same counters on the same step. Routing is synthetic with
   realistic overlap: per layer a Zipf-like expert popularity, per request a
   persistent affinity, per token Gumbel noise (top-k of the sum); the
   prediction is the same model with independent noise.
2. **predictors** — each predictor on a tiny random-weight HF MoE model
   (no checkpoint; built here), scored against the routing captured from the
   model's own forward over 16-token blocks of one random token sequence:
   ``coverage``, ``precision`` and ``predict_us`` (median per block).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

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
        "mean_routed_per_request_layer": float(routed.sum(axis=2).mean()),
        "mean_routed_union_per_layer": float(routed.any(axis=0).sum(axis=1).mean()),
        "synthetic_prediction": snap.request.to_json(),
    }


# ----------------------------------------------------------------------------
# Part 2: predictors on a tiny random-weight model
# ----------------------------------------------------------------------------

TINY = dict(layers=8, experts=64, top_k=4, hidden=128, vocab=512, blocks=16, block=16)


class _HFRouters:
    """Embeddings, norms and routers of an HF Qwen3-MoE model (the parts a
    predictor reads), for this benchmark's own tiny model."""

    def __init__(self, model: Any) -> None:
        cfg = model.config
        self.model = model
        self.layers = model.model.layers
        self.num_layers = cfg.num_hidden_layers
        self.num_experts = cfg.num_experts
        self.top_k = cfg.num_experts_per_tok
        experts = self.layers[0].mlp.experts
        self.expert_nbytes = sum(p.numel() * p.element_size() for p in experts.parameters()) // (
            self.num_experts
        )

    def embed(self, input_ids: Any) -> Any:
        return self.model.model.embed_tokens(input_ids)

    def moe_norm(self, layer: int, hidden: Any) -> Any:
        return self.layers[layer].post_attention_layernorm(hidden)

    def router_logits(self, layer: int, normed: Any) -> Any:
        import torch.nn.functional as F

        return F.linear(normed, self.layers[layer].mlp.gate.weight)


def _tiny_model(device: str, seed: int) -> Any:
    import torch
    import transformers

    torch.manual_seed(seed)
    config: dict[str, Any] = dict(
        vocab_size=TINY["vocab"],
        hidden_size=TINY["hidden"],
        intermediate_size=64,
        moe_intermediate_size=64,
        num_hidden_layers=TINY["layers"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=TINY["experts"],
        num_experts_per_tok=TINY["top_k"],
        norm_topk_prob=True,
        max_position_embeddings=4096,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    cfg = transformers.Qwen3MoeConfig(**config)
    return transformers.Qwen3MoeForCausalLM(cfg).eval().to(device)


def _capture(model: Any, ids: Any) -> tuple[list[Any], list[Any]]:
    """Routed top-k ids ``[T, k]`` and the residual after each layer ``[T, H]``."""
    import torch

    routed: list[Any] = []
    outs: list[Any] = []
    hooks = []
    for layer in model.model.layers:
        hooks.append(
            layer.mlp.gate.register_forward_hook(lambda _m, _a, o: routed.append(o[2].clone()))
        )
        hooks.append(
            layer.register_forward_hook(
                lambda _m, _a, o: outs.append((o[0] if isinstance(o, tuple) else o)[0].clone())
            )
        )
    try:
        with torch.inference_mode():
            model(ids[None, :])
    finally:
        for h in hooks:
            h.remove()
    return routed, outs


def bench_predictors(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from pdflash.protocols import DraftedBlock, ExpertPredictor
    from pdflash.routeahead import (
        ApproxRouterPredictor,
        CombinedPredictor,
        FrequencyPriorPredictor,
        NextLayerLookahead,
        PreviousRoundPredictor,
        RouteAheadStats,
    )

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    model = _tiny_model(device, args.seed)
    adapter = _HFRouters(model)
    L, E, B = TINY["layers"], TINY["experts"], TINY["block"]
    gen = torch.Generator().manual_seed(args.seed + 1)
    sequence = torch.randint(3, TINY["vocab"], (TINY["blocks"] * B,), generator=gen).to(device)
    routed_ids, layer_out = _capture(model, sequence)

    def routed_mask(block: int) -> npt.NDArray[np.bool_]:
        mask = np.zeros((L, E), dtype=np.bool_)
        for layer in range(L):
            mask[
                layer, routed_ids[layer][block * B : (block + 1) * B].reshape(-1).cpu().numpy()
            ] = True
        return mask

    freq_stats = RouteAheadStats(L, E, adapter.expert_nbytes, decay=0.9)
    previous = PreviousRoundPredictor(L, E)
    approx = ApproxRouterPredictor(adapter, proxy="embed")
    frequency = FrequencyPriorPredictor(freq_stats, per_layer=2 * adapter.top_k * 4)
    # NOTE: the combined predictor may prefetch half of the model's experts per
    # block; it ranks the union of its members and keeps the best that fit.
    budget = (L * E // 2) * adapter.expert_nbytes
    predictors: dict[str, ExpertPredictor] = {
        "approx_router": approx,
        "approx_router_wide": ApproxRouterPredictor(
            adapter, proxy="embed", experts_per_token=2 * adapter.top_k, name="approx_router_wide"
        ),
        "previous_round": previous,
        "frequency_prior": frequency,
        "combined": CombinedPredictor(
            [(approx, 1.0), (previous, 0.5), (frequency, 0.25)],
            expert_nbytes=adapter.expert_nbytes,
            byte_budget=budget,
        ),
    }
    stats = {
        name: RouteAheadStats(L, E, adapter.expert_nbytes) for name in [*predictors, "next_layer"]
    }
    times: dict[str, list[float]] = {name: [] for name in stats}
    look = NextLayerLookahead(adapter)
    warm = DraftedBlock(1, sequence[:B], torch.arange(B, device=device))
    for predictor in predictors.values():  # warm-up: lazy init is not a prediction
        predictor.predict(warm)
    look.predict_next(0, layer_out[0][:B])
    for block_index in range(TINY["blocks"]):
        tokens = sequence[block_index * B : (block_index + 1) * B]
        block = DraftedBlock(0, tokens, torch.arange(B, device=device))
        routed = routed_mask(block_index)
        for name, predictor in predictors.items():
            start = time.perf_counter_ns()
            scores = predictor.predict(block)
            times[name].append((time.perf_counter_ns() - start) / 1e3)
            if block_index > 0:  # stateful predictors know nothing before block 0
                stats[name].update(scores > 0, routed)
        nxt = np.zeros((L, E), dtype=np.bool_)
        start = time.perf_counter_ns()
        for layer in range(L - 1):
            flat, _ = look.predict_next(
                layer, layer_out[layer][block_index * B : (block_index + 1) * B]
            )
            nxt.reshape(-1)[flat] = True
        times["next_layer"].append((time.perf_counter_ns() - start) / 1e3)
        # layer 0 has no previous layer: the lookahead is scored on layers 1..L-1
        later = routed.copy()
        later[0] = False
        stats["next_layer"].update(nxt, later)
        previous.observe(0, routed)
        freq_stats.update(np.zeros_like(routed), routed)
    out: dict[str, Any] = {}
    for name, st in stats.items():
        snap = st.snapshot()
        row = snap.request.to_json()
        out[name] = {
            "coverage": row["coverage"],
            "precision": row["precision"],
            "predict_us": statistics.median(times[name]),
            "predict_us_min": min(times[name]),
            "predicted_per_block": snap.request.predicted / max(snap.steps, 1),
            "routed_per_block": snap.request.routed / max(snap.steps, 1),
            "blocks_scored": snap.steps,
        }
        if "not_measured" in row:
            out[name]["not_measured"] = row["not_measured"]
    return {
        "synthetic": True,
        "model": "Qwen3-MoE architecture, random weights (transformers init), built in the bench",
        "device": device,
        **TINY,
        "byte_budget_combined": budget,
        "predictors": out,
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
    if not args.skip_predictors:
        result["predictor_model"] = bench_predictors(args)
        result["predictors"] = result["predictor_model"].pop("predictors")
    return result
