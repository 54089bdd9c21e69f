"""The fused paged attention over an AttentionBatch (masks, padding and sink
columns built once per forward) equals the fp32 reference exactly enough,
in every layout a forward produces, and issues no host sync."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pdflash.engine.attention import (
    KEY_ALIGN,
    AttentionBatch,
    device_int64,
    masked_attention,
    paged_attention,
    sdpa_attention,
    sdpa_backends,
)
from pdflash.models.attention import attend_visible
from pdflash.protocols import AttentionSpec

CPU = torch.device("cpu")


def _spec(heads: int, kv_heads: int, d: int, window: int | None, sinks: bool) -> AttentionSpec:
    return AttentionSpec(
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=d,
        scaling=d**-0.5,
        sliding_window=window,
        has_sinks=sinks,
    )


def _layout(
    q_lens: list[int], ctx_lens: list[int], *, interleave: bool = False
) -> tuple[list[list[int]], list[list[int]], list[list[int]], list[list[int]], int]:
    """Request i: ``q_lens[i]`` queries after ``ctx_lens[i]`` earlier keys, its
    keys on scattered slots. ``interleave``: flat rows alternate between
    requests (not one contiguous run each)."""
    total = sum(q_lens)
    if interleave:
        order: list[tuple[int, int]] = []
        for j in range(max(q_lens)):
            order += [(i, j) for i, n in enumerate(q_lens) if j < n]
        rows: list[list[int]] = [[0] * n for n in q_lens]
        for flat, (i, j) in enumerate(order):
            rows[i][j] = flat
    else:
        starts = [sum(q_lens[:i]) for i in range(len(q_lens))]
        rows = [list(range(s, s + n)) for s, n in zip(starts, q_lens, strict=True)]
    q_pos = [list(range(c, c + n)) for c, n in zip(ctx_lens, q_lens, strict=True)]
    k_slots = []
    base = 3
    for c, n in zip(ctx_lens, q_lens, strict=True):
        k_slots.append([base + 2 * p for p in range(c + n)])  # every other slot
        base += 2 * (c + n) + 5
    k_pos = [list(range(c + n)) for c, n in zip(ctx_lens, q_lens, strict=True)]
    return rows, q_pos, k_slots, k_pos, total


def _reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: tuple[list[list[int]], list[list[int]], list[list[int]], list[list[int]], int],
    spec: AttentionSpec,
    sinks: torch.Tensor | None,
    causal: bool,
) -> torch.Tensor:
    """Per request, the models' reference attention (an independent
    implementation) over that request's keys only."""
    rows, q_pos, k_slots, k_pos, total = layout
    out = torch.zeros(total, spec.num_heads * spec.head_dim)
    for r, qp, ks, kp in zip(rows, q_pos, k_slots, k_pos, strict=True):
        delta = torch.tensor(qp)[:, None] - torch.tensor(kp)[None, :]
        visible = delta >= 0 if causal else torch.ones_like(delta, dtype=torch.bool)
        if spec.sliding_window is not None:
            visible &= delta < spec.sliding_window
            if not causal:
                visible &= -delta < spec.sliding_window
        idx = torch.tensor(ks)
        out[r] = attend_visible(q[r], k_cache[idx], v_cache[idx], visible, spec, sinks)
    return out


