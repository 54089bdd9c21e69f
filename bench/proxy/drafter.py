"""The DFlash drafter trainer.

Recipe (z-lab DFlash): the drafter is trained on the target's own
continuations of held-out prompts. Each training sequence (prompt +
continuation) runs once through the frozen target, whose hidden states at
``target_layer_ids`` are the context features. Random anchors ``a`` are
drawn in the continuation; the block of anchor ``a`` is ``[x_a, MASK x
(B-1)]`` at positions ``a .. a+B-1``, it attends to the context features of
positions ``< a`` only (strictly before its anchor: position ``a``'s feature
needs ``x_a`` to have gone through the target, which in decoding it has not)
and bidirectionally to its own block. Row ``k`` of the block predicts
``x_{a+k}`` (same-position labels); row 0 (the anchor, already known) has no
loss; rows ``k >= 1`` are weighted ``exp(-(k-1)/gamma)`` (early rows matter
more: a rejection ends the round). The target's embedding and LM head are
shared and frozen; only the drafter's own layers, ``fc`` and norms train.

:func:`block_hidden` is the one differentiable forward used by training,
evaluation and the decoding loop: all anchors of a batch of sequences in one
masked attention. It computes what ``pdflash.engine.drafter.DFlashDrafter.
forward_blocks`` computes for one block (tested), and the checkpoint is
written in the z-lab layout that :func:`pdflash.engine.drafter.load_drafter`
loads.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from pdflash.bench.proxy.presets import DrafterPreset
from pdflash.bench.proxy.tokenizer import MASK_ID

from pdflash.engine.drafter import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    DFlashDrafter,
    DrafterConfig,
    default_target_layer_ids,
)

Log = Callable[[str], None]


def drafter_config(target_config: dict[str, Any], preset: DrafterPreset) -> dict[str, Any]:
    """The z-lab ``config.json`` of a drafter for ``target_config``."""
    t = target_config
    n_target = int(t["num_hidden_layers"])
    ids = preset.target_layer_ids
    if ids is None:
        ids = tuple(default_target_layer_ids(n_target, preset.num_layers))
    bad = [i for i in ids if not 0 <= i < n_target]
    if bad:
        raise ValueError(f"target_layer_ids {list(ids)} out of range for {n_target} target layers")
    rope = t.get("rope_parameters") or {}
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": int(t["hidden_size"]),
        "intermediate_size": preset.intermediate_size,
        "num_hidden_layers": preset.num_layers,
        "num_attention_heads": int(t["num_attention_heads"]),
        "num_key_value_heads": int(t["num_key_value_heads"]),
        "head_dim": int(t["head_dim"]),
        "rms_norm_eps": float(t.get("rms_norm_eps", 1e-6)),
        "attention_bias": False,
        "hidden_act": "silu",
        "vocab_size": int(t["vocab_size"]),
        "max_position_embeddings": int(t.get("max_position_embeddings", 4096)),
        "rope_theta": float(rope.get("rope_theta", t.get("rope_theta", 10000.0))),
        "num_target_layers": n_target,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "dflash_config": {
            "target_layer_ids": [int(i) for i in ids],
            "mask_token_id": MASK_ID,
            "block_size": preset.block_size,
        },
    }


def new_drafter(cfg_dict: dict[str, Any], seed: int = 0) -> DFlashDrafter:
    import torch

    torch.manual_seed(seed)
    model = DFlashDrafter(DrafterConfig.from_dict(cfg_dict))
    for i in range(model.cfg.num_hidden_layers):
        if model.cfg.layer_is_causal(i) or model.cfg.layer_window(i) is not None:
            raise ValueError(
                "the trainer supports full (bidirectional) attention draft layers only"
            )
    return model


# --------------------------------------------------------------------------
# target features
# --------------------------------------------------------------------------


@contextmanager
def capture_features(target: Any, layer_ids: Sequence[int]) -> Iterator[dict[int, Any]]:
    """Outputs of the target's decoder layers ``layer_ids`` (the residual
    stream after each layer, as the engine's TargetRunner captures them)."""
    got: dict[int, Any] = {}
    handles = []
    layers = target.model.layers
    for i in sorted(set(layer_ids)):

        def hook(_m: Any, _a: Any, out: Any, i: int = i) -> None:
            got[i] = out[0] if isinstance(out, tuple) else out

        handles.append(layers[i].register_forward_hook(hook))
    try:
        yield got
    finally:
        for h in handles:
            h.remove()


