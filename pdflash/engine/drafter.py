"""The DFlash block-diffusion drafter, its checkpoint loader and a synthetic writer.

Architecture (z-lab DFlash, arXiv:2602.06036): a few Qwen3-style decoder
layers that reuse the target's token embedding and LM head. The target's
hidden states at ``target_layer_ids`` (outputs of those decoder layers) are
concatenated per position, projected by ``fc`` and normalised
(``hidden_norm``); in every draft layer they are projected to extra keys and
values (same ``k_proj``/``v_proj`` as the block's own tokens) that the block
attends to. A block ``[anchor, MASK x (B-1)]`` is denoised in one forward;
full-attention draft layers are non-causal over context + block.

Checkpoint format (what z-lab publishes): ``config.json`` is a Qwen3 config
plus ``num_target_layers`` and a ``dflash_config`` dict holding
``target_layer_ids``, ``mask_token_id`` and ``block_size`` (optionally
``input_embedding_scale``, ``output_multiplier``,
``final_logit_softcapping``); tensors in ``model.safetensors`` (or a sharded
index) are named ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``,
``layers.{i}.self_attn.{q,k}_norm.weight``,
``layers.{i}.mlp.{gate,up,down}_proj.weight``,
``layers.{i}.{input,post_attention}_layernorm.weight``, ``norm.weight``,
``fc.weight`` ``[hidden, n_target_layers * hidden]`` and
``hidden_norm.weight``. No embedding or LM head.

The context K/V of committed positions live in a :class:`PagedKVCache`; the
block's own K/V are written to temporary slots during the forward and rolled
back after it, so the cache holds exactly the committed context.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn import functional as F

from pdflash.engine.attention import AttentionBatch, device_int64, paged_attention
from pdflash.engine.kv_cache import PagedKVCache
from pdflash.protocols import AttentionSpec

if TYPE_CHECKING:
    from pdflash.engine.graphs import GraphRunner

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's rule: one layer in the middle, or evenly spaced over [1, L-3]."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [round(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass(frozen=True)
class DrafterConfig:
    """The fields of a DFlash draft ``config.json`` this implementation uses."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    attention_bias: bool
    vocab_size: int
    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int
    layer_types: tuple[str, ...]
    sliding_window: int | None
    is_causal: bool | None
    hidden_act: str
    input_embedding_scale: float
    output_multiplier: float
    final_logit_softcapping: float | None
    raw: Mapping[str, Any]

    @staticmethod
    def from_dict(cfg: Mapping[str, Any]) -> DrafterConfig:
        dflash = dict(cfg.get("dflash_config") or {})

        def value(name: str, default: Any = None) -> Any:
            return dflash.get(name, cfg.get(name, default))

        def need(name: str) -> Any:
            v = value(name)
            if v is None:
                raise ValueError(f"DFlash draft config is missing {name!r}")
            return v

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        layers = int(need("num_hidden_layers"))
        num_target_layers = int(need("num_target_layers"))
        ids = value("target_layer_ids")
        if ids is None:
            ids = default_target_layer_ids(num_target_layers, layers)
        ids = tuple(int(i) for i in ids)
        bad = [i for i in ids if not 0 <= i < num_target_layers]
        if bad:
            raise ValueError(
                f"target_layer_ids {list(ids)} out of range for {num_target_layers} target layers"
            )
        layer_types = value("layer_types") or ["full_attention"] * layers
        if len(layer_types) != layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {layers} layers")
        is_causal = value("is_causal")
        softcap = value("final_logit_softcapping")
        return DrafterConfig(
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(value("num_key_value_heads", heads)),
            head_dim=int(value("head_dim") or hidden // heads),
            rms_norm_eps=float(value("rms_norm_eps", 1e-6)),
            attention_bias=bool(value("attention_bias", False)),
            vocab_size=int(need("vocab_size")),
            num_target_layers=num_target_layers,
            target_layer_ids=ids,
            block_size=int(value("block_size", 16)),
            mask_token_id=int(need("mask_token_id")),
            layer_types=tuple(str(t) for t in layer_types),
            sliding_window=value("sliding_window"),
            is_causal=None if is_causal is None else bool(is_causal),
            hidden_act=str(value("hidden_act", "silu")),
            input_embedding_scale=float(value("input_embedding_scale", 1.0)),
            output_multiplier=float(value("output_multiplier", 1.0)),
            final_logit_softcapping=None if softcap is None else float(softcap),
            raw=dict(cfg),
        )

    def layer_is_causal(self, layer: int) -> bool:
        if self.is_causal is not None:
            return self.is_causal
        # NOTE: z-lab's reference makes sliding-window draft layers causal and
        # full-attention layers bidirectional (the block denoises jointly).
        return self.layer_types[layer] == "sliding_attention"

    def layer_window(self, layer: int) -> int | None:
        if self.layer_types[layer] == "sliding_attention":
            return None if self.sliding_window is None else int(self.sliding_window)
        return None


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalise in fp32, scale in the input dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class _Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        d, h, kvh, b = (
            cfg.head_dim,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.attention_bias,
        )
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=b)
        self.k_proj = nn.Linear(cfg.hidden_size, kvh * d, bias=b)
        self.v_proj = nn.Linear(cfg.hidden_size, kvh * d, bias=b)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=b)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)


