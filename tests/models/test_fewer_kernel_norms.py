"""The norms in fewer kernels (:mod:`pdflash.models.adapters._norms`) equal
transformers' modules bit for bit on the CPU; Qwen3-MoE's q/k norms run as
one norm over the joined q and k heads (``Qwen3MoeAdapter.qk_joint``):
equal, bit for bit on the CPU, to the two transformers norms it replaces,
joined afterwards (the base adapter's ``qk_joint``), at the tiny shape and
at Qwen3-30B-A3B's head layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pdflash.models import load_adapter, write_synthetic_checkpoint
from pdflash.models.adapters.base import MoEAdapterBase

#: Qwen3-30B-A3B's attention heads (32 q, 4 kv, head_dim 128) at a small width
REAL_HEADS = {
    "hidden_size": 64,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 128,
}


def _adapter(tmp: Path, dtype: torch.dtype, device: str, **overrides: Any) -> Any:
    path = write_synthetic_checkpoint(
        tmp / "q", "qwen3_moe", "tiny", dtype=dtype, seed=3, config_overrides=overrides
    )
    return load_adapter(path, device=device, dtype=dtype)


def _check(ad: Any, dtype: torch.dtype, device: str, exact: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = int(ad.config.hidden_size)
    for layer in range(ad.num_decoder_layers):
        attn = ad._attn(layer)
        x = torch.randn(37, hidden, generator=gen).to(device, dtype)
        with torch.no_grad():
            got, heads, v = ad.qk_joint(attn, x)
            want, want_heads, want_v = MoEAdapterBase.qk_joint(ad, attn, x)
            again, _, _ = ad.qk_joint(attn, x)  # through the kept joint weight
        assert heads == want_heads == int(ad.config.num_attention_heads)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert torch.equal(v, want_v) and torch.equal(again, got)
        assert id(attn) in ad._qk_w  # the joint norm ran (its weight kept)
        if exact:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", ["tiny", "real_heads"])
def test_joint_qk_norm_equals_the_two_norms(tmp_path: Path, dtype: torch.dtype, shape: str) -> None:
    overrides = REAL_HEADS if shape == "real_heads" else {}
    ad = _adapter(tmp_path, dtype, "cpu", **overrides)
    _check(ad, dtype, "cpu", exact=True)


def test_joint_qk_norm_falls_back_when_the_norms_differ(tmp_path: Path) -> None:
    ad = _adapter(tmp_path, torch.float32, "cpu")
    attn = ad._attn(0)
    attn.k_norm.variance_epsilon = attn.q_norm.variance_epsilon * 2
    x = torch.randn(5, int(ad.config.hidden_size), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = ad.qk_joint(attn, x)[0]
        q, k, _ = ad.qkv(attn, x)  # each HF norm with its own eps
    assert torch.equal(got, torch.cat([q, k], dim=1))


@pytest.mark.gpu
def test_joint_qk_norm_on_cuda_bf16(tmp_path: Path) -> None:
    ad = _adapter(tmp_path, torch.bfloat16, "cuda", **REAL_HEADS)
    _check(ad, torch.bfloat16, "cuda", exact=False)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_the_transformers_module(arch: str, dtype: torch.dtype) -> None:
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    from pdflash.models.adapters._norms import rms_norm

    cls = Qwen3MoeRMSNorm if arch == "qwen3_moe" else GptOssRMSNorm
    gen = torch.Generator().manual_seed(2)
    for width, eps in ((2048, 1e-6), (64, 1e-5), (2880, 1e-5)):
        norm = cls(width, eps=eps)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(width, generator=gen))
        norm = norm.to(dtype)
        x = (torch.randn(33, width, generator=gen) * 3).to(dtype)
        with torch.no_grad():
            got, want = rms_norm(norm, x), norm(x)
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_rms_norm_calls_other_modules() -> None:
    from pdflash.models.adapters._norms import rms_norm

    norm = torch.nn.LayerNorm(8)
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(rms_norm(norm, x), norm(x))


def test_rms_norm_keeps_gradients() -> None:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    from pdflash.models.adapters._norms import rms_norm

    norm = Qwen3MoeRMSNorm(16)
    x = torch.randn(4, 16, requires_grad=True)
    rms_norm(norm, x).sum().backward()
    assert x.grad is not None and norm.weight.grad is not None