def features_of(got: dict[int, Any], layer_ids: Sequence[int]) -> Any:
    import torch

    return torch.cat([got[i] for i in layer_ids], dim=-1)


def cache_kwarg(model: Any) -> str:
    """transformers renamed ``past_key_values`` to ``cache`` in some releases."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


# --------------------------------------------------------------------------
# the masked block forward
# --------------------------------------------------------------------------


def _rope(x: Any, cos: Any, sin: Any) -> Any:
    """``x [..., T, heads, D]``, ``cos/sin [..., T, D]``."""
    import torch

    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(-2) + rot * sin.unsqueeze(-2)


def block_mask(anchors: Any, context_len: int, block_size: int) -> Any:
    """``[S, nA*B, C + nA*B]`` bool: block ``j`` sees context positions
    ``< anchors[:, j]`` and its own ``B`` rows."""
    import torch

    S, nA = anchors.shape
    B = block_size
    dev = anchors.device
    ctx_pos = torch.arange(context_len, device=dev)
    row_anchor = anchors.repeat_interleave(B, dim=1)  # [S, Q]
    sees_ctx = ctx_pos[None, None, :] < row_anchor[..., None]
    blk = torch.arange(nA, device=dev).repeat_interleave(B)
    sees_blk = (blk[:, None] == blk[None, :]).expand(S, -1, -1)
    return torch.cat([sees_ctx, sees_blk], dim=-1)


def block_hidden(drafter: DFlashDrafter, features: Any, block_embeds: Any, anchors: Any) -> Any:
    """Final-normed draft hidden states for every anchor's block.

    ``features [S, C, n_ids * H]``: target features of positions ``0..C-1``;
    ``block_embeds [S, nA, B, H]``: embedded ``[x_a, MASK...]`` blocks;
    ``anchors [S, nA]`` (int64, ``<= C``). Returns ``[S, nA, B, H]``. Block
    ``j`` depends on ``features[:, :anchors[:, j]]`` only.
    """
    import torch
    from torch.nn import functional as F

    S, nA, B, H = block_embeds.shape
    C = features.shape[1]
    if anchors.shape != (S, nA):
        raise ValueError(f"anchors shape {tuple(anchors.shape)} != {(S, nA)}")
    if C < 1:
        # no context at all: one dummy feature row that no query may see
        features = features.new_zeros(S, 1, features.shape[-1])
        C = 1
    cfg = drafter.cfg
    d = cfg.head_dim
    Q = nA * B
    x = block_embeds.reshape(S, Q, H)
    th = drafter.hidden_norm(drafter.fc(features.to(x.dtype)))  # [S, C, H]
    ctx_pos = torch.arange(C, device=x.device)
    blk_pos = (anchors[..., None] + torch.arange(B, device=x.device)).reshape(-1)
    cos_c, sin_c = drafter.rope(ctx_pos, x)  # [C, D]
    cos_b, sin_b = drafter.rope(blk_pos, x)  # [S*Q, D]
    cos_b, sin_b = cos_b.view(S, Q, d), sin_b.view(S, Q, d)
    mask = block_mask(anchors, C, B)[:, None]  # [S, 1, Q, C+Q]
    layer: Any
    for layer in drafter.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = _rope(attn.q_norm(attn.q_proj(h).view(S, Q, -1, d)), cos_b, sin_b)
        kb = _rope(attn.k_norm(attn.k_proj(h).view(S, Q, -1, d)), cos_b, sin_b)
        vb = attn.v_proj(h).view(S, Q, -1, d)
        kc = _rope(attn.k_norm(attn.k_proj(th).view(S, C, -1, d)), cos_c, sin_c)
        vc = attn.v_proj(th).view(S, C, -1, d)
        k = torch.cat([kc, kb], dim=1).transpose(1, 2)
        v = torch.cat([vc, vb], dim=1).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k, v, attn_mask=mask, scale=d**-0.5, enable_gqa=True
        )
        x = x + attn.o_proj(out.transpose(1, 2).reshape(S, Q, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.norm(x).view(S, nA, B, H)


def embed_blocks(embed: Any, tokens: Any, anchors: Any, block_size: int) -> Any:
    """``[S, nA, B, H]`` embeddings of ``[x_a, MASK x (B-1)]`` per anchor."""
    import torch

    S, nA = anchors.shape
    ids = torch.full((S, nA, block_size), MASK_ID, dtype=torch.long, device=tokens.device)
    ids[:, :, 0] = tokens.gather(1, anchors)
    out = embed(ids)
    return out


def loss_weights(block_size: int, gamma: float, device: Any = None) -> Any:
    """Weights of block rows ``0..B-1``: 0 for the anchor row, then
    ``exp(-(k-1)/gamma)``."""
    import torch

    k = torch.arange(block_size, dtype=torch.float32, device=device)
    w = torch.exp(-(k - 1).clamp_min(0) / gamma)
    w[0] = 0.0
    return w


def block_labels(tokens: Any, anchors: Any, block_size: int) -> Any:
    """``[S, nA, B]`` labels: row ``k`` of anchor ``a`` is ``x_{a+k}``."""
    import torch

    pos = anchors[..., None] + torch.arange(block_size, device=tokens.device)
    S = tokens.shape[0]
    return tokens.gather(1, pos.reshape(S, -1)).view(pos.shape)


# --------------------------------------------------------------------------
# data: the target's own continuations
# --------------------------------------------------------------------------


def generate(
    target: Any,
    prompts: Any,
    new_tokens: int,
    *,
    temperature: float,
    generator: Any,
    autocast: Any,
) -> Any:
    """Continue equal-length ``prompts [N, P]`` by ``new_tokens`` (greedy at
    temperature 0, else sampled from the target at ``temperature``; eos is
    an ordinary token: documents are separated by it in training).
    Returns ``[N, P + new_tokens]``."""
    import torch
    from transformers import DynamicCache

    kw = cache_kwarg(target)
    cache = DynamicCache(config=target.config)
    seq = prompts
    step_in = prompts
    with torch.no_grad(), autocast:
        for _ in range(new_tokens):
            logits = target(input_ids=step_in, use_cache=True, **{kw: cache}).logits[:, -1]
            if temperature > 0:
                probs = torch.softmax(logits.float() / temperature, dim=-1)
                where = generator.device if generator is not None else probs.device
                nxt = torch.multinomial(probs.to(where), 1, generator=generator).to(seq.device)
            else:
                nxt = logits.argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
            step_in = nxt
    return seq


def build_dataset(
    target: Any,
    target_dir: str | os.PathLike[str],
    preset: DrafterPreset,
    *,
    device: Any,
    seed: int,
    log: Log,
) -> tuple[Any, list[str]]:
    """``[N, P + Cn]`` sequences: held-out ``draft`` prompts continued by the target."""
    import torch
    from pdflash.bench.proxy.target import bf16_autocast, heldout_prompts

    prompts = heldout_prompts(target_dir, "draft", preset.data_prompts, preset.prompt_len, 0)
    if not prompts:
        raise ValueError(f"{target_dir}: no held-out draft document has {preset.prompt_len} tokens")
    # sample on the device (a [batch, vocab] copy to the host per token is slow)
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = torch.tensor([p for p, _ in prompts], dtype=torch.long, device=device)
    parts = []
    for i in range(0, len(ids), preset.gen_batch):
        parts.append(
            generate(
                target,
                ids[i : i + preset.gen_batch],
                preset.continuation_len,
                temperature=preset.data_temperature,
                generator=gen,
                autocast=bf16_autocast(device),
            )
        )
    data = torch.cat(parts)
    log(
        f"[draft] data: {data.shape[0]} continuations of {preset.continuation_len} tokens "
        f"after {preset.prompt_len}-token held-out prompts (T={preset.data_temperature})"
    )
    return data, [src for _, src in prompts]


def sample_anchors(
    rng: np.random.Generator, n_seq: int, lo: int, hi: int, count: int
) -> np.ndarray[Any, np.dtype[np.int64]]:
    """``[n_seq, count]`` anchors in ``[lo, hi]`` (distinct per row when the
    range allows), sorted."""
    span = hi - lo + 1
    if span < 1:
        raise ValueError(f"no room for anchors in [{lo}, {hi}]")
    rows = []
    for _ in range(n_seq):
        if span >= count:
            a = rng.choice(span, size=count, replace=False)
        else:
            a = rng.integers(0, span, size=count)
        rows.append(np.sort(a) + lo)
    return np.stack(rows).astype(np.int64)


def drafter_loss(
    drafter: DFlashDrafter,
    target: Any,
    tokens: Any,
    anchors: Any,
    weights: Any,
) -> tuple[Any, Any]:
    """Weighted cross-entropy of one batch and the per-row accuracy ``[B]``."""
    import torch
    from torch.nn import functional as F

    B = weights.numel()
    with torch.no_grad(), capture_features(target, drafter.target_layer_ids) as got:
        target.model(input_ids=tokens, use_cache=False)
        feats = features_of(got, drafter.target_layer_ids)
    emb = embed_blocks(target.model.embed_tokens, tokens, anchors, B)
    hidden = block_hidden(drafter, feats, emb, anchors)
    logits = drafter.logits(hidden, target.lm_head).float()  # [S, nA, B, V]
    labels = block_labels(tokens, anchors, B)
    ce = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none"
    ).view(labels.shape)
    w = weights.to(ce.device)
    loss = (ce * w).sum() / (w.sum() * labels.shape[0] * labels.shape[1])
    acc = (logits.argmax(-1) == labels).float().mean(dim=(0, 1))
    return loss, acc


def load_target(
    target_dir: str | os.PathLike[str], device: Any, dtype: Any = None, *, autocast: bool = False
) -> Any:
    """The frozen HF target. On CUDA its experts run as bf16 grouped GEMMs
    when ``autocast`` (training under bf16 autocast), else as transformers'
    ``batched_mm`` (gathered weights, one bmm: exact in fp32, no per-expert
    host syncs; for evaluation and traces)."""
    import torch
    from pdflash.bench.proxy.experts import use_autocast_grouped_mm
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(target_dir), dtype=dtype if dtype is not None else torch.float32
    ).to(device)
    if torch.device(device).type == "cuda" and not (autocast and use_autocast_grouped_mm(model)):
        model.set_experts_implementation("batched_mm")
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def save_drafter(
    drafter: DFlashDrafter, cfg_dict: dict[str, Any], out_dir: str | os.PathLike[str], dtype: str
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` in z-lab's layout."""
    import torch
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tdtype = getattr(torch, dtype)
    tensors = {
        k: v.detach().to("cpu", tdtype).contiguous() for k, v in drafter.state_dict().items()
    }
    cfg = dict(cfg_dict)
    cfg["torch_dtype"] = dtype
    (out / CONFIG_NAME).write_text(json.dumps(cfg, indent=2, sort_keys=True))
    save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    return out


