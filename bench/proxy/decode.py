"""A minimal DFlash decoding loop and the acceptance evaluation.

:func:`speculative_decode` runs one request: the target prefills the prompt
and picks the first token; then every round drafts a block ``[anchor, MASK x
(B-1)]`` with :func:`~pdflash.bench.proxy.drafter.block_hidden` from the
target features of the positions before the anchor, verifies the block in
one target forward (KV cache, rolled back to the accepted length) and
accepts with pdflash's own rules (:func:`pdflash.engine.sampling.greedy_accept`,
:func:`~pdflash.engine.sampling.rejection_accept`), so greedy output equals
plain greedy decoding and sampled output is distributed as the target's.
It records each round's committed length and, optionally, the top-k
routing of every verified row, its next-layer lookahead and route-ahead's
approximate router over the drafter's hidden state for it.

Tokens per round are reported two ways:

* from the loop: committed tokens / rounds (prefill's first token excluded);
* over anchors, teacher-forced: for every anchor ``a`` of a target
  continuation, ``tau(a)`` = tokens a round starting at ``a`` would commit
  (greedy: 1 + the drafted prefix that matches the continuation and the
  target's argmax; temperature 1: ``1 + sum_k prod_{j<=k} beta_j`` with
  ``beta_j = sum_x min(p_j(x), q_j(x))``, the expected rejection-sampling
  acceptance along the sampled continuation). The renewal mean is the
  harmonic mean of ``tau(a)``: decoding visits round starts, and a position
  covered by a round of length ``tau`` is a round start with probability
  ``1 / tau``, so rounds per token = mean of ``1 / tau(a)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
from pdflash.bench.proxy.drafter import (
    block_hidden,
    cache_kwarg,
    capture_features,
    embed_blocks,
    features_of,
)
from pdflash.bench.proxy.routing_stats import (
    approx_router_topk,
    capture_lookahead,
    capture_routing,
    stack_lookahead,
)

from pdflash.engine.drafter import DFlashDrafter
from pdflash.engine.sampling import (
    SamplingParams,
    greedy_accept,
    rejection_accept,
    sample_from,
    target_probs,
)

#: one forward's next-layer lookahead: (ids, probs), each ``[rows, layers, k]``
Lookahead = tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]


@dataclass
class DecodeResult:
    prompt: list[int]
    tokens: list[int]  # generated (first token from prefill included)
    acceptance: list[int]  # committed tokens per round
    verify_rows: list[int] = field(default_factory=list)  # rows verified per round
    drafted: list[list[int]] = field(default_factory=list)  # the verified block per round
    verify_topk: list[npt.NDArray[np.int64]] = field(default_factory=list)  # [rows, L, k]
    # the verified rows' next-layer lookahead (ids, probs), each [rows, L, k]
    # (routing_stats.capture_lookahead; recorded with the routing)
    verify_lookahead: list[Lookahead] = field(default_factory=list)
    # the verified rows' approximate-router prediction over the drafter's
    # hidden states (ids, probs), each [rows, L, k] (routing_stats.approx_router_topk)
    verify_approx: list[Lookahead] = field(default_factory=list)
    prefill_topk: npt.NDArray[np.int64] | None = None  # [P, L, k]

    @property
    def tokens_per_round(self) -> float | None:
        return float(np.mean(self.acceptance)) if self.acceptance else None


def _stack_routing(calls: list[list[Any]]) -> npt.NDArray[np.int64]:
    """``[rows, layers, k]`` from one forward's capture (one call per layer)."""
    return np.stack([c[-1].numpy() for c in calls], axis=1)


