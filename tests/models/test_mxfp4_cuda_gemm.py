"""The CUDA MXFP4 GEMM's seam on the CPU: the native module imports in every
build (``BUILT`` says whether it has the kernel; a build without it refuses
to launch), and :func:`pdflash.models.mxfp4_cuda_gemm.grouped_mxfp4_gemm`
names every input the kernel cannot take before anything reaches the device
(the GPU comparisons: ``test_mxfp4_cuda_gemm_gpu.py``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pdflash._native import load_native
from pdflash.models import mxfp4_cuda_gemm as g


class _W(SimpleNamespace):
    """SlabWeight's surface (the real one lives in the triton module)."""

    def check(self) -> None:
        pass

    @property
    def n(self) -> int:
        return int(self.data.shape[1])

    @property
    def k(self) -> int:
        return int(self.data.shape[2]) * 32


def _case(**over: Any) -> dict[str, Any]:
    s, n, k = 3, 48, 96
    w = _W(
        fmt="mxfp4",
        data=torch.zeros(s, n, k // 32, 16, dtype=torch.uint8),
        scale=torch.full((s, n, k // 32), 127, dtype=torch.uint8),
        bias=None,
    )
    tiles = (
        torch.tensor([0, -1], dtype=torch.int32),
        torch.tensor([0, 0], dtype=torch.int32),
        torch.tensor([2, 0], dtype=torch.int32),
    )
    args = {
        "x": torch.zeros(2, k, dtype=torch.bfloat16),
        "x_rows": torch.tensor([0, 1], dtype=torch.int32),
        "tiles": tiles,
        "block_m": 16,
        "w": w,
    }
    args.update(over)
    return args


def _call(args: dict[str, Any], **kw: Any) -> torch.Tensor:
    return g.grouped_mxfp4_gemm(
        args["x"], args["x_rows"], args["tiles"], args["block_m"], args["w"], **kw
    )


def test_native_module_imports_and_describes_itself() -> None:
    mod = load_native("_mxfp4gemm")
    assert isinstance(mod.BUILT, bool)
    assert isinstance(mod.WGMMA_BUILT, bool)
    kinds = ("KIND_MMA_SYNC", "KIND_WGMMA", "KIND_WGMMA_PX", "KIND_WGMMA_RC")
    assert [getattr(mod, k) for k in kinds] == [getattr(g, k) for k in kinds] == list(range(4))
    if not mod.BUILT:  # a build without CUDA: imports, refuses to launch
        assert mod.num_variants() == 0 and mod.WGMMA_BUILT is False
        assert mod.variant_available(g.WGMMA_BLOCK_VARIANT, 0) == mod.NOT_BUILT
        with pytest.raises(RuntimeError, match="built without the CUDA MXFP4 GEMM"):
            mod.launch(*([0] * 28), 1.0, 0.0, 0, 0)
        assert "built without" in (g.unavailable("cuda") or "")
        assert "built without" in (g.wgmma_unavailable("cuda") or "")
        return
    assert mod.num_variants() == 16
    names = [v.name for v in g.variants()]
    assert names[8] == "v8:8w1mt4stpf256" and names[10] == "v10:8w1mt4stpf256wg"
    assert names[11:] == [
        "v11:16w1mt4stpf256wg",
        "v12:8w1mt6stpf256wg",
        "v13:12w1mt4stpf256wg",
        "v14:8w1mt4stpf256wgpx",
        "v15:8w1mt4stpf256wgrc",
    ]
    assert g.variants()[4].max_block_m == 64 and g.variants()[4].warps == 16
    assert [v.index for v in g.variants() if v.kind == g.KIND_WGMMA] == [10, 11, 12, 13]
    assert mod.variant_info(g.WGMMA_BLOCK_VARIANT) == (8, 1, 4, 64, 256, mod.KIND_WGMMA)
    assert mod.variant_info(g.WGMMA_RC_VARIANT) == (8, 1, 4, 64, 256, mod.KIND_WGMMA_RC)
    with pytest.raises(ValueError, match="unknown CUDA MXFP4 GEMM variant"):
        mod.variant_info(16)
    assert mod.variant_available(16, 0) == mod.BAD_VARIANT
    assert (mod.OUT_NATURAL, mod.OUT_CHUNK_PERMUTED) == (0, 1)
    assert mod.error_string(mod.OK) == "ok"
    assert "block_m" in mod.error_string(mod.BLOCK_M_VARIANT)
    assert "sm_90a" in mod.error_string(mod.VARIANT_UNAVAILABLE)
    # the launcher checks what it needs before touching the device
    assert mod.launch(*([0] * 28), 1.0, 0.0, 0, 0) == mod.BAD_ARGS  # K = 0
    assert mod.launch(16, *([0] * 27), 1.0, 0.0, 0, 0) == mod.BAD_VARIANT
    # a shape it takes with no tiles is a no-op; a chunk stride off 16 bytes is refused
    args: list[Any] = [0] * 28 + [1.0, 0.0, 0, 0]
    # stride_sk, block_m, n, k, n_out
    for at, value in ((11, 1), (20, 1), (21, 1), (22, 32), (23, 1)):
        args[at] = value
    for stride_wc, want in ((64, mod.OK), (0, mod.OK), (8, mod.BAD_ARGS)):
        args[7] = stride_wc
        assert mod.launch(*args) == want, stride_wc


def test_wgmma_availability_off_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off CUDA (and in a build without its sm_90a code) the wgmma variant is
    unavailable with a reason, the policy never picks it there, and asking
    for it by name or by the environment is refused before any launch."""
    assert "not cpu" in (g.wgmma_unavailable("cpu") or "")
    fake = SimpleNamespace(BUILT=True, WGMMA_BUILT=False)
    monkeypatch.setattr(g, "native", lambda: fake)
    assert "no sm_90a code" in (g.wgmma_unavailable("cuda:0") or "")
    monkeypatch.setenv(g.BM64_ENV, "wgmma")
    with pytest.raises(g.WgmmaUnavailableError, match="no sm_90a code"):
        g.pick_variant(64, "cuda:0")
    monkeypatch.setenv(g.BM64_ENV, "auto")
    assert g.pick_variant(64, "cuda:0") == g.LARGE_BLOCK_VARIANT


def test_unavailable_off_cuda() -> None:
    assert "CUDA devices, not cpu" in (g.unavailable("cpu") or "")


@pytest.mark.parametrize(
    ("over", "kw", "match"),
    [
        ({"x": torch.zeros(2, 96)}, {}, "bf16 activations"),
        (
            {"x": torch.zeros(2, 64, dtype=torch.bfloat16)},
            {},
            r"x \(natural\) must be \[rows, 96\]",
        ),
        ({}, {"out_dtype": torch.float32}, "writes bf16"),
        ({}, {"act": 3}, "act must be"),
        ({"block_m": 128}, {}, "block_m 1..64"),
        ({"x_rows": torch.tensor([0.0, 1.0])}, {}, "x_rows must be int32 or int64"),
        ({}, {"act": 1, "gate_up": (0, 1, 0)}, "gate_up must be"),
        ({}, {"variant": 16}, "unknown CUDA MXFP4 GEMM variant"),
        ({}, {"variant": 3, "block_m": None}, "takes block_m <= 16"),
        ({"x": torch.zeros(2, 100, dtype=torch.bfloat16)[:, :96]}, {}, "16-byte aligned"),
        ({"x": torch.zeros(2, 97, dtype=torch.bfloat16)[:, 1:]}, {}, "16-byte aligned"),
        ({"x": torch.zeros(96, 2, dtype=torch.bfloat16).T}, {}, "16-byte aligned"),
        ({}, {"x_layout": "permuted"}, "x_layout must be one of"),
        ({}, {"codes": "swizzled"}, "codes must be 'natural' or 'repacked'"),
        ({}, {"out_layout": "rows"}, "out_layout must be one of"),
        ({}, {"out_layout": "chunk_permuted"}, r"needs N_out % 32 == 0, got 48"),
        ({}, {"x_layout": "chunk_permuted"}, r"x \(chunk_permuted\) must be \[rows, 128\]"),
        (
            {"x": torch.zeros(2, 128, dtype=torch.bfloat16)},
            {"x_layout": "chunk_permuted"},
            "runs on CUDA tensors",
        ),
        ({}, {}, "runs on CUDA tensors"),
    ],
)
def test_arguments_the_kernel_cannot_take_are_named(
    over: dict[str, Any], kw: dict[str, Any], match: str
) -> None:
    if kw.get("variant") is not None and not load_native("_mxfp4gemm").BUILT:
        pytest.skip("this build has no variants")
    if "block_m" in kw:
        over = {**over, "block_m": 32}
        kw = {k: v for k, v in kw.items() if k != "block_m"}
    with pytest.raises(ValueError, match=match):
        _call(_case(**over), **kw)


def test_weight_and_tile_errors() -> None:
    args = _case()
    w = args["w"]
    with pytest.raises(ValueError, match="MXFP4 slab weights"):
        _call({**args, "w": _W(**{**vars(w), "fmt": "fp8"})})
    with pytest.raises(ValueError, match="bf16 bias"):
        _call({**args, "w": _W(**{**vars(w), "bias": torch.zeros(3, 48)})})
    odd = torch.zeros(3, 48, 3, 17, dtype=torch.uint8)[..., :16]  # rows of 51 bytes
    with pytest.raises(ValueError, match="MXFP4 blocks must be 16-byte aligned"):
        _call({**args, "w": _W(**{**vars(w), "data": odd})})
    scale_t = torch.zeros(3, 3, 48, dtype=torch.uint8).transpose(1, 2)
    with pytest.raises(ValueError, match="scales need k stride 1"):
        _call({**args, "w": _W(**{**vars(w), "scale": scale_t})})
    slot, start, end = args["tiles"]
    with pytest.raises(ValueError, match="tile slot must be a contiguous 1-D int32"):
        _call({**args, "tiles": (slot.long(), start, end)})
    with pytest.raises(ValueError, match="one entry per tile"):
        _call({**args, "tiles": (slot, start, end[:1])})
    meta = torch.zeros(2, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="tile end is on meta"):
        _call({**args, "tiles": (slot, start, meta)})


def test_chunk_major_blocks_follow_the_launchers_strides() -> None:
    """Byte (s, n, block b, i) of the natural blocks sits, in the chunk-major
    copy, at s * stride_ws + n * stride_wn + (b // 4) * stride_wc + (b % 4)
    * 16 + i: the address the kernel reads with those strides; the padded
    blocks of a partial last chunk are zero; bad input is refused."""
    gen = torch.Generator().manual_seed(5)
    blocks = torch.randint(0, 256, (3, 5, 6, 16), generator=gen).to(torch.uint8)  # K = 192
    tiled, ws, wn, wc = g.chunk_major_blocks(blocks)
    assert tiled.shape == (3, 2, 5, 64) and tiled.is_contiguous()
    assert (ws, wn, wc) == (2 * 5 * 64, 64, 5 * 64)
    flat = tiled.flatten()
    s, n, b, i = (
        t.flatten() for t in torch.meshgrid(*map(torch.arange, blocks.shape), indexing="ij")
    )
    at = s * ws + n * wn + (b // 4) * wc + (b % 4) * 16 + i
    assert torch.equal(flat[at], blocks.flatten())
    assert int(tiled[:, 1, :, 32:].count_nonzero()) == 0  # blocks 6, 7 of chunk 1: padding
    with pytest.raises(ValueError, match=r"uint8 \[S, N, G, 16\]"):
        g.chunk_major_blocks(blocks.view(3, 5, 96))
