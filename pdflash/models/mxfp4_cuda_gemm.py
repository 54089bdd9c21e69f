"""The hand-written CUDA MXFP4 x bf16 grouped expert GEMM
(``cuda/src/mxfp4_moe_gemm.cu``, bound as :mod:`pdflash_native._mxfp4gemm`).

:func:`grouped_mxfp4_gemm` computes exactly what
:func:`pdflash.models.fused_moe_triton.grouped_qgemm` computes for MXFP4
slab weights and bf16 activations (same tile map, same output allocation,
rows no live tile covers left unset, same ``act`` / ``gate_up``
conventions), on ``torch.cuda.current_stream()`` with no host sync, so it
records into CUDA graphs. fp32 accumulation, bf16 output.

Variant policy (:func:`pick_variant`; measurements:
``bench/h200/mxfp4_cuda/README.md``): ``block_m <= 32``: variant 8
(mma.sync, 8 warps, one m16 weight tile per warp, 4 cp.async stages,
256-byte L2 prefetch hint). ``block_m`` 33..64: variant 10 (wgmma m64nNk16
with the dequantized weights as A from registers and the activations as B
from shared memory; 8 warps = 2 warpgroups, 4 stages, 256-byte hint) where
it runs, i.e. this build has its sm_90a code and the device is compute
capability 9.0 (:func:`wgmma_unavailable`); else variant 4 (mma.sync, 16
warps, one m-tile, 4 stages). ``PDFLASH_MXFP4_CUDA_BM64`` overrides the
``block_m`` 33..64 choice: ``auto`` (default, the rule above), ``mma``
(variant 4), ``wgmma`` (variant 10; an error where it cannot run) or
``wgmma_px`` (variant 14: variant 10's kernel reading x by cp.async from a
chunk-permuted copy, :func:`chunk_permuted`, that :func:`grouped_mxfp4_gemm`
makes first, or that the expert MLP's first GEMM writes for its second,
``out_layout``; variant 10's bits, which its GPU test checks; an error where
it cannot run; not the default: it made the all-hit gpt-oss block at 256
tokens 1.21x slower on an H100, bench/results/h100/session60-2026-12-07).
Variant 15 (kind :data:`KIND_WGMMA_RC`, never picked) is variant 10 reading
codes whose bits :func:`repack_codes` moved so that the dequant takes ~40%
fewer integer instructions; a caller that repacked its slab names it with
``codes=CODES_REPACKED``. Its bits equal variant 10's on an H100, and it is
2.7-3.1% faster at 256 tokens there (bench/results/h100/session61-2026-12-07):
too little to make every reader of the slab read repacked codes.

The CPU model of the kernel's per-lane algorithm (which lane loads which
bytes, the dequant bits, the fragment layouts, the scale-range paths) is
``tests/models/mxfp4_cuda_model.py``; it runs in the CPU tests.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from pdflash._native import load_native

if TYPE_CHECKING:
    from pdflash.models.fused_moe_triton import SlabWeight

#: epilogues (the values of :mod:`pdflash.models.fused_moe_triton`'s ACT_*)
ACT_NONE = 0
ACT_GPTOSS = 1
ACT_SILU = 2
#: the largest BLOCK_M the kernel takes
MAX_BLOCK_M = 64
#: :func:`pick_variant`'s choices: variant 8 up to block_m 32; above, the
#: wgmma variant 10 where it runs, else the mma.sync variant 4
SMALL_BLOCK_VARIANT = 8
LARGE_BLOCK_VARIANT = 4
WGMMA_BLOCK_VARIANT = 10
#: ``PDFLASH_MXFP4_CUDA_BM64=wgmma_px``'s variant (x chunk-permuted)
WGMMA_PX_BLOCK_VARIANT = 14
#: the environment variable that overrides the block_m 33..64 choice, and its values
BM64_ENV = "PDFLASH_MXFP4_CUDA_BM64"
BM64_SETTINGS = ("auto", "mma", "wgmma", "wgmma_px")
#: variant kinds (:attr:`Variant.kind`; the native module's KIND_*)
KIND_MMA_SYNC = 0
KIND_WGMMA = 1
KIND_WGMMA_PX = 2  # wgmma, x chunk-permuted (:func:`chunk_permuted`)
KIND_WGMMA_RC = 3  # wgmma, the weights' codes repacked (:func:`repack_codes`)
WGMMA_KINDS = (KIND_WGMMA, KIND_WGMMA_PX, KIND_WGMMA_RC)
#: variant 10 reading repacked codes (kind :data:`KIND_WGMMA_RC`); never
#: picked: a caller that repacked its slab names it
WGMMA_RC_VARIANT = 15
#: the blocks' code layouts (:func:`grouped_mxfp4_gemm`'s ``codes``): the
#: checkpoint's, or :func:`repack_codes`'s
CODES_NATURAL = "natural"
CODES_REPACKED = "repacked"
#: the k chunk the kernel stages (and :func:`chunk_permuted` permutes within)
K_CHUNK = 128
#: layouts of x and of the output (:func:`grouped_mxfp4_gemm`'s ``x_layout`` /
#: ``out_layout``): as given, or :func:`chunk_permuted`'s
NATURAL = "natural"
CHUNK_PERMUTED = "chunk_permuted"
LAYOUTS = (NATURAL, CHUNK_PERMUTED)


class WgmmaUnavailableError(RuntimeError):
    """The wgmma variant was asked for where it cannot run."""


class Mxfp4GemmNative(Protocol):
    """The native seam (:mod:`pdflash_native._mxfp4gemm`)."""

    BUILT: bool
    WGMMA_BUILT: bool
    OK: int
    BAD_VARIANT: int
    BAD_ARGS: int
    BLOCK_M_TOO_LARGE: int
    BLOCK_M_VARIANT: int
    NOT_BUILT: int
    VARIANT_UNAVAILABLE: int
    ATTRIBUTE_ERROR: int
    LAUNCH_ERROR: int
    KIND_MMA_SYNC: int
    KIND_WGMMA: int
    KIND_WGMMA_PX: int
    KIND_WGMMA_RC: int
    OUT_NATURAL: int
    OUT_CHUNK_PERMUTED: int

    def num_variants(self) -> int: ...

    def variant_info(self, variant: int) -> tuple[int, int, int, int, int, int]: ...

    def variant_available(self, variant: int, device: int) -> int: ...

    def error_string(self, code: int) -> str: ...

    def launch(
        self,
        variant: int,
        x: int,
        stride_xm: int,
        x_rows: int,
        blocks: int,
        stride_ws: int,
        stride_wn: int,
        stride_wc: int,
        scales: int,
        stride_ss: int,
        stride_sn: int,
        stride_sk: int,
        bias: int,
        stride_bs: int,
        out: int,
        stride_om: int,
        tile_slot: int,
        tile_start: int,
        tile_end: int,
        num_tiles: int,
        block_m: int,
        n: int,
        k: int,
        n_out: int,
        act: int,
        gate_col0: int,
        up_col0: int,
        col_step: int,
        alpha: float,
        limit: float,
        out_layout: int,
        stream: int,
    ) -> int: ...


def native() -> Mxfp4GemmNative:
    """The native module (:class:`pdflash._native.NativeExtensionError` when
    it is missing: a broken build, never a silent fallback)."""
    module: Any = load_native("_mxfp4gemm")
    return module  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Variant:
    """One compiled configuration of the kernel."""

    index: int
    warps: int
    m_tiles: int  # m16 weight tiles per warp
    stages: int  # cp.async ring depth (128-k chunks)
    max_block_m: int
    l2_prefetch: int  # cp.async L2 prefetch hint, bytes (0: none)
    kind: int  # KIND_MMA_SYNC, KIND_WGMMA, KIND_WGMMA_PX or KIND_WGMMA_RC

    @property
    def name(self) -> str:
        pf = f"pf{self.l2_prefetch}" if self.l2_prefetch else ""
        wg = {KIND_WGMMA: "wg", KIND_WGMMA_PX: "wgpx", KIND_WGMMA_RC: "wgrc"}.get(self.kind, "")
        return f"v{self.index}:{self.warps}w{self.m_tiles}mt{self.stages}st{pf}{wg}"


def variants() -> list[Variant]:
    """Every variant this build has (none when it was built without the kernel)."""
    mod = native()
    return [Variant(v, *mod.variant_info(v)) for v in range(mod.num_variants())]


def chunk_permuted(x: torch.Tensor) -> torch.Tensor:
    """``x [rows, K]`` in the order the wgmma kernel stages it (the layout
    :data:`KIND_WGMMA_PX` variants read): ``[rows, NC * 128]``, ``NC =
    ceil(K / 128)``; within each 128-element chunk, input ``k = 32 t + 8 w +
    4 e + 2 h + d`` (t, w < 4; e, h, d < 2) goes to ``32 w + 16 h + 8 d + 2 t
    + e``, so that each 16 bytes is one k-step's k half for one token. The
    positions of ``k >= K`` (in a partial last chunk) are left unset: the
    kernel never reads them. One copy, two where K is not a multiple of 128."""
    if x.dim() != 2:
        raise ValueError(f"chunk_permuted takes [rows, K], got {tuple(x.shape)}")
    rows, k = x.shape
    if k % 32 != 0:
        raise ValueError(f"chunk_permuted needs K % 32 == 0, got K = {k}")
    full, blocks = divmod(k, K_CHUNK)
    out = torch.empty((rows, (full + (blocks > 0)) * K_CHUNK), dtype=x.dtype, device=x.device)
    if full:
        # dims (t, w, e, h, d) of k in a chunk -> (w, h, d, t, e)
        src = x[:, : full * K_CHUNK].reshape(rows, full, 4, 4, 2, 2, 2)
        out[:, : full * K_CHUNK].view(rows, full, 4, 2, 2, 4, 2).copy_(
            src.permute(0, 1, 3, 5, 6, 2, 4)
        )
    if blocks:
        # the partial chunk's t < K % 128 / 32 only
        tv = blocks // 32
        src = x[:, full * K_CHUNK :].reshape(rows, tv, 4, 2, 2, 2)
        out[:, full * K_CHUNK :].view(rows, 4, 2, 2, 4, 2)[:, :, :, :, :tv].copy_(
            src.permute(0, 2, 4, 5, 1, 3)
        )
    return out


#: (natural nibble i, role bit b: m, e0, e1, s) -> the bit a repacked word
#: holds it in (the header's PDFLASH_MXFP4_KIND_WGMMA_RC table)
REPACKED_BIT = (
    (6, 7, 8, 15),
    (10, 11, 12, 19),
    (16, 17, 18, 25),
    (4, 5, 14, 13),
    (22, 23, 24, 31),
    (26, 27, 28, 3),
    (0, 1, 2, 9),
    (20, 21, 30, 29),
)


def repack_codes(blocks: torch.Tensor) -> torch.Tensor:
    """MXFP4 ``blocks`` (uint8, last dimension a multiple of 4: little-endian
    32-bit words of 8 codes) with each word's bits moved as
    :data:`REPACKED_BIT` says, the layout :data:`KIND_WGMMA_RC` variants
    read; the same shape, a new tensor. A bijection per word: the codes and
    their bytes' count are unchanged, only their bit positions."""
    if blocks.dtype != torch.uint8 or blocks.dim() == 0 or blocks.shape[-1] % 4 != 0:
        raise ValueError(
            "repack_codes takes uint8 blocks whose last dimension is a multiple of 4, got "
            f"{blocks.dtype} {tuple(blocks.shape)}"
        )
    b = blocks.contiguous().to(torch.int64).reshape(-1, 4)
    words = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)
    out = torch.zeros_like(words)
    for nibble, targets in enumerate(REPACKED_BIT):
        for role, target in enumerate(targets):
            out |= ((words >> (4 * nibble + role)) & 1) << target
    shifts = torch.tensor([0, 8, 16, 24], device=blocks.device)
    return ((out[:, None] >> shifts) & 0xFF).to(torch.uint8).reshape(blocks.shape)


