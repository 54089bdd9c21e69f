"""The fused grouped dequantize-GEMM on CUDA at the published shapes, against
the dequant path (dequantize the slab, then torch's grouped GEMM) over the
same slab: gpt-oss-20b MXFP4 and FP8 (hidden 2880, intermediate 2880, 32
experts, top-4), Qwen3-30B-A3B FP8 (hidden 2048, moe intermediate 768, 128
experts, top-8), 16/64/256 tokens.

Tolerances: fp32 activations, both paths sum exact fp32 products in a
different order: ``1e-4`` of the largest output. bf16: both paths round the
gate/up output to bf16 and the down GEMM reads it (the fused path rounds once
after its fp32 epilogue, the dequant path after each op), so outputs differ
by a few bf16 roundings carried through K = 2880 / 768: max error
``<= 3e-2`` of the largest output, mean error ``<= 1e-2`` of the mean
magnitude."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pdflash.models.adapters._swiglu import SwiGLUGroupedExperts
from pdflash.models.adapters.gpt_oss import (
    GptOssAdapter,
    GptOssGroupedExperts,
    unpack_mxfp4_experts,
)
from pdflash.models.adapters.qwen3_moe import Qwen3MoeAdapter
from pdflash.models.compressed_gemm import FusedSlabMLP, fused_gemm_unavailable
from pdflash.models.layout import FP8_DTYPE, dequantize_fp8, fp8_layout
from pdflash.models.offload import grouped_mm_works

pytestmark = pytest.mark.gpu

ALPHA, LIMIT = 1.702, 7.0
GPTOSS = SimpleNamespace(hidden_size=2880, intermediate_size=2880, experts=32, top_k=4)
QWEN3 = SimpleNamespace(hidden_size=2048, moe_intermediate_size=768, experts=128, top_k=8)


@pytest.fixture(scope="module", autouse=True)
def _fused_runs() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("triton")
    reason = fused_gemm_unavailable("cuda")
    assert reason is None, reason  # triton imports: the kernel must compile and agree


def _slab(layout: Any, slots: int, seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A random slab on the device (generated there: the published shapes
    are hundreds of MB), values in a checkpoint's ranges."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    opts: dict[str, Any] = {"generator": g, "device": "cuda"}
    slab = torch.randint(0, 256, (slots, layout.nbytes), dtype=torch.uint8, **opts)
    views = layout.slab_views(slab)
    for name, v in views.items():
        if name.endswith("_scales"):  # e8m0 in a checkpoint's range
            v.copy_(torch.randint(118, 126, v.shape, dtype=torch.uint8, **opts))
        elif name.endswith("_scale"):  # fp8 per-channel scales
            v.copy_(torch.rand(v.shape, **opts) * 2e-3 + 1e-4)
        elif v.dtype == FP8_DTYPE:
            v.copy_((torch.randn(v.shape, **opts) * 100).clamp(-448, 448).to(FP8_DTYPE))
        elif v.is_floating_point():  # biases
            v.copy_(torch.randn(v.shape, **opts) * 0.1)
    return slab, views


def _routing(tokens: int, experts: int, k: int, g: torch.Generator) -> tuple[Any, ...]:
    ids = torch.rand(tokens, experts, generator=g).topk(k, dim=1).indices.cuda()
    key_sorted, order = torch.sort(ids.reshape(-1), stable=True)
    offs = torch.searchsorted(
        key_sorted, torch.arange(experts, device="cuda"), right=True, out_int32=True
    )
    return key_sorted, order, offs


def _compare(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    got, want = got.float(), want.float()
    assert bool(torch.isfinite(want).all())
    err = (got - want).abs()
    if dtype == torch.float32:
        assert float(err.max()) <= 1e-4 * float(want.abs().max())
    else:
        assert float(err.max()) <= 3e-2 * float(want.abs().max())
        assert float(err.mean()) <= 1e-2 * float(want.abs().mean())


def _run(
    mlp: Any, fused: FusedSlabMLP, views: dict[str, torch.Tensor], hidden: int, experts: int,
    k: int, tokens: int, dtype: torch.dtype, seed: int,
) -> None:  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    key_sorted, order, offs = _routing(tokens, experts, k, g)
    x = (torch.randn(tokens, hidden, generator=g) * 0.5).to("cuda", dtype)
    with torch.inference_mode():
        w = mlp.weights(views)
        w = {n: t.to(dtype) if t.is_floating_point() else t for n, t in w.items()}
        want = mlp.forward(x[order // k], w, offs, key_sorted)
        got = fused.forward_slab(x, order // k, key_sorted, experts, views, experts)
    _compare(got, want, dtype)


@pytest.mark.parametrize("tokens", [16, 64, 256])
@pytest.mark.parametrize(
    ("dtype", "mxfp4_dot"),
    [
        (torch.bfloat16, "registers"),
        (torch.bfloat16, "scaled"),
        (torch.bfloat16, "cuda"),
        (torch.float32, "registers"),
    ],
)
def test_gptoss_mxfp4_fused_equals_dequant_path(
    tokens: int, dtype: torch.dtype, mxfp4_dot: str
) -> None:
    if not grouped_mm_works(torch.device("cuda"), dtype):
        pytest.skip(f"this torch's CUDA grouped_mm does not take {dtype} (the reference path)")
    if mxfp4_dot == "cuda":
        from pdflash.models.mxfp4_cuda_gemm import unavailable

        if unavailable("cuda") is not None:
            pytest.skip(f"the CUDA MXFP4 GEMM cannot run: {unavailable('cuda')}")
    reason = fused_gemm_unavailable("cuda", mxfp4_dot)
    assert reason is None, reason
    cfg = GPTOSS
    fmt = GptOssAdapter.expert_formats(cfg)[1]
    layout, _ = GptOssAdapter.stored_layout(cfg, torch.bfloat16, fmt, None)
    assert layout.format == "mxfp4"
    _, views = _slab(layout, cfg.experts, tokens)
    mlp = GptOssGroupedExperts(ALPHA, LIMIT, lambda v: unpack_mxfp4_experts(v, dtype))
    fused = FusedSlabMLP("mxfp4", "gptoss", alpha=ALPHA, limit=LIMIT, mxfp4_dot=mxfp4_dot)
    _run(mlp, fused, views, cfg.hidden_size, cfg.experts, cfg.top_k, tokens, dtype, tokens)


def test_gptoss_mxfp4_cuda_chunk_permuted_handoff_equals_the_policys_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With ``PDFLASH_MXFP4_CUDA_BM64=wgmma_px`` the block_m 64 MLP runs
    variant 14 (x permuted by the seam for gate_up, handed to down
    chunk-permuted): the same bits as the policy's variant 10, which stages
    the same k order through registers."""
    from pdflash.models import mxfp4_cuda_gemm as cg

    if cg.wgmma_unavailable("cuda") is not None:
        pytest.skip(f"the wgmma variants cannot run: {cg.wgmma_unavailable('cuda')}")
    cfg = GPTOSS
    fmt = GptOssAdapter.expert_formats(cfg)[1]
    layout, _ = GptOssAdapter.stored_layout(cfg, torch.bfloat16, fmt, None)
    tokens = 256
    _, views = _slab(layout, cfg.experts, tokens)
    g = torch.Generator().manual_seed(11)
    key_sorted, order, _ = _routing(tokens, cfg.experts, cfg.top_k, g)
    x = (torch.randn(tokens, cfg.hidden_size, generator=g) * 0.5).to("cuda", torch.bfloat16)
    fused = FusedSlabMLP("mxfp4", "gptoss", alpha=ALPHA, limit=LIMIT, mxfp4_dot="cuda")
    outs = {}
    for setting in ("wgmma", "wgmma_px"):
        monkeypatch.setenv(cg.BM64_ENV, setting)
        assert cg.reads_chunk_permuted(64, "cuda") == (setting == "wgmma_px")
        with torch.inference_mode():
            outs[setting] = fused.forward_slab(
                x, order // cfg.top_k, key_sorted, cfg.experts, views, cfg.experts
            )
    assert torch.equal(outs["wgmma"], outs["wgmma_px"])


