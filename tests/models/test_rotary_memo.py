"""The adapter's rotary memo: one cos/sin computation per forward, never a
stale one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdflash.models import load_adapter


def test_rotary_is_reused_for_the_same_positions_only(
    tiny_checkpoints: dict[str, Path], host_issuer: object
) -> None:
    ad = load_adapter(tiny_checkpoints["qwen3_moe"], issuer=host_issuer, cache_fraction=0.5)
    calls = []
    rotary = ad._inner.rotary_emb
    handle = rotary.register_forward_hook(lambda *a: calls.append(1))
    try:
        x = torch.randn(5, ad.hidden_size)
        pos = torch.arange(3, 8)
        with torch.no_grad():
            q0, _, _ = ad.project_qkv(0, x, pos)
            q1, k1, _ = ad.project_qkv(1, x, pos)
            assert len(calls) == 1  # the second layer reused layer 0's cos/sin
            cos, sin = ad.rotary(pos, x)
            assert len(calls) == 1
            # equal positions in a new tensor: recomputed, same values
            fresh = pos.clone()
            cos2, sin2 = ad.rotary(fresh, x)
            assert len(calls) == 2
            torch.testing.assert_close(cos2, cos, atol=0, rtol=0)
            torch.testing.assert_close(sin2, sin, atol=0, rtol=0)
            q1b, k1b, _ = ad.project_qkv(1, x, fresh)
            torch.testing.assert_close(q1b, q1, atol=0, rtol=0)
            torch.testing.assert_close(k1b, k1, atol=0, rtol=0)
            # the same tensor modified in place: recomputed, new values
            pos.add_(4)
            qa, ka, _ = ad.project_qkv(0, x, pos)
            assert len(calls) == 3
            qb, kb, _ = ad.project_qkv(0, x, torch.arange(7, 12))
            assert len(calls) == 4
            torch.testing.assert_close(qa, qb, atol=0, rtol=0)
            torch.testing.assert_close(ka, kb, atol=0, rtol=0)
            assert not torch.equal(qa, q0)
            # another dtype for ``like``: recomputed
            ad.rotary(pos, x.double())
            assert len(calls) == 5
    finally:
        handle.remove()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "mixtral", "olmoe"])
def test_own_rotary_is_bit_exact_with_transformers(
    arch: str, dtype: torch.dtype, tiny_checkpoints: dict[str, Path], host_issuer: object
) -> None:
    """project_qkv's rotary (rotary_style) equals the transformers module's
    apply_rotary_pos_emb bit for bit, for the q and k of several positions."""
    ad = load_adapter(tiny_checkpoints[arch], issuer=host_issuer, cache_fraction=0.5, dtype=dtype)
    assert ad.rotary_style is not None
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(7, ad.hidden_size, generator=g) * 3).to(dtype)
    pos = torch.tensor([0, 1, 5, 17, 18, 60, 61])
    with torch.no_grad():
        for layer in range(ad.num_decoder_layers):
            q, k, v = ad.project_qkv(layer, x, pos)
            ad.rotary_style = None  # the instance falls back to transformers' function
            try:
                q_ref, k_ref, v_ref = ad.project_qkv(layer, x, pos)
            finally:
                del ad.rotary_style
            assert q.dtype == q_ref.dtype == dtype
            assert torch.equal(q, q_ref) and torch.equal(k, k_ref) and torch.equal(v, v_ref)
