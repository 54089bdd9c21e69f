"""The fused grouped dequantize-GEMM (``PDFLASH_COMPRESSED_GEMM=fused``) on
the CPU through Triton's interpreter (skips where triton is not installed):
against dequantize-then-matmul in fp32, transformers' MXFP4 reference, and
the whole offloaded block's dequant path; the tile map and the mode switch
need neither triton nor CUDA.

Tolerance: the kernel and the reference sum the same fp32 products in a
different order, so outputs agree to ``1e-5`` of the largest output
magnitude (fp32 has 24 bits; K <= 160 here); a one-hot activation reads one
product per output, which is exact."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from triton_interpreted import interpreted

from pdflash.models import compressed_gemm, load_adapter, offload
from pdflash.models.compressed_gemm import (
    FusedGemmUnavailableError,
    FusedSlabMLP,
    choose_compressed_gemm,
    compressed_gemm_mode,
    pick_block_m,
    set_compressed_gemm,
    tile_map,
)
from pdflash.models.layout import dequantize_mxfp4_torch, quantize_fp8

# the interpreter evaluates sigmoid's exp in numpy, which warns where it overflows to inf
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

REL_TOL = 1e-5
ALPHA, LIMIT = 1.702, 7.0


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    """A fresh copy of the kernel module decorated under ``TRITON_INTERPRET=1``
    (triton picks the interpreter at decoration time), so it runs on CPU
    tensors. The MXFP4 kernel module it imports its e2m1 decoder from is
    loaded fresh too, under the interpreter, while it imports (an interpreted
    kernel cannot call a compiled helper)."""
    return interpreted(
        ("pdflash.models.mxfp4_triton", "_mxfp4_triton_interpreted"),
        ("pdflash.models.fused_moe_triton", "_fused_moe_interpreted"),
    )


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    scale = max(1.0, float(want.abs().max()))
    err = float((got - want).abs().max())
    assert err <= REL_TOL * scale, f"max abs error {err} vs {REL_TOL} x {scale}"


def _rows(key: list[int], x_rows: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    key_t = torch.tensor(key)
    order = torch.argsort(key_t, stable=True)
    return key_t[order], torch.tensor(x_rows)[order], order


def _reference(
    x: torch.Tensor,
    x_rows: torch.Tensor,
    key: torch.Tensor,
    width: int,
    w: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``x[x_rows[r]] @ w[key[r]].T (+ bias)`` for the unmasked rows; ``w [S, N, K]``."""
    live = key < width
    out = torch.einsum("rk,rnk->rn", x[x_rows[live]], w[key[live]])
    return out if bias is None else out + bias[key[live]]


def _gptoss(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up[:, ::2].clamp(max=LIMIT), gate_up[:, 1::2].clamp(-LIMIT, LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * ALPHA))


def _silu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


# slot keys per routed row (width = masked), as the grouped path sorts them:
# slot 1 empty, slot 3 a group of one row, slot 2 more rows than one tile
ROUTING = (
    [0, 2, 2, 3, 0, 2, 2, 2, 5, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 4, 0],
    [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2],
)
WIDTH = 5  # slots 0..4; key 5 is a masked row


