"""A plain reference attention over :class:`~pdflash.protocols.AttentionSpec`.

For engines that run attention themselves: this is the exact semantics the
adapters' ``project_qkv`` outputs expect (causal, optional sliding window as
transformers defines it — key ``j`` is visible from query ``i`` when
``0 <= pos_i - pos_j < window`` — GQA, and gpt-oss sinks as an extra logit
per head that takes probability mass and is dropped). It is O(T*S) memory
and meant for tests and small batches, not for speed.
"""

from __future__ import annotations

import torch

from pdflash.protocols import AttentionSpec


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: AttentionSpec,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q [T, heads, D]``, ``k``/``v [S, kv_heads, D]`` -> ``[T, heads * D]``."""
    _, h, d = q.shape
    if h != spec.num_heads or k.shape[1] != spec.num_kv_heads or d != spec.head_dim:
        raise ValueError(f"q {tuple(q.shape)} / k {tuple(k.shape)} do not match {spec}")
    delta = q_positions.reshape(-1, 1) - k_positions.reshape(1, -1)
    return attend_visible(q, k, v, visible_keys(delta, spec), spec, sinks)


def visible_keys(delta: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """Key ``j`` is visible from query ``i`` when ``0 <= delta[i, j] <
    window`` (``delta = pos_i - pos_j``; no window: ``delta >= 0``)."""
    visible = delta >= 0
    if spec.sliding_window is not None:
        visible &= delta < spec.sliding_window
    return visible


def attend_visible(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
    spec: AttentionSpec,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference softmax attention over any leading batch dims:
    ``q [..., T, heads, D]``, ``k``/``v [..., S, kv_heads, D]``, ``visible
    [T, S]`` -> ``[..., T, heads * D]``. Logits and the sink column in the
    inputs' dtype, softmax in fp32 (the op order both :func:`reference_attention`
    and the route-ahead proxy's block attention rely on)."""
    *lead, t, h, d = q.shape
    rep = spec.num_heads // spec.num_kv_heads
    kk = k.repeat_interleave(rep, dim=-2).transpose(-3, -2)  # [..., h, S, D]
    vv = v.repeat_interleave(rep, dim=-2).transpose(-3, -2)
    logits = (
        torch.matmul(q.transpose(-3, -2), kk.transpose(-2, -1)) * spec.scaling
    )  # [..., h, T, S]
    logits = logits.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink = sinks.reshape(h, 1, 1).expand(*lead, h, t, 1).to(logits.dtype)
        combined = torch.cat([logits, sink], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined.float(), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(logits.float(), dim=-1)
    out = torch.matmul(probs.to(vv.dtype), vv)  # [..., h, T, D]
    return out.transpose(-3, -2).reshape(*lead, t, h * d)