def speculative_decode(
    target: Any,
    drafter: DFlashDrafter,
    prompt: list[int],
    max_new_tokens: int,
    params: SamplingParams,
    *,
    generator: Any = None,
    record_routing: bool = False,
) -> DecodeResult:
    import torch
    from transformers import DynamicCache

    if not prompt:
        raise ValueError("empty prompt")
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    dev = next(target.parameters()).device
    B = drafter.cfg.block_size
    ids_layers = drafter.target_layer_ids
    kw = cache_kwarg(target)
    cache = DynamicCache(config=target.config)
    embed = target.model.embed_tokens
    res = DecodeResult(prompt=list(prompt), tokens=[], acceptance=[])

    def forward(ids: list[int]) -> tuple[Any, Any, npt.NDArray[np.int64] | None, Lookahead | None]:
        t = torch.tensor([ids], dtype=torch.long, device=dev)
        topk: npt.NDArray[np.int64] | None = None
        la: Lookahead | None = None
        with capture_features(target, ids_layers) as got:
            if record_routing:
                with capture_routing(target) as calls, capture_lookahead(target) as ahead:
                    logits = target(input_ids=t, use_cache=True, **{kw: cache}).logits[0]
                topk, la = _stack_routing(calls), stack_lookahead(ahead)
            else:
                logits = target(input_ids=t, use_cache=True, **{kw: cache}).logits[0]
            feats = features_of(got, ids_layers)[0]
        return logits.float(), feats, topk, la

    def pick(logits_row: Any) -> int:
        if params.greedy:
            return int(torch.argmax(logits_row))
        return int(sample_from(target_probs(logits_row[None], params), generator)[0])

    with torch.no_grad():
        logits, ctx, topk, _ = forward(list(prompt))
        res.prefill_topk = topk
        committed = [*list(prompt), pick(logits[-1])]
        res.tokens.append(committed[-1])
        while len(res.tokens) < max_new_tokens:
            a = len(committed) - 1  # the anchor: committed, not yet through the target
            assert ctx.shape[0] == a
            n = min(B - 1, max_new_tokens - len(res.tokens))
            tok_t = torch.tensor([committed], dtype=torch.long, device=dev)
            anchors = torch.tensor([[a]], dtype=torch.long, device=dev)
            hidden = block_hidden(
                drafter, ctx[None], embed_blocks(embed, tok_t, anchors, B), anchors
            )
            dlogits = drafter.logits(hidden[0, 0, 1 : 1 + n], target.lm_head).float()
            if params.greedy:
                drafts = dlogits.argmax(-1)
                qprobs = None
            else:
                qprobs = target_probs(dlogits, params)
                drafts = sample_from(qprobs, generator).to(dev)
            block = [committed[-1], *[int(t) for t in drafts]]
            if record_routing:
                # what route-ahead's router pass predicts from the drafted
                # block before its verify: one row per verified row
                res.verify_approx.append(approx_router_topk(target, hidden[0, 0, : len(block)]))
            vlogits, vfeats, vtopk, vla = forward(block)
            if params.greedy:
                acc, bonus = greedy_accept(drafts.cpu(), vlogits.argmax(-1).cpu())
            else:
                assert qprobs is not None
                acc, bonus = rejection_accept(
                    drafts.cpu(), qprobs.cpu(), target_probs(vlogits, params).cpu(), generator
                )
            new = [*block[1 : 1 + acc], bonus]
            new = new[: max_new_tokens - len(res.tokens)]
            committed += new
            res.tokens += new
            res.acceptance.append(len(new))
            res.verify_rows.append(len(block))
            res.drafted.append(block)
            if vtopk is not None:
                res.verify_topk.append(vtopk)
            if vla is not None:
                res.verify_lookahead.append(vla)
            ctx = torch.cat([ctx, vfeats[: acc + 1]], dim=0)
            extra = cache.get_seq_length() - (a + acc + 1)
            if extra > 0:
                cache.crop(-extra)  # negative: drop that many trailing positions
    return res


def teacher_forced_drafter_hidden(
    target: Any, drafter: DFlashDrafter, seq: list[int], features: Any, chunk: int = 64
) -> Any:
    """``[len(seq), H]``: for each position ``p >= 1`` of ``seq``, the
    drafter's final-normed hidden state for it as the first draft row of the
    block anchored at ``p - 1`` (context: the target ``features [1, T, n_ids
    * H]`` of the positions before the anchor, as in decoding); for position
    0, the anchor row of the block anchored there. What route-ahead's
    ``drafter`` proxy reads for a drafted row, taught by the sequence itself."""
    import torch

    B = drafter.cfg.block_size
    T = len(seq)
    dev = features.device
    toks = torch.tensor([seq], dtype=torch.long, device=dev)
    embed = target.model.embed_tokens
    rows = []
    with torch.no_grad():
        for lo in range(0, max(T - 1, 1), chunk):
            anc = torch.arange(lo, min(lo + chunk, max(T - 1, 1)), device=dev)[None]
            hidden = block_hidden(drafter, features, embed_blocks(embed, toks, anc, B), anc)
            if lo == 0:
                rows.append(hidden[0, :1, 0])  # position 0: the anchor row
            rows.append(hidden[0, :, min(1, B - 1)])  # position a + 1: the first draft row
    return torch.cat(rows)[:T]


