"""The proxy target trainer: a qwen3_moe trained on the machine's Python sources.

``train_target`` prepares the data (corpus, tokenizer, token streams; cached
in a work directory), trains transformers' ``Qwen3MoeForCausalLM`` with
next-token cross-entropy + ``router_aux_coef`` x the Switch load-balance loss
per layer (:func:`switch_load_balance_loss`) + ``router_z_coef`` x the router
z-loss (mean squared log-sum-exp of the router logits), and writes an
ordinary HF checkpoint (``config.json`` + safetensors + the tokenizer) with a
``pdflash_proxy`` provenance record in ``config.json``.

The schedule is by wall clock: the learning rate warms up over the first
``warmup_frac`` of ``time_budget_s`` and decays by a cosine to
``min_lr_frac`` at the end of it, and training stops when the budget is spent
(or after ``max_steps``, whichever comes first; the schedule follows the
larger of the two fractions), so a slow machine finishes on time with a
smaller but valid model. The budget covers the training loop; data
preparation (cached in the work directory), the final held-out evaluation
and saving come on top, and the provenance records each (``prep_s``,
``train_wall_s``, ``total_wall_s``). On CUDA the forward runs under bf16
autocast, the experts as bf16 grouped GEMMs over fp32 master weights
(:mod:`.experts`).

Beside the weights, the checkpoint directory holds the held-out split's
token stream (``heldout_tokens.npy``, document offsets and roles in
``heldout_docs.json``: prompts for the drafter and evaluation), the corpus
manifest, ``train_log.jsonl`` and ``routing_stats.json``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from pdflash.bench.proxy import corpus as corpus_mod
from pdflash.bench.proxy import routing_stats
from pdflash.bench.proxy import tokenizer as tok_mod
from pdflash.bench.proxy.experts import NAME, use_autocast_grouped_mm
from pdflash.bench.proxy.presets import TargetPreset

PREP_VERSION = 1
Log = Callable[[str], None]


@dataclass
class PreparedData:
    work_dir: Path
    tokenizer_dir: Path
    tokenizer_sha256: str
    manifest_sha256: str
    manifest_summary: dict[str, Any]
    train: npt.NDArray[np.uint16]
    heldout: npt.NDArray[np.uint16]
    heldout_offsets: npt.NDArray[np.int64]
    heldout_docs: list[dict[str, Any]]  # sha256, role, per held-out document
    prep_s: float


def _prep_key(preset: TargetPreset, roots: Sequence[str] | None) -> dict[str, Any]:
    return {
        "version": PREP_VERSION,
        "roots": sorted(str(Path(r).resolve()) for r in roots) if roots else "default",
        "vocab_size": preset.vocab_size,
        "heldout_permille": preset.heldout_permille,
        "max_corpus_bytes": preset.max_corpus_bytes,
        "tokenizer_train_bytes": preset.tokenizer_train_bytes,
    }


def prepare_data(
    preset: TargetPreset,
    work_dir: str | os.PathLike[str],
    *,
    roots: Sequence[str] | None = None,
    log: Log = print,
) -> PreparedData:
    """Corpus -> manifest -> tokenizer -> token streams, cached in ``work_dir``
    (reused when the preset's data settings and roots match)."""
    t0 = time.perf_counter()
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    key = _prep_key(preset, roots)
    prep_file = work / "prep.json"
    tok_dir = work / "tokenizer"
    if prep_file.is_file() and json.loads(prep_file.read_text()).get("key") == key:
        info = json.loads(prep_file.read_text())
        log(f"[prep] reusing {work} (manifest {info['manifest_sha256'][:12]})")
    else:
        c = corpus_mod.collect(
            roots,
            heldout_permille=preset.heldout_permille,
            max_total_bytes=preset.max_corpus_bytes,
        )
        man = corpus_mod.write_manifest(c, work / "corpus_manifest.json")
        log(f"[prep] corpus: {man['counts']} files, {man['bytes']} bytes, skipped {man['skipped']}")
        train_files = c.split("train")
        budget = preset.tokenizer_train_bytes
        sample: list[str] = []
        used = 0
        for f in train_files:
            if used >= budget:
                break
            sample.append(c.texts[f.sha256])
            used += f.nbytes
        tok_hash = tok_mod.train_tokenizer(sample, preset.vocab_size, tok_dir)
        tok = tok_mod.load_tokenizer(tok_dir)
        train, _ = tok_mod.encode_documents(tok, [c.texts[f.sha256] for f in train_files])
        held_files = c.split("heldout")
        heldout, offsets = tok_mod.encode_documents(tok, [c.texts[f.sha256] for f in held_files])
        np.save(work / "train_tokens.npy", train)
        np.save(work / "heldout_tokens.npy", heldout)
        np.save(work / "heldout_offsets.npy", offsets)
        docs = [{"sha256": f.sha256, "role": f.heldout_role} for f in held_files]
        (work / "heldout_docs.json").write_text(json.dumps(docs))
        summary = {k: man[k] for k in ("counts", "bytes", "heldout_roles", "skipped", "roots")}
        summary["train_tokens"] = int(train.size)
        summary["heldout_tokens"] = int(heldout.size)
        info = {
            "key": key,
            "manifest_sha256": man["manifest_sha256"],
            "tokenizer_sha256": tok_hash,
            "summary": summary,
        }
        prep_file.write_text(json.dumps(info, indent=1))
        log(
            f"[prep] tokenizer {tok_hash[:12]} vocab {preset.vocab_size}: "
            f"{train.size} train / {heldout.size} held-out tokens"
        )
    return PreparedData(
        work_dir=work,
        tokenizer_dir=tok_dir,
        tokenizer_sha256=info["tokenizer_sha256"],
        manifest_sha256=info["manifest_sha256"],
        manifest_summary=info["summary"],
        train=np.load(work / "train_tokens.npy"),
        heldout=np.load(work / "heldout_tokens.npy"),
        heldout_offsets=np.load(work / "heldout_offsets.npy"),
        heldout_docs=json.loads((work / "heldout_docs.json").read_text()),
        prep_s=time.perf_counter() - t0,
    )


def lr_at(frac: float, preset_lr: float, warmup_frac: float, min_lr_frac: float) -> float:
    """Linear warmup over ``warmup_frac``, then cosine to ``min_lr_frac``."""
    frac = min(max(frac, 0.0), 1.0)
    if warmup_frac > 0 and frac < warmup_frac:
        return preset_lr * max(frac / warmup_frac, 0.01)
    span = max(1.0 - warmup_frac, 1e-9)
    progress = (frac - warmup_frac) / span
    cos = 0.5 * (1.0 + math.cos(math.pi * progress))
    return preset_lr * (min_lr_frac + (1.0 - min_lr_frac) * cos)


def run_fraction(t_start: float, budget_s: float, step: int, max_steps: int | None) -> float:
    """How far a training run is: the share of its wall-clock budget spent
    since ``t_start`` (``time.perf_counter``), or of ``max_steps`` where that
    is further; 1.0 or more: done."""
    frac = (time.perf_counter() - t_start) / budget_s
    if max_steps is not None:
        frac = max(frac, step / max_steps)
    return frac


def set_lr(opt: Any, lr: float) -> None:
    """Every parameter group of ``opt`` at learning rate ``lr``."""
    for g in opt.param_groups:
        g["lr"] = lr


def switch_load_balance_loss(router_logits: Sequence[Any], num_experts: int, top_k: int) -> Any:
    """The Switch load-balance loss of each MoE layer, averaged over layers:
    ``E * sum_e f_e * P_e`` with ``f_e`` the tokens routed to expert ``e``
    (top-k) per token and ``P_e`` its mean router probability (``top_k`` when
    balanced, as transformers scales it).

    Per layer because a layer's experts are its own: transformers'
    ``load_balancing_loss_func`` concatenates every layer's tokens, so expert
    ``e`` of one layer can stand in for expert ``e`` of another and a layer
    can leave experts dead while the sum looks balanced."""
    import torch

    terms = []
    for logits in router_logits:
        probs = torch.softmax(logits.float().reshape(-1, num_experts), dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices
        routed = torch.zeros_like(probs).scatter_(1, chosen, 1.0)
        terms.append(num_experts * (routed.mean(dim=0) * probs.mean(dim=0)).sum())
    return torch.stack(terms).mean()


def router_z_loss(router_logits: Sequence[Any]) -> Any:
    """Mean over layers and tokens of ``logsumexp(router logits)**2``."""
    import torch

    terms = [torch.logsumexp(r.float(), dim=-1).pow(2).mean() for r in router_logits]
    return torch.stack(terms).mean()


def heldout_windows(
    heldout: npt.NDArray[np.uint16], seq_len: int, count: int
) -> npt.NDArray[np.int64]:
    """``count`` evenly spaced, non-overlapping ``seq_len + 1`` windows (fewer
    if the held-out stream is short)."""
    span = seq_len + 1
    n = min(count, heldout.size // span)
    if n < 1:
        raise ValueError(f"held-out stream ({heldout.size} tokens) is shorter than one window")
    stride = heldout.size // n
    return np.stack([heldout[i * stride : i * stride + span] for i in range(n)]).astype(np.int64)


def evaluate_loss(model: Any, windows: npt.NDArray[np.int64], device: Any, batch: int) -> float:
    """Mean next-token cross-entropy over ``windows``."""
    import torch
    from torch.nn import functional as F

    total, count = 0.0, 0
    model.eval()
    with torch.no_grad(), bf16_autocast(device):
        for i in range(0, len(windows), batch):
            w = torch.from_numpy(windows[i : i + batch]).to(device)
            logits = model(input_ids=w[:, :-1], use_cache=False).logits
            loss = F.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum"
            )
            total += float(loss)
            count += int(w[:, 1:].numel())
    model.train()
    return total / count


def collect_topk(
    model: Any, windows: npt.NDArray[np.int64], device: Any, batch: int
) -> npt.NDArray[np.int64]:
    """Top-k expert ids ``[windows * seq, layers, k]`` over ``windows`` (teacher-forced)."""
    import torch

    model.eval()
    parts: list[npt.NDArray[np.int64]] = []
    with torch.no_grad(), bf16_autocast(device):
        for i in range(0, len(windows), batch):
            w = torch.from_numpy(windows[i : i + batch, :-1]).to(device)
            with routing_stats.capture_routing(model) as calls:
                model(input_ids=w, use_cache=False)
            parts.append(np.stack([c[0].numpy() for c in calls], axis=1))
    model.train()
    return np.concatenate(parts, axis=0)


def bf16_autocast(device: Any) -> Any:
    """bf16 autocast on a CUDA ``device``, no autocast elsewhere (the proxy
    target's and drafter's training and generation)."""
    import contextlib

    import torch

    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def weights_sha256(checkpoint: str | os.PathLike[str]) -> str:
    """Hash of the checkpoint's safetensors files (name + content), sorted by name."""
    root = Path(checkpoint)
    h = hashlib.sha256()
    for p in sorted(root.glob("*.safetensors")):
        h.update(p.name.encode())
        h.update(file_sha256(p).encode())
    return h.hexdigest()


def train_target(
    preset: TargetPreset,
    out_dir: str | os.PathLike[str],
    work_dir: str | os.PathLike[str],
    *,
    roots: Sequence[str] | None = None,
    time_budget_s: float | None = None,
    max_steps: int | None = None,
    seed: int = 0,
    device: str = "auto",
    log: Log = print,
    log_every: int = 10,
) -> dict[str, Any]:
    """Train the target and write its checkpoint; returns the provenance record."""
    import torch
    import transformers
    from torch.nn import functional as F
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from pdflash.serve.build import resolve_device

    wall0 = time.perf_counter()
    budget = float(preset.time_budget_s if time_budget_s is None else time_budget_s)
    if budget <= 0:
        raise ValueError(f"time budget must be positive, got {budget}")
    if max_steps is not None and max_steps < 1:
        raise ValueError(f"max_steps must be >= 1, got {max_steps}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = prepare_data(preset, work_dir, roots=roots, log=log)
    dev = resolve_device(device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    L = preset.seq_len
    if data.train.size < 4 * (L + 1):
        raise ValueError(f"train stream has {data.train.size} tokens: too few for seq_len {L}")

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**preset.model_config())
    model = Qwen3MoeForCausalLM(config)
    # NOTE: nn.Module.to, not model.to: transformers' typed wrapper of .to
    # does not type-check as a bound method.
    torch.nn.Module.to(model, dev)
    model.train()
    experts_impl = str(getattr(model.config, "_experts_implementation", "default"))
    if dev.type == "cuda" and use_autocast_grouped_mm(model):
        experts_impl = NAME  # bf16 grouped GEMMs over fp32 master weights
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=preset.lr,
        betas=(0.9, 0.95),
        weight_decay=preset.weight_decay,
        **({"fused": True} if dev.type == "cuda" else {}),
    )
    rng = np.random.default_rng(seed)
    windows = heldout_windows(data.heldout, L, preset.eval_windows)
    eval_batch = max(1, preset.batch_size // 2)
    initial_heldout = evaluate_loss(model, windows, dev, eval_batch)
    log(
        f"[train] {preset.name}: {n_params / 1e6:.1f}M params ({preset.active_params() / 1e6:.1f}M "
        f"active), device {dev}, budget {budget:.0f} s, max_steps {max_steps}; "
        f"held-out loss at init {initial_heldout:.3f}"
    )
    log_path = out / "train_log.jsonl"
    log_file = open(log_path, "w")  # noqa: SIM115 (closed in finally)
    curve: list[dict[str, Any]] = [
        {"step": 0, "elapsed_s": 0.0, "tokens": 0, "heldout_loss": initial_heldout}
    ]
    log_file.write(json.dumps(curve[0]) + "\n")
    step = 0
    tokens_seen = 0
    recent: list[float] = []
    last_eval = 0.0
    t_start = time.perf_counter()
    try:
        while True:
            frac = run_fraction(t_start, budget, step, max_steps)
            if frac >= 1.0:
                break
            lr = lr_at(frac, preset.lr, preset.warmup_frac, preset.min_lr_frac)
            set_lr(opt, lr)
            starts = rng.integers(0, data.train.size - L - 1, size=preset.batch_size)
            batch = np.stack([data.train[s : s + L + 1] for s in starts]).astype(np.int64)
            ids = torch.from_numpy(batch).to(dev, non_blocking=True)

            def forward_backward(ids: Any = ids) -> tuple[Any, Any, Any]:
                with bf16_autocast(dev):
                    outp = model(input_ids=ids[:, :-1], use_cache=False, output_router_logits=True)
                    ce = F.cross_entropy(
                        outp.logits.float().reshape(-1, preset.vocab_size), ids[:, 1:].reshape(-1)
                    )
                    lb = switch_load_balance_loss(
                        outp.router_logits, preset.num_experts, preset.top_k
                    )
                    z = router_z_loss(outp.router_logits)
                    loss = ce + preset.router_aux_coef * lb + preset.router_z_coef * z
                opt.zero_grad(set_to_none=True)
                loss.backward()
                return ce, lb, z

            try:
                ce, lb, z = forward_backward()
            except RuntimeError as e:
                if step > 0 or experts_impl != NAME:
                    raise
                # NOTE: the bf16 grouped GEMM is the fast path; if this device or
                # torch refuses it, the eager per-expert loop (autocast bf16 linears)
                # still trains, slower. Recorded in the provenance.
                log(f"[train] {NAME} failed ({e}); falling back to eager experts")
                model.set_experts_implementation("eager")
                experts_impl = "eager (fallback)"
                ce, lb, z = forward_backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            tokens_seen += preset.batch_size * L
            recent.append(float(ce.detach()))
            now = time.perf_counter() - t_start
            if step % log_every == 0 or step == 1:
                row = {
                    "step": step,
                    "elapsed_s": round(now, 2),
                    "tokens": tokens_seen,
                    "train_loss": float(np.mean(recent)),
                    "lb_loss": float(lb.detach()),
                    "z_loss": float(z.detach()),
                    "lr": lr,
                }
                recent = []
                if now - last_eval >= preset.eval_every_s:
                    row["heldout_loss"] = evaluate_loss(model, windows, dev, eval_batch)
                    last_eval = now
                curve.append(row)
                log_file.write(json.dumps(row) + "\n")
                log_file.flush()
                log(
                    f"[train] step {step} {now:.0f}s {tokens_seen / 1e6:.2f}M tok "
                    f"loss {row['train_loss']:.3f} lb {row['lb_loss']:.3f} "
                    f"z {row['z_loss']:.2f} lr {lr:.2e}"
                    + (f" held-out {row['heldout_loss']:.3f}" if "heldout_loss" in row else "")
                )
        train_s = time.perf_counter() - t_start
        final_train = float(np.mean(recent)) if recent else curve[-1].get("train_loss")
        final_heldout = evaluate_loss(model, windows, dev, eval_batch)
        end_row = {
            "step": step,
            "elapsed_s": round(train_s, 2),
            "tokens": tokens_seen,
            "heldout_loss": final_heldout,
            "final": True,
        }
        if final_train is not None:
            end_row["train_loss"] = final_train
        curve.append(end_row)
        log_file.write(json.dumps(end_row) + "\n")
    finally:
        log_file.close()
    log(
        f"[train] done: {step} steps, {tokens_seen / 1e6:.2f}M tokens in {train_s:.1f} s; "
        f"held-out loss {initial_heldout:.3f} -> {final_heldout:.3f}"
    )

    topk = collect_topk(model, windows, dev, eval_batch)
    rows = routing_stats.layer_stats(topk, preset.num_experts)
    stats = {
        "source": "teacher-forced held-out windows",
        "tokens": int(topk.shape[0]),
        "num_experts": preset.num_experts,
        "top_k": preset.top_k,
        "layers": rows,
        "mean": routing_stats.summarize(rows),
        "published": None,
        "published_note": "no citable published figure available offline; left out",
    }
    (out / "routing_stats.json").write_text(json.dumps(stats, indent=1))
    log("[routing] per layer (U16 = experts a 16-token block touches):")
    log(routing_stats.format_table(rows))

    save_dtype = getattr(torch, preset.save_dtype)
    torch.nn.Module.to(model, device="cpu", dtype=save_dtype)
    model.config.dtype = save_dtype
    if experts_impl == NAME:
        model.set_experts_implementation("grouped_mm")  # a name every reader knows
    model.save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        src = data.tokenizer_dir / name
        if src.is_file():
            shutil.copy2(src, out / name)
    for name in ("heldout_tokens.npy", "heldout_offsets.npy", "heldout_docs.json"):
        shutil.copy2(data.work_dir / name, out / name)
    shutil.copy2(data.work_dir / "corpus_manifest.json", out / "corpus_manifest.json")
    provenance = {
        "kind": "trained proxy target (not synthetic)",
        "preset": preset.name,
        "preset_settings": preset.as_dict(),
        "corpus_manifest_sha256": data.manifest_sha256,
        "corpus": data.manifest_summary,
        "tokenizer_sha256": data.tokenizer_sha256,
        "seed": seed,
        "steps": step,
        "tokens_seen": tokens_seen,
        "time_budget_s": budget,
        "max_steps": max_steps,
        "train_wall_s": round(train_s, 2),
        "prep_s": round(data.prep_s, 2),
        "total_wall_s": round(time.perf_counter() - wall0, 2),
        "initial_heldout_loss": initial_heldout,
        "final_train_loss": final_train,
        "final_heldout_loss": final_heldout,
        "params_total": n_params,
        "params_active": preset.active_params(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": device_description(dev),
        "host": platform.node(),
        "autocast": "bf16" if dev.type == "cuda" else "none (fp32)",
        "experts_implementation": experts_impl,
        "router_aux_loss": "Switch load balance per layer, averaged (switch_load_balance_loss)",
        "saved_dtype": preset.save_dtype,
    }
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["pdflash_proxy"] = provenance
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True))
    provenance["weights_sha256"] = weights_sha256(out)
    (out / "provenance.json").write_text(json.dumps(provenance, indent=1))
    return provenance


def device_description(dev: Any) -> str:
    """The device a proxy model was trained on, for its provenance record."""
    import torch

    if dev.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(dev)}"
    return f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def load_heldout(
    target_dir: str | os.PathLike[str], role: str
) -> tuple[npt.NDArray[np.uint16], list[tuple[int, int, str]]]:
    """The held-out stream and the ``(start, end, sha256)`` spans of the
    documents with ``role`` (``draft`` or ``eval``), from a target checkpoint."""
    root = Path(target_dir)
    stream = np.load(root / "heldout_tokens.npy")
    offsets = np.load(root / "heldout_offsets.npy")
    docs = json.loads((root / "heldout_docs.json").read_text())
    spans = [
        (int(offsets[i]), int(offsets[i + 1]), d["sha256"])
        for i, d in enumerate(docs)
        if d["role"] == role
    ]
    return stream, spans


def heldout_prompts(
    target_dir: str | os.PathLike[str], role: str, count: int, prompt_len: int, min_after: int
) -> list[tuple[list[int], str]]:
    """Up to ``count`` prompts of ``prompt_len`` tokens from held-out documents
    of ``role``, each followed by at least ``min_after`` tokens of its
    document. Documents are visited round-robin (first window of every
    document, then the second, ...); windows of one document do not overlap
    and start at an offset fixed by its hash. Returns ``(token ids,
    "sha256:offset")``."""
    stream, spans = load_heldout(target_dir, role)
    span = prompt_len + min_after
    starts: list[list[int]] = []
    for start, end, sha in spans:
        n = (end - start) // span
        if n < 1:
            starts.append([])
            continue
        shift = int(sha[16:24], 16) % ((end - start) - n * span + 1)
        starts.append([shift + j * span for j in range(n)])
    out: list[tuple[list[int], str]] = []
    j = 0
    while len(out) < count and any(len(s) > j for s in starts):
        for (start, _end, sha), offs in zip(spans, starts, strict=True):
            if j < len(offs) and len(out) < count:
                s = start + offs[j]
                out.append(([int(t) for t in stream[s : s + prompt_len]], f"{sha}:{offs[j]}"))
        j += 1
    return out