class _MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return result


class _Layer(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.self_attn = _Attention(cfg)
        self.mlp = _MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [T, heads, D]``, ``cos/sin [T, D]`` (the reference form)."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


def rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos/sin [T, D]`` -> ``(cos, signed sin) [T, 1, D]`` for :func:`apply_rope_tables`."""
    half = sin.shape[-1] // 2
    signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
    return cos[:, None, :], signed[:, None, :]


def apply_rope_tables(x: torch.Tensor, cc: torch.Tensor, ss: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rope` bit for bit in four kernels: ``rotate_half(x) * sin``
    is ``roll(x, D/2) * signed_sin`` (the same products, signs moved)."""
    return x * cc + torch.roll(x, x.shape[-1] // 2, dims=-1) * ss


@dataclass
class DraftItem:
    """One request's part of a batched draft forward.

    ``num_new_context`` target feature rows (positions ``kv_length ..``) are
    appended to the drafter's context cache; the block of ``block_len`` tokens
    sits right after the context, at positions ``anchor_pos ..``.
    """

    seq_id: int
    num_new_context: int
    block_len: int


@dataclass
class DraftPlan:
    """A draft forward's host-side layout (:meth:`DFlashDrafter.forward_blocks`):
    the new context rows' and block rows' KV slots and positions (flat in
    item order), each item's block length, query positions and key slots /
    positions, and the context length each item keeps."""

    n_ctx: int
    n_blk: int
    block_lens: list[int]
    ctx_slots: list[int] = field(default_factory=list)
    ctx_pos: list[int] = field(default_factory=list)
    blk_slots: list[int] = field(default_factory=list)
    blk_pos: list[int] = field(default_factory=list)
    q_pos: list[list[int]] = field(default_factory=list)
    k_slots: list[list[int]] = field(default_factory=list)
    k_pos: list[list[int]] = field(default_factory=list)
    committed: list[int] = field(default_factory=list)


class DFlashDrafter(nn.Module):
    """A DFlash draft model over a paged context cache."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"unsupported draft hidden_act {cfg.hidden_act!r} (only 'silu')")
        self.cfg = cfg
        self.layers = nn.ModuleList([_Layer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(
            len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False
        )
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self._rotary = _build_rotary(cfg)
        #: torch's SDPA over the paged keys (False: the explicit fp32 padded
        #: softmax, :func:`pdflash.engine.attention.masked_attention`)
        self.fused_attention = True

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.cfg.target_layer_ids

    def new_kv_cache(
        self,
        *,
        num_pages: int,
        page_size: int,
        device: torch.device | str,
        dtype: torch.dtype,
        scratch: bool = False,
    ) -> PagedKVCache:
        """The drafter's context cache; ``scratch``: with the scratch row
        padded (graphed) draft forwards write to."""
        return PagedKVCache(
            num_layers=self.cfg.num_hidden_layers,
            num_kv_heads=self.cfg.num_key_value_heads,
            head_dim=self.cfg.head_dim,
            page_size=page_size,
            num_pages=num_pages,
            dtype=dtype,
            device=device,
            scratch=scratch,
        )

    def rope(
        self, positions: torch.Tensor, like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self._rotary(like, positions.view(1, -1))
        return cos[0], sin[0]

    @torch.no_grad()
    def forward_blocks(
        self,
        context_features: torch.Tensor,
        block_embeddings: torch.Tensor,
        items: list[DraftItem],
        kv: PagedKVCache,
        graphs: GraphRunner | None = None,
    ) -> torch.Tensor:
        """Denoise every item's block in one forward.

        ``context_features [sum num_new_context, n_ids * hidden]`` and
        ``block_embeddings [sum block_len, hidden]`` are flat in item order.
        Returns the final-normed hidden states ``[sum block_len, hidden]``.
        The new context is appended to ``kv``; the block is not kept.
        ``graphs``: replay the step as a recorded CUDA graph where it can
        (:meth:`pdflash.engine.graphs.GraphRunner.draft_forward`).
        """
        device = block_embeddings.device
        n_ctx = sum(it.num_new_context for it in items)
        n_blk = sum(it.block_len for it in items)
        if context_features.shape[0] != n_ctx or block_embeddings.shape[0] != n_blk:
            raise ValueError(
                f"got {context_features.shape[0]} context rows / {block_embeddings.shape[0]} "
                f"block rows, items need {n_ctx} / {n_blk}"
            )
        plan = DraftPlan(n_ctx=n_ctx, n_blk=n_blk, block_lens=[it.block_len for it in items])
        try:
            for it in items:
                start = kv.length(it.seq_id)
                plan.committed.append(start + it.num_new_context)
                kv.reserve(it.seq_id, start + it.num_new_context + it.block_len)
                kv.grow(it.seq_id, it.num_new_context + it.block_len)
                anchor = start + it.num_new_context
                plan.ctx_slots += kv.slot_list(it.seq_id, start, anchor)
                plan.ctx_pos += list(range(start, anchor))
                plan.blk_slots += kv.slot_list(it.seq_id, anchor, anchor + it.block_len)
                plan.blk_pos += list(range(anchor, anchor + it.block_len))
                plan.q_pos.append(list(range(anchor, anchor + it.block_len)))
                total = anchor + it.block_len
                plan.k_slots.append(kv.slot_list(it.seq_id, 0, total))
                plan.k_pos.append(list(range(total)))
            if graphs is not None:
                out = graphs.draft_forward(self, kv, plan, context_features, block_embeddings)
                if out is not None:
                    return out
            q_rows: list[list[int]] = []
            row = 0
            for it in items:
                q_rows.append(list(range(row, row + it.block_len)))
                row += it.block_len
            batch = AttentionBatch.build(
                q_rows, plan.q_pos, plan.k_slots, plan.k_pos, n_blk, device, null_slot=kv.null_slot
            )
            # block rows then new-context rows: their keys/values are computed
            # and written together (one k/v projection and one KV write per layer)
            (kv_slot_t, kv_pos_t) = device_int64(
                [plan.blk_slots + plan.ctx_slots, plan.blk_pos + plan.ctx_pos], device
            )
            return self.run_blocks(
                context_features, block_embeddings, batch, kv_slot_t, kv_pos_t, kv
            )
        finally:
            # keep exactly the committed context, whatever happened above
            for it, length in zip(items, plan.committed, strict=False):
                if kv.has(it.seq_id) and kv.length(it.seq_id) > length:
                    kv.truncate(it.seq_id, length)

    def run_blocks(
        self,
        context_features: torch.Tensor,
        block_embeddings: torch.Tensor,
        batch: AttentionBatch,
        kv_slot_t: torch.Tensor,
        kv_pos_t: torch.Tensor,
        kv: PagedKVCache,
    ) -> torch.Tensor:
        """The device part of :meth:`forward_blocks`: ``block_embeddings``
        rows are the queries, every block row then every context row writes
        its K/V at ``kv_slot_t`` (positions ``kv_pos_t``). No host sync."""
        x = block_embeddings
        n_blk, n_ctx = int(x.shape[0]), int(context_features.shape[0])
        target_hidden = self.hidden_norm(self.fc(context_features.to(x.dtype)))
        cc_all, ss_all = rope_tables(*self.rope(kv_pos_t, x))
        cc_b, ss_b = cc_all[:n_blk], ss_all[:n_blk]
        cfg = self.cfg
        d = cfg.head_dim
        specs = [
            AttentionSpec(
                num_heads=cfg.num_attention_heads,
                num_kv_heads=cfg.num_key_value_heads,
                head_dim=d,
                scaling=d**-0.5,
                sliding_window=cfg.layer_window(li),
                has_sinks=False,
            )
            for li in range(len(self.layers))
        ]
        for li, layer in enumerate(self.layers):
            assert isinstance(layer, _Layer)
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_norm(attn.q_proj(h).view(n_blk, -1, d))
            q = apply_rope_tables(q, cc_b, ss_b)
            kv_in = torch.cat([h, target_hidden]) if n_ctx else h
            k_new = apply_rope_tables(
                attn.k_norm(attn.k_proj(kv_in).view(n_blk + n_ctx, -1, d)), cc_all, ss_all
            )
            v_new = attn.v_proj(kv_in).view(n_blk + n_ctx, -1, d)
            kv.write(li, kv_slot_t, k_new, v_new)
            out = paged_attention(
                q,
                kv.k[li],
                kv.v[li],
                batch,
                specs[li],
                None,
                fused=self.fused_attention,
                causal=cfg.layer_is_causal(li),
            )
            x = x + attn.o_proj(out)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        result: torch.Tensor = self.norm(x)
        return result

    def logits(
        self, hidden: torch.Tensor, lm_head: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """Draft logits through the target's LM head (no target final norm)."""
        out = lm_head(hidden)
        if self.cfg.output_multiplier != 1.0:
            out = out * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping
        if cap is not None and cap > 0:
            out = torch.tanh(out / cap) * cap
        return out


def _build_rotary(cfg: DrafterConfig) -> nn.Module:
    # NOTE: transformers' Qwen3 rotary module computes inv_freq for every rope
    # type a config can name (default, yarn, llama3, ...), exactly as the
    # reference drafter does; reuse it rather than re-deriving rope variants.
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    raw = {k: v for k, v in cfg.raw.items() if k not in ("architectures", "auto_map")}
    raw.setdefault("head_dim", cfg.head_dim)
    return Qwen3RotaryEmbedding(Qwen3Config(**raw))


# --------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------


def _read_json(file: Path, what: str) -> Any:
    try:
        return json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{file}: {what} is not valid JSON ({exc})") from exc


def _open_shard(file: Path) -> Any:
    """``safe_open(file)``; a corrupt or truncated file's error names it."""
    from safetensors import safe_open

    try:
        return safe_open(str(file), framework="pt")
    except Exception as exc:
        raise ValueError(
            f"{file}: not a readable safetensors file ({type(exc).__name__}: {exc})"
        ) from exc


def _weight_files(path: Path) -> dict[str, Path]:
    """tensor name -> file, from a single file or a sharded index."""
    index = path / INDEX_NAME
    if index.is_file():
        data = _read_json(index, "the shard index")
        if not isinstance(data, dict) or not isinstance(data.get("weight_map"), dict):
            raise ValueError(f"{index}: no weight_map object")
        return {name: path / str(fname) for name, fname in data["weight_map"].items()}
    single = path / WEIGHTS_NAME
    if not single.is_file():
        raise FileNotFoundError(f"no {WEIGHTS_NAME} or {INDEX_NAME} in {path}")
    with _open_shard(single) as f:
        return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)


def check_drafter_config(cfg: DrafterConfig, where: Path | str) -> None:
    """Positive shapes, dividing head counts, ``rms_norm_eps > 0``, a mask
    token inside the vocabulary; ``ValueError`` naming ``where`` otherwise."""
    for name in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "num_target_layers",
        "block_size",
    ):
        value = getattr(cfg, name)
        if value < 1:
            raise ValueError(f"{where}: {name} must be >= 1, got {value}")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ValueError(
            f"{where}: num_key_value_heads ({cfg.num_key_value_heads}) must divide "
            f"num_attention_heads ({cfg.num_attention_heads})"
        )
    if not (math.isfinite(cfg.rms_norm_eps) and cfg.rms_norm_eps > 0):
        raise ValueError(f"{where}: rms_norm_eps must be finite and > 0, got {cfg.rms_norm_eps}")
    if not 0 <= cfg.mask_token_id < cfg.vocab_size:
        raise ValueError(
            f"{where}: mask_token_id {cfg.mask_token_id} outside the vocabulary [0, {cfg.vocab_size})"
        )


