"""MXFP4 dequantization as one Triton kernel (imported only where ``triton`` is).

Same contract and the same bits as :func:`pdflash.models.layout.dequantize_mxfp4_torch`:
``blocks [..., R, G, 16]`` (uint8, two e2m1 codes per byte, low nibble first)
and ``scales [..., R, G]`` (uint8 e8m0, bias 127) -> ``[..., R, G * 32]``.

One pass: each program reads ``BLOCK_GROUPS`` groups of 16 bytes and their
scale bytes once and writes the ``BLOCK_GROUPS x 32`` values once (the torch
path gathers through a 256-entry table with int64 indices, then multiplies in
a second pass over the output). Values are built from bits, no table:

* e2m1 code ``c`` (sign ``c >> 3``, magnitude ``m = c & 7``): ``m >= 2`` is
  ``2^((m >> 1) - 1) * (1 + (m & 1) / 2)``, i.e. fp32 exponent field
  ``(m >> 1) + 126`` and top mantissa bit ``m & 1``; ``m = 1`` is 0.5
  (exponent field 126); ``m = 0`` is +-0.
* the scale ``2^(s - 127)`` is the fp32 whose exponent field is ``s`` (``s = 0``:
  the subnormal ``2^-127``, mantissa bit 22; ``s = 255``: +inf, as
  ``exp2(128)`` gives in fp32).

The product is taken in fp32, where it is exact (at most 2 significant bits,
never below 2^-128), then written in the output dtype: fp32 as is; bf16 as
the fp32 bits' top half (exact too: bf16 has fp32's exponent range and
subnormals down to 2^-133); fp16 rounded once, with the scale first rounded
to fp16 as the torch path does (it over/underflows there).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

#: Groups (of 32 values) per program: 128 x 32 values per program.
BLOCK_GROUPS = 128

_TL_DTYPES: dict[torch.dtype, Any] = {
    torch.float32: tl.float32,
    torch.bfloat16: tl.bfloat16,
    torch.float16: tl.float16,
}


@triton.jit
def e2m1_to_f32(code):
    """e2m1 codes (int32, low 4 bits) as fp32 values, built from bits (module
    doc); :mod:`pdflash.models.fused_moe_triton` dequantizes with it too."""
    mag = code & 7
    exp_field = tl.where(mag >= 2, (mag >> 1) + 126, tl.where(mag == 1, 126, 0))
    mant_bit = tl.where(mag >= 2, mag & 1, 0)
    bits = ((code >> 3) << 31) | (exp_field << 23) | (mant_bit << 22)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _dequantize_mxfp4_kernel(
    blocks_ptr,
    scales_ptr,
    out_ptr,
    num_groups,
    OUT_DTYPE: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
):
    pid = tl.program_id(0)
    groups = pid.to(tl.int64) * BLOCK_GROUPS + tl.arange(0, BLOCK_GROUPS).to(tl.int64)
    live = groups < num_groups
    byte_cols = tl.arange(0, 16)
    packed = tl.load(
        blocks_ptr + groups[:, None] * 16 + byte_cols[None, :], mask=live[:, None], other=0
    ).to(tl.int32)
    s = tl.load(scales_ptr + groups, mask=live, other=127).to(tl.int32)
    # 2^(s-127) as fp32 bits, rounded to the output dtype like the torch path
    scale_bits = tl.where(s == 0, 0x00400000, s << 23)
    scale = scale_bits.to(tl.float32, bitcast=True)
    if OUT_DTYPE == tl.float16:  # noqa: SIM300 (constexpr first: triton unwraps it)
        scale = scale.to(tl.float16).to(tl.float32)  # over/underflows, as in the torch path
    lo = e2m1_to_f32(packed & 0x0F) * scale[:, None]
    hi = e2m1_to_f32(packed >> 4) * scale[:, None]
    # low nibble first: [BLOCK_GROUPS, 16, 2] -> [BLOCK_GROUPS, 32] (tl.interleave, spelled
    # with builtins so the kernel also runs under an interpreter enabled after triton imported)
    values = tl.reshape(tl.join(lo, hi), (BLOCK_GROUPS, 32))
    if OUT_DTYPE == tl.bfloat16:  # noqa: SIM300
        # every product has <= 2 significant bits and is >= 2^-128: exact in bf16, whose
        # bits are then the fp32 bits' top half (no rounding step to get wrong)
        top = values.to(tl.uint32, bitcast=True) >> 16
        values = top.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        values = values.to(OUT_DTYPE)
    out_cols = tl.arange(0, 32)
    tl.store(out_ptr + groups[:, None] * 32 + out_cols[None, :], values, mask=live[:, None])


def dequantize_mxfp4_triton(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The kernel on already validated ``blocks``/``scales`` (see the module
    docstring); non-contiguous inputs are made contiguous first. The tensors
    must live where Triton runs: a CUDA device, or the CPU under
    ``TRITON_INTERPRET=1``."""
    if dtype not in _TL_DTYPES:
        raise ValueError(f"MXFP4 Triton dequantizer writes fp32/bf16/fp16, not {dtype}")
    lead = tuple(int(d) for d in scales.shape[:-1])
    groups_per_row = int(scales.shape[-1])
    blocks = blocks.contiguous()
    scales = scales.contiguous()
    num_groups = scales.numel()
    out = torch.empty((*lead, groups_per_row * 32), dtype=dtype, device=blocks.device)
    if num_groups:
        grid = (triton.cdiv(num_groups, BLOCK_GROUPS),)
        _dequantize_mxfp4_kernel[grid](
            blocks, scales, out, num_groups, OUT_DTYPE=_TL_DTYPES[dtype], BLOCK_GROUPS=BLOCK_GROUPS
        )
    return out