def plain_greedy(target: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding with a full recompute every token (no cache): the reference."""
    import torch

    dev = next(target.parameters()).device
    ids = list(prompt)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = target(input_ids=torch.tensor([ids], device=dev), use_cache=False).logits
            tok = int(logits[0, -1].argmax())
            out.append(tok)
            ids.append(tok)
    return out


def harmonic_mean(values: npt.ArrayLike) -> float:
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0 or (v <= 0).any():
        raise ValueError("harmonic mean needs positive values")
    return float(v.size / (1.0 / v).sum())


def anchor_tau(
    target: Any,
    drafter: DFlashDrafter,
    sequences: Any,
    prompt_len: int,
    *,
    temperature: float,
    max_anchors: int = 256,
    anchors: Sequence[int] | None = None,
) -> npt.NDArray[np.float64]:
    """``tau(a)`` for anchors ``a`` in the continuation part of ``sequences
    [N, L]`` (target continuations after ``prompt_len`` prompt tokens).

    ``temperature == 0``: exact greedy acceptance (the sequences should be
    greedy continuations). ``> 0``: expected rejection-sampling acceptance.
    At most ``max_anchors`` evenly spaced anchors per sequence, or exactly
    ``anchors`` (positions, the same for every sequence).
    """
    import torch
    from pdflash.bench.proxy.drafter import block_labels

    B = drafter.cfg.block_size
    N, L = sequences.shape
    hi = L - B
    if hi < prompt_len:
        raise ValueError(
            f"sequences of {L} tokens leave no anchor after a {prompt_len}-token prompt"
        )
    cand = np.arange(prompt_len, hi + 1)
    if anchors is not None:
        cand = np.asarray(anchors, dtype=np.int64)
        if cand.size == 0 or cand.min() < 0 or cand.max() > hi:
            raise ValueError(f"anchors must be in [0, {hi}]")
    elif cand.size > max_anchors:
        cand = cand[np.linspace(0, cand.size - 1, max_anchors).round().astype(int)]
    dev = sequences.device
    out: list[npt.NDArray[np.float64]] = []
    with torch.no_grad():
        for i in range(N):
            toks = sequences[i : i + 1]
            with capture_features(target, drafter.target_layer_ids) as got:
                tlogits = target(input_ids=toks, use_cache=False).logits[0].float()
                feats = features_of(got, drafter.target_layer_ids)
            anc = torch.from_numpy(cand[None]).to(dev)
            emb = embed_blocks(target.model.embed_tokens, toks, anc, B)
            hidden = block_hidden(drafter, feats, emb, anc)
            dlogits = drafter.logits(hidden[0, :, 1:], target.lm_head).float()  # [nA, B-1, V]
            labels = block_labels(toks, anc, B)[0, :, 1:]  # x_{a+k}
            rows = anc[0][:, None] + torch.arange(B - 1, device=dev)  # target row a+k-1
            t_rows = tlogits[rows]  # [nA, B-1, V]
            if temperature <= 0:
                ok = (dlogits.argmax(-1) == labels) & (t_rows.argmax(-1) == labels)
                acc = ok.long().cumprod(-1).sum(-1)
                tau = (1 + acc).double()
            else:
                p = torch.softmax(t_rows / temperature, -1)
                q = torch.softmax(dlogits / temperature, -1)
                beta = torch.minimum(p, q).sum(-1)  # [nA, B-1]
                tau = 1.0 + beta.double().cumprod(-1).sum(-1)
            out.append(tau.cpu().numpy())
    return np.concatenate(out)


def distinct_ratio(tokens: list[int]) -> float:
    return len(set(tokens)) / len(tokens)


def evaluate(
    target: Any,
    drafter: DFlashDrafter,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    seed: int = 0,
    log: Any = print,
) -> dict[str, Any]:
    """Tokens per round (anchors and loop, greedy and T=1) and the distinct-token
    ratio of greedy continuations, over ``prompts`` (equal lengths)."""
    import torch
    from pdflash.bench.proxy.drafter import generate

    dev = next(target.parameters()).device
    P = len(prompts[0])
    if any(len(p) != P for p in prompts):
        raise ValueError("prompts must have equal lengths")
    ids = torch.tensor(prompts, dtype=torch.long, device=dev)
    gen = torch.Generator().manual_seed(seed)
    result: dict[str, Any] = {
        "prompts": len(prompts),
        "prompt_len": P,
        "new_tokens": max_new_tokens,
        "block_size": drafter.cfg.block_size,
    }
    import contextlib

    for name, temp in (("greedy", 0.0), ("t1", 1.0)):
        seqs = generate(
            target,
            ids,
            max_new_tokens,
            temperature=temp,
            generator=gen,
            autocast=contextlib.nullcontext(),
        )
        taus = anchor_tau(target, drafter, seqs, P, temperature=temp)
        params = SamplingParams(temperature=temp)
        loops = [
            speculative_decode(target, drafter, p, max_new_tokens, params, generator=gen)
            for p in prompts
        ]
        acc = [a for r in loops for a in r.acceptance]
        result[name] = {
            "tau_anchor_renewal": harmonic_mean(taus),
            "tau_anchor_arithmetic": float(np.mean(taus)),
            "anchors": int(taus.size),
            "tau_loop": float(np.mean(acc)) if acc else None,
            "rounds_loop": len(acc),
            "acceptance_hist": np.bincount(acc, minlength=drafter.cfg.block_size + 1)[1:].tolist(),
        }
        if temp == 0.0:
            result["distinct_token_ratio_greedy"] = float(
                np.mean([distinct_ratio(r.tokens) for r in loops])
            )
        log(
            f"[eval] {name}: tau renewal over {taus.size} anchors {result[name]['tau_anchor_renewal']:.3f}"
            f" (arithmetic {result[name]['tau_anchor_arithmetic']:.3f}), loop {result[name]['tau_loop']}"
            f" over {len(acc)} rounds"
        )
    result["headline"] = "t1" if result["distinct_token_ratio_greedy"] < 0.3 else "greedy"
    result["headline_note"] = (
        "greedy continuations repeat (distinct-token ratio < 0.3): temperature-1 tau is the headline"
        if result["headline"] == "t1"
        else "greedy continuations do not loop (distinct-token ratio >= 0.3)"
    )
    return result