def load_drafter(
    path: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    check_finite: bool = True,
) -> DFlashDrafter:
    """Load a z-lab DFlash draft checkpoint (config.json + safetensors).

    Tensor names may carry a ``model.`` prefix. Missing, unexpected,
    wrongly-shaped or (with ``check_finite``, the default) NaN/Inf tensors
    raise ``ValueError`` naming the tensor and file; an invalid config.json
    (bad JSON, a missing key, a bad value) one naming the file.
    ``dtype`` defaults to the checkpoint's ``torch_dtype`` (``dtype``), else fp32.
    """
    root = Path(path)
    cfg_path = root / CONFIG_NAME
    if not cfg_path.is_file():
        raise FileNotFoundError(f"no {CONFIG_NAME} in {root}")
    raw = _read_json(cfg_path, "the drafter config")
    if not isinstance(raw, dict):
        raise ValueError(f"{cfg_path}: expected a JSON object, got {type(raw).__name__}")
    try:
        cfg = DrafterConfig.from_dict(raw)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{cfg_path}: {exc}") from exc
    check_drafter_config(cfg, cfg_path)
    if dtype is None:
        name = raw.get("torch_dtype") or raw.get("dtype") or "float32"
        dtype = getattr(torch, str(name), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{cfg_path}: unknown torch_dtype {name!r}")
    with torch.device("meta"):
        model = DFlashDrafter(cfg)
    expected = {k: v for k, v in model.state_dict().items()}
    files = _weight_files(root)
    by_file: dict[Path, list[tuple[str, str]]] = {}
    seen: set[str] = set()
    for stored, fpath in files.items():
        name = stored[len("model.") :] if stored.startswith("model.") else stored
        if name not in expected:
            raise ValueError(f"unexpected tensor {stored!r} in {fpath} for a DFlash drafter")
        seen.add(name)
        by_file.setdefault(fpath, []).append((stored, name))
    missing = sorted(set(expected) - seen)
    if missing:
        raise ValueError(f"DFlash checkpoint {root} is missing tensor {missing[0]!r}")
    state: dict[str, torch.Tensor] = {}
    for fpath, names in by_file.items():
        if not fpath.is_file():
            raise FileNotFoundError(f"shard {fpath} named in {INDEX_NAME} does not exist")
        with _open_shard(fpath) as f:
            for stored, name in names:
                t = f.get_tensor(stored)
                if check_finite and t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    raise ValueError(
                        f"{fpath}: tensor {stored!r} has non-finite (NaN/Inf) values "
                        "(pass check_finite=False to load it anyway)"
                    )
                if tuple(t.shape) != tuple(expected[name].shape):
                    raise ValueError(
                        f"tensor {stored!r} in {fpath} has shape {tuple(t.shape)}, "
                        f"expected {tuple(expected[name].shape)}"
                    )
                state[name] = t.to(dtype)
    model = model.to_empty(device=device)
    model.load_state_dict(state, strict=True)
    model._rotary = _build_rotary(cfg).to(device)
    return model.to(dtype=dtype).eval()


# --------------------------------------------------------------------------
# Synthetic drafters
# --------------------------------------------------------------------------

DRAFTER_PRESETS = ("tiny", "full")


def synthetic_drafter_config(target_config: Mapping[str, Any], preset: str) -> dict[str, Any]:
    """A DFlash draft ``config.json`` matching a target's HF config.

    ``tiny``: 1 draft layer (2 when the target has >= 4 layers), the target's
    hidden size, small MLP. ``full``: 5 draft layers (z-lab's Qwen3-8B-b16
    drafter depth), the target's attention shape and an MLP as wide as the
    target's dense/expert intermediate size. Both are labelled synthetic.
    """
    if preset not in DRAFTER_PRESETS:
        raise ValueError(f"unknown drafter preset {preset!r}; choose one of {DRAFTER_PRESETS}")
    t = dict(target_config)
    hidden = int(t["hidden_size"])
    n_target = int(t["num_hidden_layers"])
    heads = int(t["num_attention_heads"])
    kv_heads = int(t.get("num_key_value_heads") or heads)
    head_dim = int(t.get("head_dim") or hidden // heads)
    vocab = int(t["vocab_size"])
    if preset == "tiny":
        inter = 2 * hidden
        ids = (
            default_target_layer_ids(n_target, 2)
            if n_target >= 5
            else sorted({min(1, n_target - 1), max(0, n_target - 2)})
        )
        layers = len(ids)
    else:
        inter = int(t.get("intermediate_size") or t.get("moe_intermediate_size") or 4 * hidden)
        layers = 5
        ids = default_target_layer_ids(n_target, 5) if n_target >= 5 else list(range(n_target))
    rope_theta = t.get("rope_theta")
    if rope_theta is None:
        rope_theta = (t.get("rope_parameters") or {}).get("rope_theta", 1_000_000.0)
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "pdflash_synthetic": True,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(t.get("rms_norm_eps", 1e-6)),
        "attention_bias": False,
        "hidden_act": "silu",
        "vocab_size": vocab,
        "max_position_embeddings": int(t.get("max_position_embeddings", 4096)),
        "rope_theta": float(rope_theta),
        "num_target_layers": n_target,
        "torch_dtype": str(t.get("torch_dtype") or t.get("dtype") or "bfloat16"),
        "dflash_config": {
            "target_layer_ids": [int(i) for i in ids],
            "mask_token_id": vocab - 1,
            "block_size": 16,
        },
    }


def write_synthetic_drafter(
    path: str | Path,
    target_config: Mapping[str, Any],
    preset: str = "tiny",
    *,
    seed: int = 0,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write a seeded random DFlash drafter (HF format) matching ``target_config``.

    The tensors are written with safetensors under z-lab's names and read back
    by :func:`load_drafter` through the same code path as a real checkpoint.
    """
    from safetensors.torch import save_file

    cfg_dict = synthetic_drafter_config(target_config, preset)
    if dtype is not None:
        cfg_dict["torch_dtype"] = str(dtype).removeprefix("torch.")
    out_dtype = getattr(torch, cfg_dict["torch_dtype"])
    cfg = DrafterConfig.from_dict(cfg_dict)
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in DFlashDrafter(cfg).state_dict().items()}
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            t = 1.0 + 0.02 * torch.randn(shape, generator=gen)
        else:
            fan_in = shape[-1]
            t = torch.randn(shape, generator=gen) * fan_in**-0.5
        tensors[name] = t.to(out_dtype).contiguous()
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    (root / CONFIG_NAME).write_text(json.dumps(cfg_dict, indent=2, sort_keys=True))
    save_file(tensors, str(root / WEIGHTS_NAME), metadata={"format": "pt", "pdflash": "synthetic"})
    return root


def synthetic_drafter_key(
    preset: str = "tiny", *, seed: int = 0, dtype: torch.dtype | None = None
) -> dict[str, Any]:
    """What a drafter :func:`write_synthetic_drafter` writes depends on,
    besides its target's config: its arguments, this module's source (the
    drafter's shapes, the writer) and the torch version (the random stream);
    a cache of written drafters keys them by it
    (:func:`pdflash.models.synthetic.cached_directory`)."""
    from pdflash.models.synthetic import source_digest

    return {
        "preset": preset,
        "seed": int(seed),
        "dtype": None if dtype is None else str(dtype).removeprefix("torch."),
        "writer": source_digest(__name__),
        "torch": torch.__version__,
    }


def drafter_writer(
    preset: str | None = None, *, subdir: str = "dflash-drafter", seed: int = 0
) -> Callable[[Path, Any], None]:
    """An ``on_written(path, config)`` hook for
    :func:`pdflash.models.write_synthetic_checkpoint`: writes a matching
    synthetic drafter into ``path / subdir`` (``tiny`` for tiny targets,
    ``full`` otherwise, unless ``preset`` says)."""

    def hook(path: Path, config: Any) -> None:
        cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        chosen = preset
        if chosen is None:
            marker = cfg.get("pdflash_synthetic") or {}
            chosen = (
                "tiny" if isinstance(marker, dict) and marker.get("preset") == "tiny" else "full"
            )
        write_synthetic_drafter(Path(path) / subdir, cfg, chosen, seed=seed)

    return hook