def _mxfp4(g: torch.Generator, slots: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = torch.randint(0, 256, (slots, n, k // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(118, 132, (slots, n, k // 32), generator=g, dtype=torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("k", [32, 96, 160])  # BLOCK_K 64 (interpreter): 0.5, 1.5, 2.5 blocks
@pytest.mark.parametrize("act", ["none", "gptoss"])
def test_mxfp4_fused_equals_dequantize_then_matmul(kernels: ModuleType, k: int, act: str) -> None:
    g = torch.Generator().manual_seed(k)
    n = 72  # 2.25 BLOCK_N tiles (36 after the gate/up pairing)
    blocks, scales = _mxfp4(g, WIDTH, n, k)
    bias = torch.randn(WIDTH, n, generator=g)
    x = torch.randn(7, k, generator=g)
    key, x_rows, _ = _rows(*ROUTING)
    dense = dequantize_mxfp4_torch(blocks, scales, torch.float32)  # [S, N, K]
    want = _reference(x, x_rows, key, WIDTH, dense, bias)
    w = kernels.SlabWeight("mxfp4", blocks, scales, bias)
    live = key < WIDTH
    for block_m in (16, 32):
        tiles = tile_map(key, WIDTH, block_m, WIDTH)
        if act == "none":
            got = kernels.grouped_qgemm(x, x_rows, tiles, block_m, w)
            _close(got[live], want)
        else:
            got = kernels.grouped_qgemm(
                x, x_rows, tiles, block_m, w, act=kernels.ACT_GPTOSS, gate_up=(0, 1, 2),
                alpha=ALPHA, limit=LIMIT,
            )  # fmt: skip
            _close(got[live], _gptoss(want))


def test_mxfp4_fused_values_equal_transformers(kernels: ModuleType) -> None:
    """A one-hot activation reads each weight alone: the kernel's weights are
    transformers' dequantized experts exactly (every scale class a checkpoint
    holds, and both signs of every code)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(3)
    slots, n, k = 3, 40, 64
    blocks, scales = _mxfp4(g, slots, n, k)
    blocks[0, :16, 0] = torch.arange(256, dtype=torch.uint8).view(16, 16)
    scales[1] = torch.randint(100, 150, (n, k // 32), generator=g, dtype=torch.uint8)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [S, K, N]
    eye = torch.eye(k)
    key = torch.arange(slots).repeat_interleave(k)
    x_rows = torch.arange(k).repeat(slots)
    tiles = tile_map(key, slots, 16, slots)
    w = kernels.SlabWeight("mxfp4", blocks, scales)
    got = kernels.grouped_qgemm(eye, x_rows, tiles, 16, w)
    assert torch.equal(got.view(slots, k, n), want)
    # bf16 activations: the same values (exact in bf16), as transformers' bf16 experts
    got = kernels.grouped_qgemm(eye.bfloat16(), x_rows, tiles, 16, w)
    want_bf16 = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    assert torch.equal(got.view(slots, k, n), want_bf16)


def test_mxfp4_edge_scales_take_the_general_path_exactly(kernels: ModuleType) -> None:
    """Scale bytes outside 2..252 (subnormal products, 2^-127) switch a tile
    to the general dequantization; the one-hot product still reads the
    reference's exact values (finite scales only: an inf weight times a zero
    activation is NaN in any GEMM)."""
    g = torch.Generator().manual_seed(4)
    slots, n, k = 2, 32, 128
    blocks, scales = _mxfp4(g, slots, n, k)
    blocks[:, :16, 0] = torch.arange(256, dtype=torch.uint8).view(16, 16)
    edge = torch.tensor([0, 1, 2, 126, 252], dtype=torch.uint8)
    scales[0] = edge[torch.randint(0, 5, (n, k // 32), generator=g)]
    scales[1, :, 2:] = 0  # one tile of slot 1 in range, the next one not
    eye = torch.eye(k)
    key = torch.arange(slots).repeat_interleave(k)
    x_rows = torch.arange(k).repeat(slots)
    tiles = tile_map(key, slots, 16, slots)
    got = kernels.grouped_qgemm(eye, x_rows, tiles, 16, kernels.SlabWeight("mxfp4", blocks, scales))
    want = dequantize_mxfp4_torch(blocks, scales, torch.float32).transpose(1, 2)  # [S, K, N]
    # (equal values; a dot's sum turns -0 into +0, so signed zeros are not compared)
    assert torch.equal(got.view(slots, k, n), want)


@pytest.mark.parametrize("n_axis", [1, 2])  # [S, N, K] (SwiGLU archs) / [S, K, N] (gpt-oss)
@pytest.mark.parametrize("act", ["none", "silu", "gptoss"])
def test_fp8_fused_equals_dequantize_then_matmul(
    kernels: ModuleType, n_axis: int, act: str
) -> None:
    g = torch.Generator().manual_seed(n_axis * 10 + len(act))
    n, k = 48, 80  # K: 1.25 BLOCK_K
    dense = torch.randn(WIDTH, n, k, generator=g)
    q = [quantize_fp8(dense[s], 0) for s in range(WIDTH)]
    values = torch.stack([v for v, _ in q])  # [S, N, K]
    scale = torch.stack([s for _, s in q])
    deq = values.float() * scale[..., None]
    stored = values if n_axis == 1 else values.transpose(1, 2).contiguous()
    bias = torch.randn(WIDTH, n, generator=g) if act == "gptoss" else None
    x = torch.randn(7, k, generator=g)
    key, x_rows, _ = _rows(*ROUTING)
    live = key < WIDTH
    want = _reference(x, x_rows, key, WIDTH, deq, bias)
    w = kernels.SlabWeight("fp8", stored, scale, bias, n_axis=n_axis)
    tiles = tile_map(key, WIDTH, 16, WIDTH)
    if act == "none":
        got = kernels.grouped_qgemm(x, x_rows, tiles, 16, w)
        _close(got[live], want)
    elif act == "silu":
        got = kernels.grouped_qgemm(
            x, x_rows, tiles, 16, w, act=kernels.ACT_SILU, gate_up=(0, n // 2, 1)
        )
        _close(got[live], _silu(want))
    else:
        got = kernels.grouped_qgemm(
            x, x_rows, tiles, 16, w, act=kernels.ACT_GPTOSS, gate_up=(0, 1, 2), alpha=ALPHA,
            limit=LIMIT,
        )  # fmt: skip
        _close(got[live], _gptoss(want))


def test_bf16_activations_accumulate_in_fp32(kernels: ModuleType) -> None:
    g = torch.Generator().manual_seed(9)
    blocks, scales = _mxfp4(g, WIDTH, 32, 128)
    x = torch.randn(7, 128, generator=g).bfloat16()
    key, x_rows, _ = _rows(*ROUTING)
    live = key < WIDTH
    tiles = tile_map(key, WIDTH, 16, WIDTH)
    got = kernels.grouped_qgemm(x, x_rows, tiles, 16, kernels.SlabWeight("mxfp4", blocks, scales))
    assert got.dtype == torch.bfloat16
    dense = dequantize_mxfp4_torch(blocks, scales, torch.float32)
    want = _reference(x.float(), x_rows, key, WIDTH, dense, None)
    # bf16 inputs are exact in fp32: one rounding of the fp32 sum to bf16, which the
    # interpreter truncates (2^-7 relative; the GPU rounds to nearest, 2^-8)
    atol = 1e-5 * float(want.abs().max())
    torch.testing.assert_close(got[live].float(), want, rtol=2**-7, atol=atol)


def test_no_rows_and_bad_inputs(kernels: ModuleType) -> None:
    g = torch.Generator().manual_seed(1)
    blocks, scales = _mxfp4(g, 2, 8, 32)
    w = kernels.SlabWeight("mxfp4", blocks, scales)
    empty = torch.zeros(0, dtype=torch.long)
    out = kernels.grouped_qgemm(torch.zeros(3, 32), empty, tile_map(empty, 2, 16, 2), 16, w)
    assert out.shape == (0, 8)
    with pytest.raises(ValueError, match="x must be"):
        kernels.grouped_qgemm(torch.zeros(3, 64), empty, tile_map(empty, 2, 16, 2), 16, w)
    with pytest.raises(ValueError, match="do not match"):
        kernels.SlabWeight("mxfp4", blocks, scales[:, :4]).check()
    with pytest.raises(ValueError, match="FP8 scales"):
        kernels.SlabWeight(
            "fp8", torch.zeros(2, 8, 32, dtype=torch.float8_e4m3fn), torch.zeros(2, 4)
        ).check()


def test_probe_passes_under_the_interpreter(kernels: ModuleType) -> None:
    assert compressed_gemm.probe_error(kernels, torch.device("cpu")) is None


def test_dot_scaled_is_refused_where_it_cannot_run(kernels: ModuleType) -> None:
    g = torch.Generator().manual_seed(2)
    blocks, scales = _mxfp4(g, 2, 8, 64)
    w = kernels.SlabWeight("mxfp4", blocks, scales)
    key = torch.zeros(3, dtype=torch.long)
    tiles = tile_map(key, 2, 16, 2)
    x = torch.randn(3, 64, generator=g).bfloat16()
    with pytest.raises(ValueError, match="not the interpreter"):
        kernels.grouped_qgemm(x, torch.arange(3), tiles, 16, w, mxfp4_dot="scaled")
    with pytest.raises(ValueError, match="mxfp4_dot"):
        kernels.grouped_qgemm(x, torch.arange(3), tiles, 16, w, mxfp4_dot="tensor")
    # FP8 weights ignore the MXFP4 choice
    fp8 = kernels.SlabWeight(
        "fp8", torch.ones(2, 8, 64).to(torch.float8_e4m3fn), torch.ones(2, 8), None
    )
    out = kernels.grouped_qgemm(x.float(), torch.arange(3), tiles, 16, fp8, mxfp4_dot="scaled")
    assert torch.equal(out, x.float().sum(1, keepdim=True).expand(3, 8))


# -- the tile map and the mode switch (no triton) ------------------------------


@pytest.mark.parametrize("block_m", [1, 2, 16])
def test_tile_map_covers_every_live_row_once(block_m: int) -> None:
    key, _, _ = _rows(*ROUTING)
    slot, start, end = tile_map(key, WIDTH, block_m, 4)
    n = key.numel()
    assert slot.numel() == -(-n // block_m) + 4
    covered = torch.zeros(n, dtype=torch.long)
    for s, a, b in zip(slot.tolist(), start.tolist(), end.tolist(), strict=True):
        if s < 0:
            continue
        assert 0 < min(b, a + block_m) - a <= block_m
        rows = torch.arange(a, min(b, a + block_m))
        assert bool((key[rows] == s).all())  # one group per tile
        covered[rows] += 1
    assert torch.equal(covered, (key < WIDTH).long())  # live rows once, masked rows never
    live = slot >= 0
    assert bool(live[: int(live.sum())].all())  # dead tiles only at the end


@pytest.mark.parametrize(("width", "block_m"), [(1, 16), (5, 1), (5, 2), (7, 4), (40, 16)])
def test_kernel_tile_map_equals_the_torch_reference(
    kernels: ModuleType, width: int, block_m: int
) -> None:
    g = torch.Generator().manual_seed(width * 100 + block_m)
    for n in (0, 1, 23, 64):
        # keys in [0, width]: width is a masked row; some groups empty
        key = torch.sort(torch.randint(0, width + 1, (n,), generator=g)).values
        want = tile_map(key, width, block_m, width)
        got = kernels.tile_map(key, width, block_m, width)
        assert torch.equal(got[0], want[0])
        live = want[0] >= 0  # dead tiles' row ranges are never read
        assert torch.equal(got[1][live], want[1][live]) and torch.equal(got[2][live], want[2][live])
    with pytest.raises(ValueError, match="width >= 1"):
        kernels.tile_map(torch.zeros(3, dtype=torch.long), 0, 16, 4)


def test_tile_map_refuses_an_empty_slab() -> None:
    with pytest.raises(ValueError, match="width >= 1"):
        tile_map(torch.zeros(3, dtype=torch.long), 0, 16, 4)


def test_pick_block_m() -> None:
    assert pick_block_m(64, 32) == 16  # gpt-oss, 16 tokens x top-4 over 32 experts
    assert pick_block_m(256, 32) == 16  # 64 tokens: 8 rows per expert on average
    assert pick_block_m(1024, 32) == 64  # 256 tokens: 32 on average, up to ~45
    assert pick_block_m(2048, 128) == 32  # Qwen3 256 tokens x top-8 over 128 experts
    assert pick_block_m(512, 128) == 16  # Qwen3 64 tokens
    assert pick_block_m(0, 32) == 16


def test_mode_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    set_compressed_gemm(None)
    monkeypatch.delenv("PDFLASH_COMPRESSED_GEMM", raising=False)
    assert compressed_gemm_mode() == "auto"  # the default: fused where it runs
    monkeypatch.setenv("PDFLASH_COMPRESSED_GEMM", "fused")
    assert compressed_gemm_mode() == "fused"
    monkeypatch.setenv("PDFLASH_COMPRESSED_GEMM", "fast")
    with pytest.raises(ValueError, match="PDFLASH_COMPRESSED_GEMM"):
        compressed_gemm_mode()
    set_compressed_gemm("dequant")
    assert compressed_gemm_mode() == "dequant"
    with pytest.raises(ValueError, match="compressed GEMM mode"):
        set_compressed_gemm("fast")
    set_compressed_gemm(None)
    with pytest.raises(ValueError, match="fused slab MLP formats"):
        FusedSlabMLP("int4", "silu", kernels=compressed_gemm)
    with pytest.raises(ValueError, match="mxfp4_dot"):
        FusedSlabMLP("mxfp4", "silu", mxfp4_dot="tensor", kernels=compressed_gemm)
    monkeypatch.delenv("PDFLASH_FUSED_MXFP4_DOT", raising=False)
    assert compressed_gemm.fused_mxfp4_dot() == "registers"
    monkeypatch.setenv("PDFLASH_FUSED_MXFP4_DOT", "scaled")
    assert compressed_gemm.fused_mxfp4_dot() == "scaled"
    monkeypatch.setenv("PDFLASH_FUSED_MXFP4_DOT", "wgmma")
    with pytest.raises(ValueError, match="PDFLASH_FUSED_MXFP4_DOT"):
        compressed_gemm.fused_mxfp4_dot()
    assert "CUDA devices, not cpu" in str(compressed_gemm.fused_gemm_unavailable("cpu"))
    with pytest.raises(ValueError, match="mxfp4_dot"):
        compressed_gemm.fused_gemm_unavailable("cpu", "tensor")


def test_choice_on_cpu_auto_forced_and_invalid(monkeypatch: pytest.MonkeyPatch) -> None:
    set_compressed_gemm(None)
    monkeypatch.delenv("PDFLASH_COMPRESSED_GEMM", raising=False)
    monkeypatch.delenv("PDFLASH_FUSED_MXFP4_DOT", raising=False)
    # auto without CUDA: dequant, with the reason
    for fmt in ("mxfp4", "fp8"):
        choice = choose_compressed_gemm("cpu", fmt)
        assert (choice.mode, choice.mxfp4_dot) == ("dequant", None)
        assert choice.reason.startswith("auto: dequant") and "not a CUDA device" in choice.reason
    # auto on a CUDA device the kernel cannot use (no GPU here, or a failed probe)
    monkeypatch.setattr(compressed_gemm, "fused_gemm_unavailable", lambda d, dot: "no CUDA device")
    choice = choose_compressed_gemm("cuda", "mxfp4")
    assert choice.mode == "dequant" and "no CUDA device" in choice.reason
    # ... and one it can: fused, MXFP4 through the CUDA kernel (the default where
    # it runs), FP8 fused
    asked: list[str] = []
    monkeypatch.setattr(compressed_gemm, "fused_gemm_unavailable", lambda d, dot: asked.append(dot))
    choice = choose_compressed_gemm("cuda", "mxfp4")
    assert (choice.mode, choice.mxfp4_dot) == ("fused", "cuda") and set(asked) == {"cuda"}
    assert "auto: fused" in choice.reason and "the CUDA kernel" in choice.reason
    fp8 = choose_compressed_gemm("cuda", "fp8")
    assert (fp8.mode, fp8.mxfp4_dot) == ("fused", None) and asked[-1] == "registers"
    # the environment forces a mode, and names itself as the source
    monkeypatch.setenv("PDFLASH_COMPRESSED_GEMM", "dequant")
    choice = choose_compressed_gemm("cuda", "mxfp4")
    assert choice.mode == "dequant" and choice.reason == "dequant forced (PDFLASH_COMPRESSED_GEMM)"
    monkeypatch.setenv("PDFLASH_FUSED_MXFP4_DOT", "registers")
    monkeypatch.setenv("PDFLASH_COMPRESSED_GEMM", "fused")
    choice = choose_compressed_gemm("cuda", "mxfp4")
    assert (choice.mode, choice.mxfp4_dot) == ("fused", "registers")
    assert choice.reason.startswith("fused forced (PDFLASH_COMPRESSED_GEMM)")
    monkeypatch.undo()
    # forced fused where it cannot run: a clear error, never a silent fallback
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    set_compressed_gemm("fused")
    try:
        with pytest.raises(FusedGemmUnavailableError, match="CUDA devices, not cpu"):
            choose_compressed_gemm("cpu", "fp8")
    finally:
        set_compressed_gemm(None)
    monkeypatch.setenv("PDFLASH_COMPRESSED_GEMM", "fastest")
    with pytest.raises(ValueError, match="PDFLASH_COMPRESSED_GEMM must be one of"):
        choose_compressed_gemm("cpu", "mxfp4")
    with pytest.raises(ValueError, match="compressed expert formats"):
        choose_compressed_gemm("cpu", "int4")
    # the MXFP4 dot's default: the CUDA kernel on CUDA where it runs (not here:
    # tl.dot_scaled, with why), registers off CUDA
    monkeypatch.delenv("PDFLASH_FUSED_MXFP4_DOT", raising=False)
    assert compressed_gemm.fused_mxfp4_dot("cuda") == "scaled"
    dot, why = compressed_gemm.fused_mxfp4_dot_choice("cuda")
    assert dot == "scaled" and "CUDA kernel cannot run" in why
    assert compressed_gemm.fused_mxfp4_dot("cpu") == "registers"


def test_cuda_dot_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PDFLASH_FUSED_MXFP4_DOT=cuda``: forced, and an error where it cannot
    run (never a silent fallback); unset: ``cuda`` where its probe agrees,
    else ``scaled`` with the reason; the reason names the dot that runs."""
    set_compressed_gemm(None)
    monkeypatch.delenv("PDFLASH_COMPRESSED_GEMM", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("PDFLASH_FUSED_MXFP4_DOT", "cuda")
    assert compressed_gemm.fused_mxfp4_dot("cpu") == "cuda"  # forced is forced
    assert "cuda" in compressed_gemm.MXFP4_DOTS
    # a CUDA device where the CUDA kernel cannot run: auto and fused both refuse
    broken = {"cuda": "pdflash_native._mxfp4gemm was built without the CUDA MXFP4 GEMM"}
    monkeypatch.setattr(compressed_gemm, "fused_gemm_unavailable", lambda d, dot: broken.get(dot))
    with pytest.raises(FusedGemmUnavailableError, match=r"PDFLASH_FUSED_MXFP4_DOT=cuda cannot run"):
        choose_compressed_gemm("cuda", "mxfp4")
    monkeypatch.setenv("PDFLASH_COMPRESSED_GEMM", "fused")
    with pytest.raises(FusedGemmUnavailableError, match="built without the CUDA MXFP4 GEMM"):
        choose_compressed_gemm("cuda", "mxfp4")
    # dequant forced: the dot does not matter; FP8 never takes the MXFP4 dot
    monkeypatch.setenv("PDFLASH_COMPRESSED_GEMM", "dequant")
    assert choose_compressed_gemm("cuda", "mxfp4").mode == "dequant"
    monkeypatch.setenv("PDFLASH_COMPRESSED_GEMM", "auto")
    fp8 = choose_compressed_gemm("cuda", "fp8")
    assert (fp8.mode, fp8.mxfp4_dot) == ("fused", None)
    # auto off CUDA: dequant (the fused path does not run there at all)
    assert choose_compressed_gemm("cpu", "mxfp4").mode == "dequant"
    # unset: scaled where the CUDA kernel cannot run, the reason says why
    monkeypatch.delenv("PDFLASH_FUSED_MXFP4_DOT")
    choice = choose_compressed_gemm("cuda", "mxfp4")
    assert (choice.mode, choice.mxfp4_dot) == ("fused", "scaled")
    assert "tl.dot_scaled" in choice.reason and "built without the CUDA MXFP4 GEMM" in choice.reason
    # ... and cuda where it runs; forced cuda that runs is named as forced
    monkeypatch.setattr(compressed_gemm, "fused_gemm_unavailable", lambda d, dot: None)
    choice = choose_compressed_gemm("cuda", "mxfp4")
    assert (choice.mode, choice.mxfp4_dot) == ("fused", "cuda")
    assert "the CUDA kernel" in choice.reason and "probe agreed" in choice.reason
    monkeypatch.setenv("PDFLASH_FUSED_MXFP4_DOT", "cuda")
    choice = choose_compressed_gemm("cuda", "mxfp4")
    assert choice.mxfp4_dot == "cuda" and "PDFLASH_FUSED_MXFP4_DOT=cuda" in choice.reason
    mlp = FusedSlabMLP("mxfp4", "gptoss", mxfp4_dot="cuda", kernels=compressed_gemm)
    assert mlp.mxfp4_dot == "cuda"


def test_cuda_dot_probe_off_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA kernel's first-use check refuses off CUDA, under the
    interpreter too, and names a build without it."""
    compressed_gemm._PROBES.clear()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "CUDA devices, not cpu" in str(compressed_gemm.fused_gemm_unavailable("cpu", "cuda"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "not the interpreter" in str(compressed_gemm.fused_gemm_unavailable("cpu", "cuda"))
    from pdflash.models import mxfp4_cuda_gemm

    fake = SimpleNamespace(BUILT=False)
    monkeypatch.setattr(mxfp4_cuda_gemm, "native", lambda: fake)
    why = compressed_gemm._probe(torch.device("cuda", 0), "cuda")
    assert why is not None and "built without the CUDA MXFP4 GEMM" in why


def test_cuda_dot_probe_follows_the_variant_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA kernel's first-use check is cached per variant pair the
    policy picks (block_m 16, 64): switching ``PDFLASH_MXFP4_CUDA_BM64``
    probes again; an invalid value or a forced wgmma that cannot run is an
    error, not a silent fallback to another dot."""
    from pdflash.models import mxfp4_cuda_gemm

    probed: list[tuple[str, str]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(compressed_gemm, "_probe", lambda d, dot: probed.append((str(d), dot)))
    monkeypatch.setattr(mxfp4_cuda_gemm, "wgmma_unavailable", lambda device=None: None)
    monkeypatch.delenv(mxfp4_cuda_gemm.BM64_ENV, raising=False)
    compressed_gemm._PROBES.clear()
    try:
        assert compressed_gemm.fused_gemm_unavailable("cuda:0", "cuda") is None
        assert compressed_gemm.fused_gemm_unavailable("cuda:0", "cuda") is None  # cached
        assert probed == [("cuda:0", "cuda")]
        assert "cuda:0/cuda/variants 8,10" in compressed_gemm._PROBES
        monkeypatch.setenv(mxfp4_cuda_gemm.BM64_ENV, "mma")
        assert compressed_gemm.fused_gemm_unavailable("cuda:0", "cuda") is None
        assert len(probed) == 2 and "cuda:0/cuda/variants 8,4" in compressed_gemm._PROBES
        monkeypatch.setenv(mxfp4_cuda_gemm.BM64_ENV, "fast")
        with pytest.raises(ValueError, match="PDFLASH_MXFP4_CUDA_BM64 must be one of"):
            compressed_gemm.fused_gemm_unavailable("cuda:0", "cuda")
        monkeypatch.setenv(mxfp4_cuda_gemm.BM64_ENV, "wgmma")
        monkeypatch.setattr(mxfp4_cuda_gemm, "wgmma_unavailable", lambda device=None: "sm_89")
        with pytest.raises(mxfp4_cuda_gemm.WgmmaUnavailableError, match="=wgmma cannot run"):
            compressed_gemm.fused_gemm_unavailable("cuda:0", "cuda")
        # the other dots do not depend on it
        assert compressed_gemm.fused_gemm_unavailable("cuda:0", "scaled") is None
    finally:
        compressed_gemm._PROBES.clear()


def test_cpu_adapter_records_dequant_and_why(mxfp4_checkpoint: Path, host_issuer: object) -> None:
    set_compressed_gemm(None)
    ad = load_adapter(
        mxfp4_checkpoint, issuer=host_issuer, cache_slots=4, max_batch_tokens=2,
        dtype=torch.float32,
    )  # fmt: skip
    runtime = ad.runtime
    assert runtime is not None and runtime.compressed_gemm == "dequant"
    reason = runtime.compressed_gemm_reason
    assert reason is not None and "auto: dequant" in reason and "not a CUDA device" in reason


def test_fused_asked_for_on_cpu_is_refused(mxfp4_checkpoint: Path, host_issuer: object) -> None:
    set_compressed_gemm("fused")
    try:
        with pytest.raises(FusedGemmUnavailableError, match="CUDA devices, not cpu"):
            load_adapter(
                mxfp4_checkpoint,
                issuer=host_issuer,
                cache_slots=4,
                max_batch_tokens=2,
                dtype=torch.float32,
            )
    finally:
        set_compressed_gemm(None)


# -- the whole offloaded block: fused vs the dequant path ---------------------


def _block_equal(ad: Any, kernels: ModuleType, fmt: str, act: str, **kw: Any) -> None:
    runtime = ad.runtime
    assert runtime is not None and runtime.path == "grouped"
    assert runtime.compressed_gemm == "dequant"
    ids = torch.arange(9) * 5 % 128
    with torch.no_grad():
        want = ad.forward_logits(ids)
        runtime.grouped.fused = FusedSlabMLP(
            fmt, act, out_axis=ad.expert_out_axes["gate_up"], kernels=kernels, **kw
        )
        assert runtime.compressed_gemm == "fused"
        got = ad.forward_logits(ids)
    _close(got, want)


needs_grouped = pytest.mark.skipif(
    not offload.grouped_mm_works(torch.device("cpu"), torch.float32),
    reason="this torch has no CPU grouped_mm",
)


@needs_grouped
def test_mxfp4_block_fused_equals_dequant_path(
    kernels: ModuleType, mxfp4_checkpoint: Path, host_issuer: object
) -> None:
    # 4 slots for 2 layers' experts: misses, partial (masked) grouped calls and evictions
    ad = load_adapter(
        mxfp4_checkpoint, issuer=host_issuer, cache_slots=4, max_batch_tokens=2, dtype=torch.float32
    )
    alpha, limit = ad._swiglu_params()
    _block_equal(ad, kernels, "mxfp4", "gptoss", alpha=alpha, limit=limit)


@needs_grouped
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_fp8_block_fused_equals_dequant_path(
    kernels: ModuleType, arch: str, tiny_checkpoints: dict[str, Path], host_issuer: object
) -> None:
    ad = load_adapter(
        tiny_checkpoints[arch], issuer=host_issuer, cache_fraction=1.0, expert_dtype="fp8"
    )
    if arch == "gpt_oss":
        alpha, limit = ad._swiglu_params()
        _block_equal(ad, kernels, "fp8", "gptoss", alpha=alpha, limit=limit)
    else:
        _block_equal(ad, kernels, "fp8", "silu")


# -- the row plan and the weighted combine (one launch each) -------------------


@pytest.mark.parametrize(
    ("tokens", "k", "experts", "width", "block_m", "chunk_cells"),
    [
        (1, 1, 1, 1, 16, None),
        (5, 2, 7, 7, 1, None),
        (64, 4, 32, 32, 64, None),
        (20, 4, 12, 13, 16, 256),
    ],
)
def test_row_plan_equals_sort_rows_and_tile_map(
    kernels: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    tokens: int,
    k: int,
    experts: int,
    width: int,
    block_m: int,
    chunk_cells: int | None,
) -> None:
    """The one-launch plan gives the counting sort's places and tokens and the
    reference tile map's tiles exactly; with 256 one-hot cells a program
    (16 rows or tiles of 16 keys at a time) it walks 5 row chunks and 2 tile
    chunks."""
    if chunk_cells is not None:
        monkeypatch.setattr(kernels, "_ROW_PLAN_CHUNK_CELLS", chunk_cells)
    g = torch.Generator().manual_seed(tokens * 7 + width)
    ids = torch.randint(0, experts, (tokens * k,), generator=g)
    keys = torch.randperm(width, generator=g)[:experts]  # each expert's slot in the window
    plan = kernels.row_plan(ids, keys, width, k, block_m, experts)
    rows = offload.sort_rows(keys[ids], width, k)
    assert plan.position.dtype == plan.token.dtype == torch.int32
    assert torch.equal(plan.position.long(), rows.position)
    assert torch.equal(plan.token.long(), rows.token)
    want = tile_map(rows.key_sorted(), width, block_m, experts)
    assert plan.block_m == block_m and torch.equal(plan.tiles[0], want[0])
    live = want[0] >= 0  # dead tiles' row ranges are never read
    assert torch.equal(plan.tiles[1][live], want[1][live])
    assert torch.equal(plan.tiles[2][live], want[2][live])


@pytest.mark.parametrize(("tokens", "k", "experts", "width"), [(5, 2, 7, 7), (20, 4, 12, 40)])
def test_atomic_row_plan_is_a_valid_plan_with_the_same_tiles(
    kernels: ModuleType, monkeypatch: pytest.MonkeyPatch, tokens: int, k: int, experts: int,
    width: int,
) -> None:  # fmt: skip
    """``ordered=False``: each row at a place of its own key's range (a
    permutation), the token of each place its row's, and the ordered plan's
    tiles exactly; 16 rows a chunk walks 5 chunks of the larger case."""
    monkeypatch.setattr(kernels, "_ROW_PLAN_ATOMIC_CHUNK", 16)
    g = torch.Generator().manual_seed(tokens + width)
    n = tokens * k
    ids = torch.randint(0, experts, (n,), generator=g)
    keys = torch.randperm(width, generator=g)[:experts]
    plan = kernels.row_plan(ids, keys, width, k, 16, experts, ordered=False)
    rows = offload.sort_rows(keys[ids], width, k)
    place = plan.position.long()
    assert torch.equal(torch.sort(place).values, torch.arange(n))
    assert torch.equal(plan.token.long()[place], torch.arange(n) // k)
    keys_at = torch.empty(n, dtype=torch.long)
    keys_at[place] = keys[ids]
    assert torch.equal(keys_at, rows.key_sorted())  # every key's rows at its own places
    want = tile_map(rows.key_sorted(), width, 16, experts)
    live = want[0] >= 0
    assert torch.equal(plan.tiles[0], want[0])
    assert torch.equal(plan.tiles[1][live], want[1][live])
    assert torch.equal(plan.tiles[2][live], want[2][live])
    assert kernels.row_plan_fits(kernels.ROW_PLAN_ATOMIC_MAX_ROWS, 1000, ordered=False)
    assert not kernels.row_plan_fits(n, kernels.ROW_PLAN_ATOMIC_MAX_KEYS + 1, ordered=False)
    with pytest.raises(ValueError, match="keys"):
        kernels.row_plan(ids, keys, kernels.ROW_PLAN_ATOMIC_MAX_KEYS + 1, k, 16, 4, ordered=False)


def test_row_plan_refuses_what_it_cannot_take(kernels: ModuleType) -> None:
    ids, keys = torch.zeros(4, dtype=torch.long), torch.arange(3)
    with pytest.raises(ValueError, match=">= 1"):
        kernels.row_plan(ids, keys, 0, 2, 16, 3)
    assert not kernels.row_plan_fits(kernels.ROW_PLAN_MAX_CELLS, 3)
    with pytest.raises(ValueError, match="rows x keys"):
        kernels.row_plan(
            torch.zeros(kernels.ROW_PLAN_MAX_CELLS, dtype=torch.long), keys, 3, 2, 16, 3
        )
    with pytest.raises(ValueError, match="contiguous 1-D"):
        kernels.row_plan(torch.zeros(4, 2, dtype=torch.long)[:, 0], keys, 3, 2, 16, 3)
    plan = kernels.row_plan(ids[:0], keys, 3, 2, 16, 3)  # no rows: no tiles, no launch
    assert plan.position.numel() == plan.token.numel() == plan.tiles[0].numel() == 0


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("placed", [False, True])
def test_weighted_combine_is_the_weighted_sum_in_row_order(
    kernels: ModuleType, weight_dtype: torch.dtype, placed: bool
) -> None:
    """Exactly each product rounded to the promoted dtype, summed in fp32 in
    ``j`` order and rounded once (bf16 products of bf16 inputs hit ties, so
    a truncating or ties-away rounding fails), which is also torch's
    ``(y * w).sum(1)`` on the CPU."""
    g = torch.Generator().manual_seed(3)
    tokens, k, hidden = 37, 4, 72
    y = (torch.randn(tokens * k, hidden, generator=g) * 3).bfloat16()
    w = torch.rand(tokens, k, generator=g).to(weight_dtype)
    position = torch.randperm(tokens * k, generator=g).to(torch.int32) if placed else None
    rows = y[position.long()] if position is not None else y
    product = torch.promote_types(y.dtype, weight_dtype)
    products = (rows.float().view(tokens, k, hidden) * w.float().unsqueeze(-1)).to(product)
    acc = torch.zeros(tokens, hidden)
    for j in range(k):
        acc = acc + products[:, j].float()
    for out_dtype in (torch.bfloat16, torch.float32):
        got = kernels.weighted_combine(y, w, out_dtype, position)
        assert got.dtype == out_dtype
        assert torch.equal(got, acc.to(out_dtype))
    torch_sum = (rows.view(tokens, k, hidden) * w.unsqueeze(-1)).sum(dim=1).to(torch.bfloat16)
    assert torch.equal(kernels.weighted_combine(y, w, torch.bfloat16, position), torch_sum)


def test_weighted_combine_rounds_like_torch_at_the_edges(kernels: ModuleType) -> None:
    """Ties to even, overflow to inf, inf and NaN kept (the bits-level rounding)."""
    one = 1.0
    tie_down, tie_up = one + 2**-8, one + 3 * 2**-8  # halfway between bf16 neighbours
    vals = torch.tensor([[tie_down, tie_up, 3.4e38, float("inf"), float("nan"), -tie_up]])
    y = vals.reshape(6, 1)  # 6 tokens of one row each
    w = torch.ones(6, 1)
    got = kernels.weighted_combine(y, w, torch.bfloat16)
    want = y.to(torch.bfloat16)
    assert torch.equal(got[:4], want[:4]) and bool(torch.isnan(got[4]).all())
    assert torch.equal(got[5], want[5])
    assert float(got[0, 0]) == 1.0 and float(got[1, 0]) == 1.015625 and got[2, 0].isinf()
    with pytest.raises(ValueError, match="entries"):
        kernels.weighted_combine(y, w, torch.bfloat16, torch.zeros(5, dtype=torch.int32))
    with pytest.raises(ValueError, match="routed rows"):
        kernels.weighted_combine(y[:5], w, torch.bfloat16)


@needs_grouped
def test_resident_block_plans_its_rows_in_one_launch(
    kernels: ModuleType, tiny_checkpoints: dict[str, Path], host_issuer: object
) -> None:
    """An all-resident gpt-oss layer with a fused MLP: ``plan_atomic`` (the
    default) and ``plan`` give the bits of the ``counting`` path without its
    sort, gather, multiply and sum calls."""
    from pdflash.bench.op_count import DispatchCounter

    ad = load_adapter(
        tiny_checkpoints["gpt_oss"], issuer=host_issuer, cache_fraction=1.0, expert_dtype="fp8"
    )
    cache = ad.cache
    cache.wait_ready(cache.prefetch(np.arange(cache.num_ids)))
    alpha, limit = ad._swiglu_params()
    runtime = ad.runtime
    assert runtime is not None and runtime.grouped is not None
    runtime.grouped.fused = FusedSlabMLP(
        "fp8", "gptoss", out_axis=ad.expert_out_axes["gate_up"], kernels=kernels,
        alpha=alpha, limit=limit,
    )  # fmt: skip
    h = torch.randn(9, ad.hidden_size, generator=torch.Generator().manual_seed(4))
    try:
        with torch.inference_mode():
            for layer in range(ad.num_layers):
                assert runtime.cache.layer_resident(layer)
                x = ad.moe_norm(layer, h)
                ids, weights = ad.route(layer, x)
                got, ops = {}, {}
                for mode in ("counting", "plan", "plan_atomic"):
                    offload.set_row_sort(mode)
                    runtime.forward_routed(layer, x, ids, weights)  # memoised views
                    with DispatchCounter() as d:
                        got[mode] = runtime.forward_routed(layer, x, ids, weights)
                    ops[mode] = d.ops
                assert torch.equal(got["plan"], got["counting"])
                assert torch.equal(got["plan_atomic"], got["counting"])
                assert "cumsum" in ops["counting"] and "index_select" in ops["counting"]
                for mode in ("plan", "plan_atomic"):
                    for op in ("cumsum", "index_select", "scatter_", "mul", "sum"):
                        assert op not in ops[mode], (mode, ops[mode])
    finally:
        offload.set_row_sort(None)