def chunk_major_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """MXFP4 ``blocks`` ``[S, N, K/32, 16]`` copied chunk-major, per slot
    ``[ceil(K/128)][N][64]`` (a partial last chunk zero-padded), with the
    launcher's ``(stride_ws, stride_wn, stride_wc)`` for it: each 128-k chunk
    of consecutive rows is one contiguous run (the header's ``stride_wc``)."""
    if blocks.dtype != torch.uint8 or blocks.dim() != 4 or blocks.shape[3] != 16:
        raise ValueError(f"chunk_major_blocks takes uint8 [S, N, G, 16], got {tuple(blocks.shape)}")
    s, n, kb, _ = blocks.shape
    nc = -(-kb // 4)
    padded = blocks.new_zeros(s, n, nc * 4, 16)
    padded[:, :, :kb] = blocks
    tiled = padded.view(s, n, nc, 64).transpose(1, 2).contiguous()  # [S, NC, N, 64]
    return tiled, tiled.stride(0), 64, n * 64


def reads_chunk_permuted(block_m: int, device: torch.device | str | None = None) -> bool:
    """Whether the variant :func:`pick_variant` gives for ``block_m`` on
    ``device`` reads x chunk-permuted (kind :data:`KIND_WGMMA_PX`): then an
    expert MLP hands the first GEMM's output to the second in that layout."""
    variant = pick_variant(block_m, device)
    return native().variant_info(variant)[5] == KIND_WGMMA_PX


def bm64_setting() -> str:
    """``PDFLASH_MXFP4_CUDA_BM64`` (``auto`` when unset or empty); ValueError
    for any other value than :data:`BM64_SETTINGS`'s."""
    setting = os.environ.get(BM64_ENV, "") or "auto"
    if setting not in BM64_SETTINGS:
        raise ValueError(f"{BM64_ENV} must be one of {BM64_SETTINGS}, got {setting!r}")
    return setting


def pick_variant(block_m: int, device: torch.device | str | None = None) -> int:
    """The variant for ``block_m`` on ``device`` (None: the current CUDA
    device; module docstring): 8 up to 32; above, as ``PDFLASH_MXFP4_CUDA_BM64``
    says: ``auto`` the wgmma variant 10 where it runs on ``device``
    (:func:`wgmma_unavailable`), else 4; ``mma`` 4; ``wgmma`` 10 and
    ``wgmma_px`` 14, raising :class:`WgmmaUnavailableError` where they cannot
    run."""
    if not 1 <= block_m <= MAX_BLOCK_M:
        raise ValueError(f"the CUDA MXFP4 GEMM takes block_m 1..{MAX_BLOCK_M}, got {block_m}")
    setting = bm64_setting()  # validated at every block_m: a typo never goes unnoticed
    if block_m <= 32:
        return SMALL_BLOCK_VARIANT
    if setting == "mma":
        return LARGE_BLOCK_VARIANT
    why = wgmma_unavailable(device)
    if why is None:
        return WGMMA_PX_BLOCK_VARIANT if setting == "wgmma_px" else WGMMA_BLOCK_VARIANT
    if setting != "auto":
        raise WgmmaUnavailableError(f"{BM64_ENV}={setting} cannot run: {why}")
    return LARGE_BLOCK_VARIANT


#: :func:`wgmma_unavailable`'s answers per CUDA device index
_WGMMA_WHY: dict[int, str | None] = {}


def wgmma_unavailable(device: torch.device | str | None = None) -> str | None:
    """Why the wgmma variant cannot run on ``device`` (None: the current CUDA
    device), or None where it can: the build has its sm_90a code (CUDA
    architecture 90 at build time) and the device is compute capability 9.0
    (the launcher's own rule, ``variant_available``; cached per device)."""
    mod = native()
    if not mod.BUILT:
        return "pdflash_native._mxfp4gemm was built without the CUDA MXFP4 GEMM"
    if not mod.WGMMA_BUILT:
        return (
            "this build has no sm_90a code for the wgmma variant "
            "(CMAKE_CUDA_ARCHITECTURES without 90)"
        )
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type != "cuda":
        return f"the wgmma variant runs on CUDA devices, not {dev.type}"
    index = dev.index if dev is not None else None
    if index is not None and index in _WGMMA_WHY:
        return _WGMMA_WHY[index]
    if not torch.cuda.is_available():
        return "no CUDA device"
    if index is None:
        index = torch.cuda.current_device()
    if index not in _WGMMA_WHY:
        rc = mod.variant_available(WGMMA_BLOCK_VARIANT, index)
        if rc == mod.OK:
            why = None
        elif rc == mod.VARIANT_UNAVAILABLE:
            major, minor = torch.cuda.get_device_capability(index)
            why = (
                "the wgmma variant's sm_90a code runs on compute capability 9.0 only, "
                f"cuda:{index} is sm_{major}{minor}"
            )
        else:
            why = f"querying cuda:{index} failed: {mod.error_string(rc)} (code {rc})"
        _WGMMA_WHY[index] = why
    return _WGMMA_WHY[index]


def unavailable(device: torch.device | str) -> str | None:
    """Why the kernel cannot run on ``device`` (None: it can; whether it
    agrees with the reference is the first-use probe's business,
    :func:`pdflash.models.compressed_gemm.fused_gemm_unavailable`)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"the CUDA MXFP4 GEMM runs on CUDA devices, not {device.type}"
    mod = native()
    if not mod.BUILT:
        return (
            "pdflash_native._mxfp4gemm was built without the CUDA MXFP4 GEMM "
            "(no CUDA compiler at build time, or CMAKE_CUDA_ARCHITECTURES below 80)"
        )
    if not torch.cuda.is_available():
        return "no CUDA device"
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    if major < 8:
        return f"the CUDA MXFP4 GEMM needs sm_80 or newer, the device is sm_{major}{minor}"
    return None


def _aligned(t: torch.Tensor, nbytes: int) -> bool:
    return t.data_ptr() % nbytes == 0


def grouped_mxfp4_gemm(
    x: torch.Tensor,
    x_rows: torch.Tensor,
    tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    block_m: int,
    w: SlabWeight,
    *,
    act: int = ACT_NONE,
    gate_up: tuple[int, int, int] = (0, 0, 1),
    alpha: float = 1.0,
    limit: float = 0.0,
    out_dtype: torch.dtype | None = None,
    variant: int | None = None,
    x_layout: str = NATURAL,
    out_layout: str = NATURAL,
    codes: str = CODES_NATURAL,
) -> torch.Tensor:
    """``out[r] = epilogue(x[x_rows[r]] @ W[slot(r)]^T + bias)`` for the
    sorted rows ``r`` the tile map covers (others are left unset), as
    :func:`~pdflash.models.fused_moe_triton.grouped_qgemm` with
    ``w.fmt == "mxfp4"``: ``act`` ``ACT_NONE`` (``[n, N]``), ``ACT_GPTOSS``
    or ``ACT_SILU`` with ``gate_up = (gate_col0, up_col0, col_step)``
    (``[n, N_out]``). ``x``: bf16 ``[rows, K]``, rows 16-byte aligned (k
    stride 1, row stride a multiple of 8); ``x_rows`` int32 (int64 is
    converted); ``tiles`` int32 and contiguous; blocks 16-byte aligned with
    row strides that are multiples of 16 bytes; scales with k stride 1;
    bias bf16. Output bf16 (``out_dtype`` None or bf16). ``variant``: None
    picks by ``block_m`` and the device (:func:`pick_variant`); a
    :data:`KIND_WGMMA_PX` variant reads :func:`chunk_permuted` ``(x)``, made
    here from a ``NATURAL`` x; ``x_layout=CHUNK_PERMUTED`` says x is that
    copy already (``[rows, ceil(K / 128) * 128]``; such a variant only).
    ``out_layout=CHUNK_PERMUTED`` writes the output in that layout
    (``[n, ceil(N_out / 128) * 128]``, N_out a multiple of 32; the positions
    past N_out unset), the next such GEMM's x. ``codes=CODES_REPACKED`` says
    ``w``'s blocks are :func:`repack_codes`'s; it needs a
    :data:`KIND_WGMMA_RC` variant, named (:data:`WGMMA_RC_VARIANT`), and such
    a variant needs it. A ValueError
    names what the kernel cannot take; a RuntimeError reports a CUDA failure
    (:class:`WgmmaUnavailableError`: a wgmma variant where it cannot run)."""
    w.check()
    if w.fmt != "mxfp4":
        raise ValueError(f"the CUDA MXFP4 GEMM takes MXFP4 slab weights, got {w.fmt!r}")
    if codes not in (CODES_NATURAL, CODES_REPACKED):
        raise ValueError(f"codes must be {CODES_NATURAL!r} or {CODES_REPACKED!r}, got {codes!r}")
    for name, layout in (("x_layout", x_layout), ("out_layout", out_layout)):
        if layout not in LAYOUTS:
            raise ValueError(f"{name} must be one of {LAYOUTS}, got {layout!r}")
    x_width = w.k if x_layout == NATURAL else -(-w.k // K_CHUNK) * K_CHUNK
    if x.dim() != 2 or x.shape[1] != x_width:
        raise ValueError(f"x ({x_layout}) must be [rows, {x_width}], got {tuple(x.shape)}")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"the CUDA MXFP4 GEMM takes bf16 activations, got {x.dtype}")
    if out_dtype not in (None, torch.bfloat16):
        raise ValueError(f"the CUDA MXFP4 GEMM writes bf16, not {out_dtype}")
    if act not in (ACT_NONE, ACT_GPTOSS, ACT_SILU):
        raise ValueError(f"act must be ACT_NONE, ACT_GPTOSS or ACT_SILU (0/1/2), got {act!r}")
    if not 1 <= block_m <= MAX_BLOCK_M:
        raise ValueError(f"the CUDA MXFP4 GEMM takes block_m 1..{MAX_BLOCK_M}, got {block_m}")
    if x_rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"x_rows must be int32 or int64, got {x_rows.dtype}")
    slot, start, end = tiles
    named = {"x_rows": x_rows, "blocks": w.data, "scales": w.scale, "tile slot": slot}
    named.update({"tile start": start, "tile end": end})
    if w.bias is not None:
        named["bias"] = w.bias
    for name, t in named.items():
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    for name, t in (("slot", slot), ("start", start), ("end", end)):
        if t.dtype != torch.int32 or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"tile {name} must be a contiguous 1-D int32 tensor")
    if not slot.numel() == start.numel() == end.numel():
        raise ValueError("the tile map's slot, start and end must have one entry per tile")
    if w.bias is not None and w.bias.dtype != torch.bfloat16:
        raise ValueError(f"the CUDA MXFP4 GEMM reads a bf16 bias, got {w.bias.dtype}")
    n_rows = int(x_rows.numel())
    if act == ACT_NONE:
        n_out, (g0, u0, step) = w.n, (0, 0, 1)
    else:
        g0, u0, step = gate_up
        if step < 1 or g0 < 0 or u0 < 0:
            raise ValueError(
                f"gate_up must be (gate_col0 >= 0, up_col0 >= 0, step >= 1), got {gate_up}"
            )
        n_out = -(-(w.n - max(g0, u0)) // step)
    if out_layout == CHUNK_PERMUTED and n_out % 32 != 0:
        raise ValueError(f"out_layout {CHUNK_PERMUTED!r} needs N_out % 32 == 0, got {n_out}")
    # the kernel's 16-byte loads
    if x.stride(1) != 1 or x.stride(0) % 8 != 0 or not _aligned(x, 16):
        raise ValueError(
            "x rows must be 16-byte aligned: k stride 1, row stride a multiple of 8 "
            f"elements, data 16-byte aligned (strides {x.stride()}, address % 16 = "
            f"{x.data_ptr() % 16})"
        )
    blocks, scales = w.data, w.scale
    if blocks.stride(0) % 16 != 0 or blocks.stride(1) % 16 != 0 or not _aligned(blocks, 16):
        raise ValueError(
            "MXFP4 blocks must be 16-byte aligned with slot and row strides that are "
            f"multiples of 16 bytes (strides {blocks.stride()})"
        )
    stride_sk = 1 if scales.shape[2] == 1 else scales.stride(2)
    if stride_sk != 1:
        raise ValueError(f"MXFP4 scales need k stride 1, got strides {scales.stride()}")
    mod = native()
    picked = variant is None
    if variant is not None:
        if not 0 <= variant < mod.num_variants():
            raise ValueError(f"unknown CUDA MXFP4 GEMM variant {variant} (of {mod.num_variants()})")
        max_block_m = mod.variant_info(variant)[3]
        if block_m > max_block_m:
            raise ValueError(
                f"CUDA MXFP4 GEMM variant {variant} takes block_m <= {max_block_m}, got {block_m}"
            )
    if x.device.type != "cuda":
        raise ValueError(f"the CUDA MXFP4 GEMM runs on CUDA tensors, x is on {x.device}")
    if variant is None:
        variant = pick_variant(block_m, x.device)
    kind = mod.variant_info(variant)[5]
    if not picked and kind in WGMMA_KINDS:  # (pick_variant asked already)
        why = wgmma_unavailable(x.device)
        if why is not None:
            raise WgmmaUnavailableError(f"CUDA MXFP4 GEMM variant {variant} cannot run: {why}")
    if (kind == KIND_WGMMA_RC) != (codes == CODES_REPACKED):
        raise ValueError(
            f"codes {codes!r} with variant {variant} of kind {kind}: repacked codes go with "
            "a KIND_WGMMA_RC variant (WGMMA_RC_VARIANT) and only there"
        )
    reads_permuted = kind == KIND_WGMMA_PX
    if x_layout == CHUNK_PERMUTED and not reads_permuted:
        raise ValueError(
            f"x_layout {CHUNK_PERMUTED!r} needs a variant of kind KIND_WGMMA_PX; variant "
            f"{variant} reads x as given"
        )
    out_width = n_out if out_layout == NATURAL else -(-n_out // K_CHUNK) * K_CHUNK
    out = torch.empty((n_rows, out_width), dtype=torch.bfloat16, device=x.device)
    if n_rows == 0 or slot.numel() == 0 or n_out == 0:
        return out
    if x_rows.dtype != torch.int32 or not x_rows.is_contiguous():
        x_rows = x_rows.to(torch.int32).contiguous()
    if reads_permuted and x_layout == NATURAL:
        x = chunk_permuted(x)
    out_code = mod.OUT_NATURAL if out_layout == NATURAL else mod.OUT_CHUNK_PERMUTED
    bias = w.bias
    device = x.device
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index != torch.cuda.current_device():
        with torch.cuda.device(index):
            rc = _launch(mod, variant, x, x_rows, w, bias, out, tiles, block_m, n_out,
                         act, g0, u0, step, alpha, limit, stride_sk, out_code)  # fmt: skip
    else:
        rc = _launch(mod, variant, x, x_rows, w, bias, out, tiles, block_m, n_out,
                     act, g0, u0, step, alpha, limit, stride_sk, out_code)  # fmt: skip
    if rc != mod.OK:
        raise _error(mod, rc, variant, block_m)
    return out


def _launch(
    mod: Mxfp4GemmNative, variant: int, x: torch.Tensor, x_rows: torch.Tensor, w: SlabWeight,
    bias: torch.Tensor | None, out: torch.Tensor,
    tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor], block_m: int, n_out: int, act: int,
    g0: int, u0: int, step: int, alpha: float, limit: float, stride_sk: int, out_code: int,
) -> int:  # fmt: skip
    slot, start, end = tiles
    blocks, scales = w.data, w.scale
    return mod.launch(
        variant, x.data_ptr(), x.stride(0), x_rows.data_ptr(),
        blocks.data_ptr(), blocks.stride(0), blocks.stride(1), 4 * blocks.stride(2),
        scales.data_ptr(), scales.stride(0), scales.stride(1), stride_sk,
        bias.data_ptr() if bias is not None else 0, bias.stride(0) if bias is not None else 0,
        out.data_ptr(), out.stride(0),
        slot.data_ptr(), start.data_ptr(), end.data_ptr(), int(slot.numel()),
        block_m, w.n, w.k, n_out, act, g0, u0, step, float(alpha), float(limit), out_code,
        torch.cuda.current_stream().cuda_stream,
    )  # fmt: skip


def _error(mod: Mxfp4GemmNative, rc: int, variant: int, block_m: int) -> Exception:
    """The launcher's code as an exception: argument codes as ValueError
    (the checks above should have caught them), CUDA codes as RuntimeError."""
    what = f"mxfp4_moe_gemm(variant {variant}, block_m {block_m}) returned {rc}"
    if rc >= mod.LAUNCH_ERROR:
        return RuntimeError(f"{what}: the launch failed: {mod.error_string(rc)}")
    if rc >= mod.ATTRIBUTE_ERROR:
        return RuntimeError(
            f"{what}: setting the kernel's shared memory failed (K too large for this "
            f"device?): {mod.error_string(rc)}"
        )
    if rc == mod.NOT_BUILT:
        return RuntimeError(f"{what}: {mod.error_string(rc)}")
    if rc == mod.VARIANT_UNAVAILABLE:
        return WgmmaUnavailableError(f"{what}: {mod.error_string(rc)}")
    return ValueError(f"{what}: {mod.error_string(rc)}")
