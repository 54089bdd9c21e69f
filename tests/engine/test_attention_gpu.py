"""The fused paged attention on CUDA: equals the fp32 reference within bf16
tolerance (gpt-oss and Qwen3 attention shapes, ragged batch, sinks, window)
and makes no host sync once the batch's masks exist."""

from __future__ import annotations

import pytest
import torch

from pdflash.engine.attention import AttentionBatch, device_int64, paged_attention
from pdflash.protocols import AttentionSpec

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")


@pytest.mark.parametrize(
    "heads,kv_heads,d,window,sinks",
    [(64, 8, 64, 128, True), (64, 8, 64, None, True), (32, 4, 128, None, False)],
)
def test_fused_paged_attention_on_cuda(
    heads: int, kv_heads: int, d: int, window: int | None, sinks: bool
) -> None:
    g = torch.Generator().manual_seed(0)
    q_lens = [16] * 15 + [9]  # one request granted fewer tokens: not uniform
    ctx = [64 + 3 * i for i in range(16)]
    rows, q_pos, k_slots, k_pos = [], [], [], []
    row, base = 0, 0
    for n, c in zip(q_lens, ctx, strict=True):
        rows.append(list(range(row, row + n)))
        q_pos.append(list(range(c, c + n)))
        k_slots.append(list(range(base, base + c + n)))
        k_pos.append(list(range(c + n)))
        row += n
        base += c + n + 7
    total = row
    spec = AttentionSpec(heads, kv_heads, d, d**-0.5, window, sinks)
    k_cache = torch.randn(base, kv_heads, d, generator=g).to(CUDA, torch.bfloat16)
    v_cache = torch.randn(base, kv_heads, d, generator=g).to(CUDA, torch.bfloat16)
    q = torch.randn(total, heads, d, generator=g).to(CUDA, torch.bfloat16)
    sink_t = torch.randn(heads, generator=g).to(CUDA, torch.bfloat16) if sinks else None
    batch = AttentionBatch.build(rows, q_pos, k_slots, k_pos, total, CUDA)
    want = paged_attention(
        q.float(),
        k_cache.float(),
        v_cache.float(),
        batch,
        spec,
        None if sink_t is None else sink_t.float(),
        fused=False,
    )
    got = paged_attention(q, k_cache, v_cache, batch, spec, sink_t)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = paged_attention(q, k_cache, v_cache, batch, spec, sink_t)
        (a,) = device_int64([[1, 2, 3]], CUDA)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(again, got)
    assert a.tolist() == [1, 2, 3]


def test_host_staging_on_cuda_is_pinned_async_and_safe_to_reuse() -> None:
    """The staging buffers are pinned and reused; a buffer written again
    while the stream is still busy (ring of one) waits for the copy that read
    it, so every result holds its own values."""
    from pdflash.engine.attention import HostStaging

    staging = HostStaging(CUDA, depth=1)
    a = torch.randn(2048, 2048, device=CUDA)
    for _ in range(4):
        a = a @ a / 2048  # keep the stream busy while the copies queue behind it
    got = [staging.copy([list(range(i, i + 100))])[0] for i in range(20)]
    torch.cuda.synchronize()
    assert [t.tolist() for t in got] == [list(range(i, i + 100)) for i in range(20)]
    assert staging.allocations == 1
    buf = staging._buffers[0]
    assert buf is not None and buf.is_pinned()