def train_drafter(
    target_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    preset: DrafterPreset,
    *,
    time_budget_s: float | None = None,
    max_steps: int | None = None,
    seed: int = 0,
    device: str = "auto",
    log: Log = print,
    log_every: int = 10,
) -> dict[str, Any]:
    """Generate the data, train the drafter by wall clock, save it; returns
    the provenance record (also in the drafter's config as ``pdflash_proxy``)."""
    import torch
    import transformers
    from pdflash.bench.proxy.target import (
        bf16_autocast,
        device_description,
        lr_at,
        run_fraction,
        set_lr,
        weights_sha256,
    )

    from pdflash.serve.build import resolve_device

    wall0 = time.perf_counter()
    budget = float(preset.time_budget_s if time_budget_s is None else time_budget_s)
    if budget <= 0:
        raise ValueError(f"time budget must be positive, got {budget}")
    dev = resolve_device(device)
    tcfg = json.loads((Path(target_dir) / "config.json").read_text())
    target = load_target(target_dir, dev, autocast=True)
    cfg_dict = drafter_config(tcfg, preset)
    drafter = new_drafter(cfg_dict, seed).to(dev)
    drafter.train()
    t_data = time.perf_counter()
    data, sources = build_dataset(target, target_dir, preset, device=dev, seed=seed, log=log)
    data_s = time.perf_counter() - t_data
    P, L, B = preset.prompt_len, data.shape[1], preset.block_size
    opt = torch.optim.AdamW(
        drafter.parameters(),
        lr=preset.lr,
        betas=(0.9, 0.95),
        weight_decay=0.0,
        **({"fused": True} if dev.type == "cuda" else {}),
    )
    weights = loss_weights(B, preset.loss_decay_gamma, dev)
    rng = np.random.default_rng(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log_file = open(out / "draft_log.jsonl", "w")  # noqa: SIM115 (closed in finally)
    step, recent, recent_acc = 0, [], []
    first_loss: float | None = None
    t_start = time.perf_counter()
    curve: list[dict[str, Any]] = []
    try:
        while True:
            frac = run_fraction(t_start, budget, step, max_steps)
            if frac >= 1.0:
                break
            lr = lr_at(frac, preset.lr, preset.warmup_frac, 0.1)
            set_lr(opt, lr)
            rows = rng.integers(0, data.shape[0], size=preset.batch_size)
            tokens = data[torch.from_numpy(rows).to(dev)]
            anchors = torch.from_numpy(
                sample_anchors(rng, len(rows), P, L - B, preset.anchors_per_seq)
            ).to(dev)
            with bf16_autocast(dev):
                loss, acc = drafter_loss(drafter, target, tokens, anchors, weights)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
            opt.step()
            step += 1
            recent.append(float(loss.detach()))
            recent_acc.append(acc.detach().cpu().numpy())
            if first_loss is None:
                first_loss = recent[0]
            if step % log_every == 0 or step == 1:
                a = np.mean(recent_acc, axis=0)
                row = {
                    "step": step,
                    "elapsed_s": round(time.perf_counter() - t_start, 2),
                    "loss": float(np.mean(recent)),
                    "acc_row1": float(a[1]),
                    "acc_mean": float(a[1:].mean()),
                    "lr": lr,
                }
                recent, recent_acc = [], []
                curve.append(row)
                log_file.write(json.dumps(row) + "\n")
                log_file.flush()
                log(
                    f"[draft] step {step} {row['elapsed_s']:.0f}s loss {row['loss']:.3f} "
                    f"acc@1 {row['acc_row1']:.3f} acc {row['acc_mean']:.3f} lr {lr:.2e}"
                )
    finally:
        log_file.close()
    train_s = time.perf_counter() - t_start
    final_loss = float(np.mean(recent)) if recent else (curve[-1]["loss"] if curve else None)
    provenance = {
        "kind": "trained proxy DFlash drafter (not synthetic)",
        "preset": preset.name,
        "preset_settings": preset.as_dict(),
        "target_weights_sha256": weights_sha256(target_dir),
        "target_preset": (tcfg.get("pdflash_proxy") or {}).get("preset"),
        "data": f"{data.shape[0]} target continuations of held-out 'draft' prompts",
        "data_sources_sha256": hashlib.sha256("\n".join(sources).encode()).hexdigest(),
        "data_s": round(data_s, 2),
        "seed": seed,
        "steps": step,
        "time_budget_s": budget,
        "max_steps": max_steps,
        "train_wall_s": round(train_s, 2),
        "total_wall_s": round(time.perf_counter() - wall0, 2),
        "first_loss": first_loss,
        "final_loss": final_loss,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": device_description(dev),
    }
    cfg_dict["pdflash_proxy"] = provenance
    save_drafter(drafter, cfg_dict, out, "float32" if dev.type == "cpu" else "bfloat16")
    (out / "provenance.json").write_text(json.dumps(provenance, indent=1))
    log(f"[draft] done: {step} steps in {train_s:.1f} s; loss {first_loss} -> {final_loss}")
    return provenance