def _fp8_unpack(axes: dict[str, int], dtype: torch.dtype) -> Any:
    def unpack(v: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {n: t for n, t in v.items() if n.endswith("_bias")}
        for name, axis in axes.items():
            out[name] = dequantize_fp8(v[name], v[f"{name}_scale"], axis, dtype)
        return out

    return unpack


@pytest.mark.parametrize("tokens", [16, 64, 256])
def test_gptoss_fp8_fused_equals_dequant_path(tokens: int) -> None:
    cfg = GPTOSS
    axes = GptOssAdapter.expert_out_axes
    layout = fp8_layout(GptOssAdapter.expert_layout(cfg, torch.bfloat16), axes)
    _, views = _slab(layout, cfg.experts, tokens + 1)
    mlp = GptOssGroupedExperts(ALPHA, LIMIT, _fp8_unpack(axes, torch.bfloat16))
    fused = FusedSlabMLP("fp8", "gptoss", out_axis=1, alpha=ALPHA, limit=LIMIT)
    _run(mlp, fused, views, cfg.hidden_size, cfg.experts, cfg.top_k, tokens, torch.bfloat16, 7)


@pytest.mark.parametrize("tokens", [16, 64, 256])
def test_qwen3_fp8_fused_equals_dequant_path(tokens: int) -> None:
    cfg = QWEN3
    axes = Qwen3MoeAdapter.expert_out_axes
    layout = fp8_layout(Qwen3MoeAdapter.expert_layout(cfg, torch.bfloat16), axes)
    _, views = _slab(layout, cfg.experts, tokens + 2)
    mlp = SwiGLUGroupedExperts(F.silu, _fp8_unpack(axes, torch.bfloat16))
    fused = FusedSlabMLP("fp8", "silu", out_axis=0)
    _run(mlp, fused, views, cfg.hidden_size, cfg.experts, cfg.top_k, tokens, torch.bfloat16, 9)


@pytest.mark.parametrize(
    ("tokens", "k", "experts", "width"),
    [
        (16, 4, 32, 32),
        (64, 4, 32, 32),
        (256, 4, 32, 32),
        (32, 8, 128, 128),
        (8, 4, 32, 1000),
    ],
)
def test_row_plan_and_combine_on_cuda(tokens: int, k: int, experts: int, width: int) -> None:
    """The compiled row plan at the published shapes (up to the most rows it
    takes, and over a slab-wide key range) equals the counting sort and the
    reference tile map, and the compiled combine equals the fixed-order
    weighted sum exactly (within one bf16 rounding of torch's own sum,
    whose order is its own)."""
    from pdflash.models import fused_moe_triton as kernels
    from pdflash.models.compressed_gemm import pick_block_m, tile_map
    from pdflash.models.offload import sort_rows

    g = torch.Generator(device="cuda").manual_seed(tokens + width)
    n = tokens * k
    assert kernels.row_plan_fits(n, width)
    ids = torch.randint(0, experts, (n,), device="cuda", generator=g)
    keys = torch.randperm(width, device="cuda", generator=g)[:experts]
    block_m = pick_block_m(n, experts)
    plan = kernels.row_plan(ids, keys, width, k, block_m, experts)
    rows = sort_rows(keys[ids], width, k)
    assert torch.equal(plan.position.long(), rows.position)
    assert torch.equal(plan.token.long(), rows.token)
    want = tile_map(rows.key_sorted(), width, block_m, experts)
    live = want[0] >= 0
    assert torch.equal(plan.tiles[0], want[0])
    assert torch.equal(plan.tiles[1][live], want[1][live])
    assert torch.equal(plan.tiles[2][live], want[2][live])
    hidden = 2880
    y = torch.randn(n, hidden, device="cuda", generator=g).bfloat16()
    w = torch.rand(tokens, k, device="cuda", generator=g).bfloat16()
    got = kernels.weighted_combine(y, w, torch.bfloat16, plan.position)
    rows_y = y[rows.position].view(tokens, k, hidden)
    products = (rows_y.float() * w.float().unsqueeze(-1)).bfloat16().float()
    acc = torch.zeros(tokens, hidden, device="cuda")
    for j in range(k):
        acc = acc + products[:, j]
    assert torch.equal(got, acc.bfloat16())
    torch_sum = (rows_y * w.unsqueeze(-1)).sum(dim=1)
    ulp = torch_sum.float().abs().clamp(min=2**-126) * 2**-7
    assert bool(((got.float() - torch_sum.float()).abs() <= ulp).all())


@pytest.mark.parametrize(
    ("tokens", "k", "experts", "width"),
    [(256, 4, 32, 32), (2048, 8, 128, 128), (4096, 4, 32, 1000)],
)
def test_atomic_row_plan_on_cuda_is_a_valid_plan(
    tokens: int, k: int, experts: int, width: int
) -> None:
    """The atomic plan (rows of a key in no fixed order) on CUDA, prefill-sized
    too: a permutation, each key's rows at that key's places, each place's
    token its row's, and the reference tile map's tiles."""
    from pdflash.models import fused_moe_triton as kernels
    from pdflash.models.compressed_gemm import pick_block_m, tile_map
    from pdflash.models.offload import sort_rows

    g = torch.Generator(device="cuda").manual_seed(tokens + width)
    n = tokens * k
    ids = torch.randint(0, experts, (n,), device="cuda", generator=g)
    keys = torch.randperm(width, device="cuda", generator=g)[:experts]
    block_m = pick_block_m(n, experts)
    plan = kernels.row_plan(ids, keys, width, k, block_m, experts, ordered=False)
    rows = sort_rows(keys[ids], width, k)
    place = plan.position.long()
    arange = torch.arange(n, device="cuda")
    assert torch.equal(torch.sort(place).values, arange)
    assert torch.equal(plan.token.long()[place], arange // k)
    keys_at = torch.empty(n, dtype=torch.long, device="cuda")
    keys_at[place] = keys[ids]
    assert torch.equal(keys_at, rows.key_sorted())
    want = tile_map(rows.key_sorted(), width, block_m, experts)
    live = want[0] >= 0
    assert torch.equal(plan.tiles[0], want[0])
    assert torch.equal(plan.tiles[1][live], want[1][live])
    assert torch.equal(plan.tiles[2][live], want[2][live])
