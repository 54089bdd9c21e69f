"""Export a proxy decoding run as a :mod:`~pdflash.traces` trace."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from pdflash import traces as tf


def export_trace(
    target_dir: str | os.PathLike[str],
    drafter_dir: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    *,
    num_prompts: int,
    prompt_len: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    device: str = "auto",
    log: Any = print,
) -> dict[str, Any]:
    """Decode held-out ``eval`` prompts with the target and drafter, record
    routing and acceptance, write the trace; returns its provenance + size."""
    import torch
    from pdflash.bench.proxy.decode import speculative_decode, teacher_forced_drafter_hidden
    from pdflash.bench.proxy.drafter import capture_features, features_of, load_target
    from pdflash.bench.proxy.routing_stats import (
        approx_router_topk,
        capture_lookahead,
        capture_routing,
        stack_lookahead,
    )
    from pdflash.bench.proxy.target import heldout_prompts, weights_sha256

    from pdflash.engine.drafter import load_drafter
    from pdflash.engine.sampling import SamplingParams
    from pdflash.serve.build import resolve_device

    dev = resolve_device(device)
    # NOTE: fp32 on every device: the trace's routing must not depend on
    # autocast rounding, and the models are small.
    target = load_target(target_dir, dev, torch.float32)
    drafter = load_drafter(Path(drafter_dir), device=dev, dtype=torch.float32)
    tcfg = json.loads((Path(target_dir) / "config.json").read_text())
    # NOTE: the loaded config, not the JSON: transformers 5 writes num_experts
    # as num_local_experts.
    mc = target.config
    n_exp, k = int(mc.num_experts), int(mc.num_experts_per_tok)
    n_layers, vocab = int(mc.num_hidden_layers), int(mc.vocab_size)
    prompts = heldout_prompts(target_dir, "eval", num_prompts, prompt_len, max_new_tokens)
    if not prompts:
        raise ValueError(f"{target_dir}: no held-out eval document fits the prompt")
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=temperature)
    edt, tdt = tf.expert_dtype(n_exp), tf.token_dtype(vocab)
    tokens, offsets, plen, token_topk = [], [0], [], []
    r_req, r_acc, r_rows, v_topk, v_tok = [], [], [], [], []
    # the next-layer lookahead (ids, probs) of token rows and verify rows
    t_la: list[tuple[np.ndarray, np.ndarray]] = []
    v_la: list[tuple[np.ndarray, np.ndarray]] = []
    # route-ahead's approximate router (ids, probs) over the drafter's hidden
    # states (token rows: teacher-forced; verify rows: as decoded), and over
    # the token rows' embeddings
    t_ap: list[tuple[np.ndarray, np.ndarray]] = []
    v_ap: list[tuple[np.ndarray, np.ndarray]] = []
    t_em: list[tuple[np.ndarray, np.ndarray]] = []
    for r, (prompt, _src) in enumerate(prompts):
        res = speculative_decode(
            target, drafter, prompt, max_new_tokens, params, generator=gen, record_routing=True
        )
        seq = prompt + res.tokens
        ids_layers = drafter.target_layer_ids
        with (
            torch.no_grad(),
            capture_routing(target) as calls,
            capture_lookahead(target) as ahead,
            capture_features(target, ids_layers) as feats,
        ):
            target(input_ids=torch.tensor([seq], device=dev), use_cache=False)
        token_topk.append(np.stack([c[-1].numpy() for c in calls], axis=1).astype(edt))
        t_la.append(stack_lookahead(ahead))
        v_la += res.verify_lookahead
        hidden = teacher_forced_drafter_hidden(target, drafter, seq, features_of(feats, ids_layers))
        t_ap.append(approx_router_topk(target, hidden))
        v_ap += res.verify_approx
        with torch.no_grad():
            emb = target.model.embed_tokens(torch.tensor(seq, device=dev))
        t_em.append(approx_router_topk(target, emb))
        tokens.append(np.asarray(seq, dtype=tdt))
        offsets.append(offsets[-1] + len(seq))
        plen.append(len(prompt))
        for acc, rows, block, topk in zip(
            res.acceptance, res.verify_rows, res.drafted, res.verify_topk, strict=True
        ):
            r_req.append(r)
            r_acc.append(acc)
            r_rows.append(rows)
            v_topk.append(topk.astype(edt))
            v_tok.append(np.asarray(block, dtype=tdt))
        log(
            f"[trace] request {r}: {len(res.tokens)} tokens in {len(res.acceptance)} rounds, "
            f"tau {res.tokens_per_round}"
        )
    sources = [src for _, src in prompts]
    prov_target = tcfg.get("pdflash_proxy") or {}
    dcfg = json.loads((Path(drafter_dir) / "config.json").read_text())
    provenance = {
        "format": tf.FORMAT,
        "version": tf.VERSION,
        "num_experts": n_exp,
        "top_k": k,
        "num_layers": n_layers,
        "vocab_size": vocab,
        "block_size": drafter.cfg.block_size,
        "temperature": temperature,
        "seed": seed,
        "target_weights_sha256": weights_sha256(target_dir),
        "drafter_weights_sha256": weights_sha256(drafter_dir),
        "model_hash": weights_sha256(target_dir),
        "target_preset": prov_target.get("preset"),
        "drafter_preset": (dcfg.get("pdflash_proxy") or {}).get("preset"),
        "target_provenance": {
            key: prov_target.get(key)
            for key in (
                "corpus_manifest_sha256",
                "tokenizer_sha256",
                "steps",
                "tokens_seen",
                "final_heldout_loss",
                "device",
                "torch",
                "transformers",
            )
        },
        "prompts_source": (
            f"held-out 'eval' documents of corpus {prov_target.get('corpus_manifest_sha256')}, "
            f"{prompt_len}-token windows (document sha256:token offset)"
        ),
        "prompts": sources,
        "prompts_sha256": hashlib.sha256("\n".join(sources).encode()).hexdigest(),
        "routing_dtype": "fp32 target forward",
        "lookahead": (
            "next-layer gate lookahead: layer l's router over its post-attention norm of the "
            "residual entering layer l (embeddings for layer 0), attention skipped; softmax "
            "over all experts, top-k; probabilities stored as float16"
        ),
        "approx_router": (
            "route-ahead's approximate router: every layer's router over its post-attention "
            "norm of the drafter's final-normed hidden state for the row (token rows: "
            "teacher-forced, the first draft row of the block anchored one position before, "
            "position 0 its own anchor row; verify rows: as decoded), and for token rows over "
            "the token's embedding (token_approx_embed); softmax over all experts, top-k; "
            "probabilities stored as float16"
        ),
        "max_new_tokens": max_new_tokens,
    }
    trace = tf.ProxyTrace(
        tokens=np.concatenate(tokens),
        token_request=np.asarray(offsets, dtype=np.int64),
        prompt_len=np.asarray(plen, dtype=np.int32),
        token_topk=np.concatenate(token_topk),
        round_request=np.asarray(r_req, dtype=np.int32),
        round_accepted=np.asarray(r_acc, dtype=np.int16),
        round_rows=np.asarray(r_rows, dtype=np.int16),
        verify_topk=np.concatenate(v_topk) if v_topk else np.zeros((0, n_layers, k), edt),
        verify_tokens=np.concatenate(v_tok) if v_tok else np.zeros((0,), tdt),
        provenance=provenance,
        **_optional_group("lookahead", t_la, v_la, (n_layers, k), edt),
        **_optional_group("approx", t_ap, v_ap, (n_layers, k), edt),
        **_optional_group("approx_embed", t_em, None, (n_layers, k), edt),
    )
    path = tf.save_trace(trace, out_path)
    size = path.stat().st_size
    committed = trace.round_accepted.astype(np.float64)
    summary = {
        "path": str(path),
        "bytes": size,
        "requests": trace.num_requests,
        "rounds": int(committed.size),
        "tau_loop": float(committed.mean()) if committed.size else None,
        "tokens": int(trace.tokens.size),
        "verify_rows": int(trace.verify_tokens.size),
    }
    log(f"[trace] wrote {path} ({size / 1e6:.2f} MB): {summary}")
    return {"summary": summary, "provenance": provenance}


def _optional_group(
    kind: str,
    token_rows: list[tuple[np.ndarray, np.ndarray]],
    verify_rows: list[tuple[np.ndarray, np.ndarray]] | None,
    shape: tuple[int, int],
    ids_dtype: Any,
) -> dict[str, np.ndarray]:
    """One optional group of trace arrays (``token_<kind>``, its probs and,
    unless ``verify_rows`` is None, ``verify_<kind>`` and its probs) from
    per-forward ``(ids, probs)`` pairs."""
    out: dict[str, np.ndarray] = {}
    groups = [(token_rows, f"token_{kind}")]
    if verify_rows is not None:
        groups.append((verify_rows, f"verify_{kind}"))
    for rows, name in groups:
        if rows:
            out[name] = np.concatenate([i for i, _ in rows]).astype(ids_dtype)
            out[name + "_probs"] = np.concatenate([p for _, p in rows]).astype(np.float16)
        else:
            out[name] = np.zeros((0, *shape), ids_dtype)
            out[name + "_probs"] = np.zeros((0, *shape), np.float16)
    return out
