"""The Triton MXFP4 dequantizer on CUDA: bit-identical to the torch path, and
the MXFP4 grouped block through it still matches the dense path."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pdflash.models import layout, load_adapter, write_synthetic_checkpoint
from pdflash.models.layout import (
    dequantize_mxfp4,
    dequantize_mxfp4_torch,
    mxfp4_dequant_calls,
    mxfp4_dequantizer,
    mxfp4_triton_unavailable,
    set_mxfp4_dequantizer,
)

pytestmark = pytest.mark.gpu

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


@pytest.fixture(scope="module")
def triton_kernel() -> Any:
    pytest.importorskip("triton")
    reason = mxfp4_triton_unavailable("cuda")
    assert reason is None, reason  # triton imports: the kernel must compile and agree
    from pdflash.models.mxfp4_triton import dequantize_mxfp4_triton

    return dequantize_mxfp4_triton


@pytest.fixture
def restore_mode() -> Iterator[None]:
    mode = layout._dequant_mode
    yield
    layout._dequant_mode = mode


def _assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    nan = want.isnan()  # fp16 0 * inf scale, e8m0 255: same places, payloads may differ
    assert torch.equal(got.isnan(), nan)
    ints = _INT_VIEW[want.dtype]
    assert torch.equal(got.view(ints)[~nan], want.view(ints)[~nan])


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_equals_torch_bit_for_bit_on_cuda(triton_kernel: Any, dtype: torch.dtype) -> None:
    edge = list(range(256))  # every scale, every byte
    blocks = torch.arange(256, dtype=torch.uint8).view(1, 16, 16).expand(256, 16, 16).cuda()
    scales = torch.tensor(edge, dtype=torch.uint8).view(-1, 1).expand(256, 16).cuda()
    _assert_same_bits(
        triton_kernel(blocks, scales, dtype), dequantize_mxfp4_torch(blocks, scales, dtype)
    )
    g = torch.Generator().manual_seed(1)
    # the last two: gpt-oss-20b down and gate_up blocks of 4 and 8 experts
    for shape in [(3, 7), (2, 5, 7), (4, 2880, 90), (8, 5760, 90)]:
        b = torch.randint(0, 256, (*shape, 16), generator=g, dtype=torch.uint8).cuda()
        s = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).cuda()
        _assert_same_bits(triton_kernel(b, s, dtype), dequantize_mxfp4_torch(b, s, dtype))
        # strided (every other slot), as a slab view would be
        _assert_same_bits(
            triton_kernel(b[::2], s[::2], dtype), dequantize_mxfp4_torch(b[::2], s[::2], dtype)
        )


def test_dispatch_picks_triton_and_forced_paths_agree(
    triton_kernel: Any, restore_mode: None
) -> None:
    set_mxfp4_dequantizer("auto")
    assert mxfp4_dequantizer("cuda") == "triton"
    g = torch.Generator().manual_seed(2)
    b = torch.randint(0, 256, (8, 64, 4, 16), generator=g, dtype=torch.uint8).cuda()
    s = torch.randint(110, 140, (8, 64, 4), generator=g, dtype=torch.uint8).cuda()
    before = mxfp4_dequant_calls()
    got = dequantize_mxfp4(b, s, torch.bfloat16)
    assert mxfp4_dequant_calls()["triton"] == before["triton"] + 1
    set_mxfp4_dequantizer("torch")
    assert mxfp4_dequantizer("cuda") == "torch"
    assert torch.equal(got, dequantize_mxfp4(b, s, torch.bfloat16))
    set_mxfp4_dequantizer("triton")
    assert torch.equal(got, dequantize_mxfp4(b, s, torch.bfloat16))


def test_mxfp4_grouped_block_triton_equals_torch_and_matches_dense(
    triton_kernel: Any,
    restore_mode: None,
    tmp_path: Path,
    cuda_issuer: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the dequantize-first path (the default, auto, takes the fused kernel on CUDA)
    monkeypatch.setenv("PDFLASH_COMPRESSED_GEMM", "dequant")
    path = write_synthetic_checkpoint(
        tmp_path / "g",
        "gpt_oss",
        num_layers=2,
        device="cuda",
        expert_format="mxfp4",
        config_overrides={
            "hidden_size": 256,
            "num_attention_heads": 4,
            "head_dim": 64,
            "intermediate_size": 512,
            "num_local_experts": 32,
            "num_experts_per_tok": 4,
        },
    )
    set_mxfp4_dequantizer("triton")
    ad = load_adapter(path, device="cuda", issuer=cuda_issuer, cache_fraction=1.0)
    dense = load_adapter(
        path, device="cuda", issuer=cuda_issuer, cache_fraction=1.0, expert_dtype="dense"
    )
    assert ad.layout.format == "mxfp4" and ad.runtime is not None
    assert ad.runtime.path == "grouped" and ad.cache is not None
    assert ad.runtime.compressed_gemm == "dequant"
    # every expert resident first: both dequantizers then run the same all-hit path
    ad.cache.prefetch(np.arange(ad.cache.num_ids))
    ad.cache.drain_inflight()
    for layer in range(ad.num_layers):
        x = torch.randn(64, 256, generator=torch.Generator().manual_seed(layer)).to(
            "cuda", torch.bfloat16
        )
        with torch.no_grad():
            ids, weights = ad.route(layer, x)
            set_mxfp4_dequantizer("triton")
            before = mxfp4_dequant_calls()
            got = ad.moe_routed(layer, x, ids, weights)
            assert mxfp4_dequant_calls()["triton"] > before["triton"]
            set_mxfp4_dequantizer("torch")
            got_torch = ad.moe_routed(layer, x, ids, weights)
            got_dense = dense.moe_routed(layer, x, ids, weights).float()
            want = ad.resident_block(layer)(x[None])
            want = (want[0] if isinstance(want, tuple) else want)[0].float()
        assert torch.equal(got, got_torch)  # same dequantized bits, same GEMMs
        assert (got.float() - got_dense).abs().max() <= 1e-2 * want.abs().max()
        assert (got.float() - want).abs().max() <= 1e-2 * want.abs().max()
    ad.close()
    dense.close()