CASES = [
    # (q_lens, ctx_lens, interleave)
    ([5], [0], False),  # one request, prefill
    ([16], [40], False),  # one request, verify block
    ([4, 4, 4], [3, 9, 20], False),  # uniform queries, ragged keys
    ([3, 1, 6], [7, 0, 2], False),  # ragged queries and keys
    ([2, 5, 3], [4, 1, 8], True),  # rows interleaved between requests
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(
    "heads,kv_heads,window,sinks,causal",
    [
        (4, 4, None, False, True),  # MHA, full causal
        (4, 2, None, False, True),  # GQA
        (8, 2, 2, True, True),  # window shorter than the block, sinks (gpt-oss)
        (8, 2, 3, False, True),
        (4, 1, None, True, True),
        (4, 2, None, False, False),  # bidirectional (drafter full layers)
        (4, 2, 3, False, False),
    ],
)
@pytest.mark.parametrize("null_slot", [False, True])
def test_paged_attention_equals_the_reference(
    case: tuple[list[int], list[int], bool],
    heads: int,
    kv_heads: int,
    window: int | None,
    sinks: bool,
    causal: bool,
    null_slot: bool,
) -> None:
    """``null_slot``: padding (and the sink key) read an always-zero KV row
    (the KV cache's) instead of slot 0 zeroed per call."""
    q_lens, ctx_lens, interleave = case
    layout = _layout(q_lens, ctx_lens, interleave=interleave)
    rows, q_pos, k_slots, k_pos, total = layout
    g = torch.Generator().manual_seed(sum(q_lens) + heads + (window or 0))
    d = 8
    spec = _spec(heads, kv_heads, d, window, sinks)
    slots = max(max(s) for s in k_slots) + 4
    k_cache = torch.randn(slots + 1, kv_heads, d, generator=g)
    v_cache = torch.randn(slots + 1, kv_heads, d, generator=g)
    k_cache[slots] = 0
    v_cache[slots] = 0
    q = torch.randn(total, heads, d, generator=g)
    sink_t = torch.randn(heads, generator=g) if sinks else None
    batch = AttentionBatch.build(
        rows, q_pos, k_slots, k_pos, total, CPU, null_slot=slots if null_slot else None
    )
    assert batch.zero_padding == null_slot
    assert batch.uniform == (len(set(q_lens)) == 1 and not interleave)
    assert batch.kv_slots.shape[1] % KEY_ALIGN == 0
    assert batch.kv_slots.shape[1] > batch.num_keys
    want = _reference(q, k_cache, v_cache, layout, spec, sink_t, causal)
    for fused in (True, False):
        got = paged_attention(q, k_cache, v_cache, batch, spec, sink_t, fused=fused, causal=causal)
        assert got.shape == (total, heads * d)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # a second layer over the same batch reuses the masks and gives the same
    again = paged_attention(q, k_cache, v_cache, batch, spec, sink_t, causal=causal)
    torch.testing.assert_close(again, want, atol=1e-5, rtol=0)


def test_masks_are_built_once_per_batch_and_window() -> None:
    rows, q_pos, k_slots, k_pos, total = _layout([3, 2], [4, 6])
    batch = AttentionBatch.build(rows, q_pos, k_slots, k_pos, total, CPU)
    a = batch.attn_bias(causal=True, sliding_window=2, dtype=torch.float32, sink=True)
    assert a is batch.attn_bias(causal=True, sliding_window=2, dtype=torch.float32, sink=True)
    b = batch.attn_bias(causal=True, sliding_window=None, dtype=torch.float32, sink=True)
    assert b is not a and not torch.equal(a, b)
    m = batch.mask(causal=True, sliding_window=None)
    assert m is batch.mask(causal=True, sliding_window=None)
    assert m.shape == (2, 1, 3, 8)
    # the sink column is 0 only with sink=True; padding keys are -inf
    lk = batch.num_keys
    plain = batch.attn_bias(causal=True, sliding_window=None, dtype=torch.float32, sink=False)
    assert bool((a[..., lk] == 0).all()) and bool(torch.isinf(plain[..., lk]).all())
    assert bool(torch.isinf(a[..., lk + 1 :]).all())


def test_sdpa_attention_equals_masked_attention_with_gqa_and_sinks() -> None:
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 6, 4, 8, generator=g)
    k = torch.randn(2, 3, 7, 8, generator=g)
    v = torch.randn(2, 3, 7, 8, generator=g)
    visible = torch.rand(2, 1, 4, 7, generator=g) > 0.4
    visible[..., 0] = True
    sinks = torch.randn(6, generator=g)
    for s in (None, sinks):
        torch.testing.assert_close(
            sdpa_attention(q, k, v, visible, scaling=0.3, sinks=s),
            masked_attention(q, k, v, visible, scaling=0.3, sinks=s),
            atol=1e-5,
            rtol=0,
        )


