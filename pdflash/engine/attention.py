"""Batched attention over paged KV for a flat token batch of many requests.

Queries of all requests are flattened into ``[T, heads, D]``. For one forward
the engine builds an :class:`AttentionBatch` once (index tensors shared by all
layers): each request's query rows and positions, and the flat KV slots of
all its keys, padded to the longest request. Each layer then gathers its keys
in one indexing op and runs one attention call over the padded batch,
honouring causality, a sliding window and gpt-oss attention sinks.

Two exact implementations: :func:`sdpa_attention` (torch's fused
``scaled_dot_product_attention``; a sink is one extra key whose logit is the
sink value, given through an additive mask, with a zero value row) and
:func:`masked_attention` (the explicit padded softmax in fp32, the reference).
:func:`paged_attention` uses the fused one where torch has it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdflash.protocols import AttentionSpec


@dataclass
class AttentionBatch:
    """Index tensors for one padded attention call (all int64/bool, on device).

    ``q_rows [R, Nq]``: flat query row of each padded query (``T`` = padding).
    ``q_pos [R, Nq]``: its position. ``k_slots [R, Lk]``: flat KV slot of each
    padded key (0 for padding). ``k_pos [R, Lk]``, ``k_valid [R, Lk]``.
    ``q_valid [R, Nq]``.
    """

    q_rows: torch.Tensor
    q_pos: torch.Tensor
    q_valid: torch.Tensor
    k_slots: torch.Tensor
    k_pos: torch.Tensor
    k_valid: torch.Tensor
    num_tokens: int

    @staticmethod
    def build(
        query_rows: list[list[int]],
        query_positions: list[list[int]],
        key_slots: list[list[int]],
        key_positions: list[list[int]],
        num_tokens: int,
        device: torch.device,
    ) -> AttentionBatch:
        r = len(query_rows)
        nq = max((len(x) for x in query_rows), default=0)
        lk = max((len(x) for x in key_slots), default=0)
        q_rows = torch.full((r, nq), num_tokens, dtype=torch.int64)
        q_pos = torch.zeros((r, nq), dtype=torch.int64)
        q_valid = torch.zeros((r, nq), dtype=torch.bool)
        k_slots = torch.zeros((r, lk), dtype=torch.int64)
        k_pos = torch.zeros((r, lk), dtype=torch.int64)
        k_valid = torch.zeros((r, lk), dtype=torch.bool)
        for i in range(r):
            n = len(query_rows[i])
            q_rows[i, :n] = torch.tensor(query_rows[i], dtype=torch.int64)
            q_pos[i, :n] = torch.tensor(query_positions[i], dtype=torch.int64)
            q_valid[i, :n] = True
            m = len(key_slots[i])
            k_slots[i, :m] = torch.tensor(key_slots[i], dtype=torch.int64)
            k_pos[i, :m] = torch.tensor(key_positions[i], dtype=torch.int64)
            k_valid[i, :m] = True
        return AttentionBatch(
            q_rows=q_rows.to(device),
            q_pos=q_pos.to(device),
            q_valid=q_valid.to(device),
            k_slots=k_slots.to(device),
            k_pos=k_pos.to(device),
            k_valid=k_valid.to(device),
            num_tokens=num_tokens,
        )

    def mask(self, *, causal: bool, sliding_window: int | None) -> torch.Tensor:
        """``[R, 1, Nq, Lk]`` visibility."""
        qp = self.q_pos[:, :, None]
        kp = self.k_pos[:, None, :]
        visible = self.k_valid[:, None, :].expand(-1, qp.shape[1], -1)
        if causal:
            visible = visible & (kp <= qp)
        if sliding_window is not None:
            visible = visible & (qp - kp < sliding_window)
            if not causal:
                visible = visible & (kp - qp < sliding_window)
        # padded query rows see key 0 only (results are discarded) so softmax is finite
        pad_q = ~self.q_valid[:, :, None]
        first = torch.zeros_like(visible)
        first[:, :, 0] = True
        visible = torch.where(pad_q, first, visible)
        return visible[:, None, :, :]

    def pad_queries(self, q: torch.Tensor) -> torch.Tensor:
        """``[T, H, D]`` -> ``[R, H, Nq, D]`` (padding rows are zeros)."""
        padded = torch.cat([q, q.new_zeros((1, *q.shape[1:]))], dim=0)
        return padded[self.q_rows].permute(0, 2, 1, 3)

    def unpad(self, out: torch.Tensor) -> torch.Tensor:
        """``[R, H, Nq, D]`` -> ``[T, H * D]`` in flat row order."""
        r, h, nq, d = out.shape
        flat = out.permute(0, 2, 1, 3).reshape(r * nq, h * d)
        rows = self.q_rows.reshape(-1)
        keep = self.q_valid.reshape(-1)
        result = flat.new_empty((self.num_tokens, h * d))
        result[rows[keep]] = flat[keep]
        return result


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
    *,
    scaling: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q [R, H, Nq, D]``, ``k/v [R, KVH, Lk, D]``, ``visible [R, 1, Nq, Lk]``.

    Grouped-query heads share K/V. Softmax runs in fp32. ``sinks`` ``[H]``
    adds one learned logit per head to the softmax denominator (gpt-oss).
    """
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads not a multiple of {kv_heads} kv heads")
    groups = heads // kv_heads
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scaling
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, heads, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v.float()).to(q.dtype)


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
    *,
    scaling: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`masked_attention` through ``F.scaled_dot_product_attention``.

    With ``sinks`` each head gets one extra key (zeros) whose logit is set by
    an additive mask column to the sink value, and whose value row is zero:
    the softmax denominator gains ``exp(sink)`` and nothing is added to the
    output, which is exactly the sink's definition. Without sinks the boolean
    mask goes to SDPA as is.
    """
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads not a multiple of {kv_heads} kv heads")
    if heads != kv_heads:
        # NOTE: expanded here rather than with enable_gqa=True, which not every
        # torch this runs on accepts together with a float mask
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    mask: torch.Tensor = visible
    if sinks is not None:
        r, _, nq, _ = q.shape
        k = torch.cat([k, k.new_zeros((r, heads, 1, k.shape[-1]))], dim=2)
        v = torch.cat([v, v.new_zeros((r, heads, 1, v.shape[-1]))], dim=2)
        logits = torch.zeros(visible.shape, dtype=q.dtype, device=q.device)
        logits = logits.masked_fill(~visible, float("-inf")).expand(r, heads, nq, -1)
        sink = sinks.to(q.dtype).view(1, heads, 1, 1).expand(r, heads, nq, 1)
        mask = torch.cat([logits, sink], dim=-1)
    out: torch.Tensor = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
    return out


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    spec: AttentionSpec,
    sinks: torch.Tensor | None,
    *,
    fused: bool = True,
) -> torch.Tensor:
    """Causal attention of flat queries ``[T, H, D]`` over paged keys -> ``[T, H * D]``.

    ``fused``: torch's SDPA (:func:`sdpa_attention`); False: the explicit
    fp32 padded softmax (:func:`masked_attention`).
    """
    qp = batch.pad_queries(q)
    kp = k_cache[batch.k_slots].permute(0, 2, 1, 3)
    vp = v_cache[batch.k_slots].permute(0, 2, 1, 3)
    visible = batch.mask(causal=True, sliding_window=spec.sliding_window)
    attend = sdpa_attention if fused else masked_attention
    out = attend(qp, kp, vp, visible, scaling=spec.scaling, sinks=sinks if spec.has_sinks else None)
    return batch.unpad(out)