def test_sdpa_backends_setting_restricts_torch_and_keeps_the_result(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    g = torch.Generator().manual_seed(9)
    q = torch.randn(2, 6, 4, 8, generator=g)
    k = torch.randn(2, 3, 7, 8, generator=g)
    v = torch.randn(2, 3, 7, 8, generator=g)
    visible = torch.rand(2, 1, 4, 7, generator=g) > 0.4
    visible[..., 0] = True
    want = masked_attention(q, k, v, visible, scaling=0.3)
    monkeypatch.setenv("PDFLASH_SDPA_BACKENDS", " Math ")
    assert sdpa_backends() == "math"
    got = sdpa_attention(q, k, v, visible, scaling=0.3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # a backend this device cannot run for the call: torch refuses, nothing falls back
    monkeypatch.setenv("PDFLASH_SDPA_BACKENDS", "cudnn")
    with pytest.raises(RuntimeError):
        sdpa_attention(q, k, v, visible, scaling=0.3)
    for bad in ("fast", "math,fast", ","):
        monkeypatch.setenv("PDFLASH_SDPA_BACKENDS", bad)
        with pytest.raises(ValueError, match="PDFLASH_SDPA_BACKENDS"):
            sdpa_backends()
    monkeypatch.delenv("PDFLASH_SDPA_BACKENDS")
    assert sdpa_backends() == "auto"


class _OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[Any, ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append((str(func), args))
        return func(*args, **(kwargs or {}))


def _syncing(ops: list[tuple[str, tuple[Any, ...]]]) -> list[str]:
    """Ops that make the host wait for the device: a scalar read, nonzero,
    or indexing with a boolean mask (its result size depends on the data)."""
    bad = []
    for name, args in ops:
        if any(
            s in name for s in ("_local_scalar_dense", "nonzero", "masked_select", "is_nonzero")
        ):
            bad.append(name)
        elif name.startswith(("aten.index.", "aten.index_put")):
            idx = args[1] if len(args) > 1 else ()
            if any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in idx or ()):
                bad.append(f"{name} (boolean index)")
    return bad


@pytest.mark.parametrize("case", CASES)
def test_paged_attention_issues_no_host_sync(case: tuple[list[int], list[int], bool]) -> None:
    """No op in a layer's fused attention makes the host wait (and, once the
    batch's masks exist, none rebuilds them)."""
    q_lens, ctx_lens, interleave = case
    rows, q_pos, k_slots, k_pos, total = _layout(q_lens, ctx_lens, interleave=interleave)
    batch = AttentionBatch.build(rows, q_pos, k_slots, k_pos, total, CPU)
    spec = _spec(8, 2, 8, 3, True)
    k_cache = torch.randn(max(max(s) for s in k_slots) + 1, 2, 8)
    q = torch.randn(total, 8, 8)
    sinks = torch.randn(8)
    paged_attention(q, k_cache, k_cache, batch, spec, sinks)  # first layer builds the masks
    with _OpLog() as log:
        paged_attention(q, k_cache, k_cache, batch, spec, sinks)
    assert _syncing(log.ops) == []
    names = [n for n, _ in log.ops]
    assert not any("masked_fill" in n or n.startswith("aten.where") for n in names)


def test_old_unpad_would_have_been_caught() -> None:
    """The sync check sees a boolean-mask index (what unpad used to do)."""
    x = torch.randn(4, 3)
    keep = torch.tensor([True, False, True, True])
    with _OpLog() as log:
        _ = x[keep]
    assert _syncing(log.ops)


def test_device_int64_splits_one_copy() -> None:
    a, b, c = device_int64([[1, 2], [], [3, 4, 5]], CPU)
    assert a.tolist() == [1, 2] and b.tolist() == [] and c.tolist() == [3, 4, 5]
    assert a.dtype == torch.int64


def test_build_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="request 0"):
        AttentionBatch.build([[0, 1]], [[0]], [[0, 1]], [[0, 1]], 2, CPU)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_drafter_rope_tables_are_bit_exact(dtype: torch.dtype) -> None:
    from pdflash.engine.drafter import apply_rope, apply_rope_tables, rope_tables

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(9, 4, 16, generator=g) * 5).to(dtype)
    angle = torch.rand(9, 8, generator=g) * 40
    cos = torch.cat([angle.cos(), angle.cos()], dim=-1).to(dtype)
    sin = torch.cat([angle.sin(), angle.sin()], dim=-1).to(dtype)
    cc, ss = rope_tables(cos, sin)
    assert torch.equal(apply_rope_tables(x, cc, ss), apply_rope(x, cos, sin))
