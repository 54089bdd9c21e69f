"""Grouped dequantize-GEMM over the expert slab: one Triton launch per
projection per layer, compressed weights dequantized on the fly (imported
only where ``triton`` is).

Rows arrive sorted by slot (the grouped path's routing -> slot sort). A
*tile map* (:func:`tile_map`: two small launches, no host sync; its
reference is :func:`pdflash.models.compressed_gemm.tile_map`) cuts each
slot's rows into ``BLOCK_M`` tiles; program ``(t, n)`` multiplies tile
``t``'s activations (gathered through ``x_rows``, no gathered copy of ``x``)
by columns ``n`` of its slot's weights, read straight from the slab:

* MXFP4 (gpt-oss as released): ``blocks [S, N, K/32, 16]`` (two e2m1 codes per
  byte, low nibble first) and ``scales [S, N, K/32]`` (e8m0), the layout the
  store and slab hold. ``registers`` (default): a ``[BLOCK_N, BLOCK_K/2]``
  byte tile becomes two ``[BLOCK_N, BLOCK_K/2]`` value tiles (low and high
  nibbles: the even and odd ``k``), each multiplied with the matching
  even/odd columns of the activation tile, so no interleave is needed. The
  values have the bits of :func:`pdflash.models.layout.dequantize_mxfp4_torch`:
  by adding exponents when every scale byte of the program's rows is in
  2..252 (checked once, before the K loop), else built from bits by
  :func:`pdflash.models.mxfp4_triton.e2m1_to_f32`. ``scaled``:
  ``tl.dot_scaled`` (bf16 x e2m1 with the e8m0 scales; Triton upcasts before
  the MMA on sm_90; GPU only).
* FP8 (``--expert-dtype fp8``): e4m3 ``[S, N, K]`` or ``[S, K, N]`` (any
  strides) with one fp32 scale per output channel, applied to the fp32
  accumulator after the K loop (the dequant path scales each weight first:
  equal up to rounding).

Products accumulate in fp32 (``tl.dot``). Epilogues: ``ACT_NONE`` (+ bias),
``ACT_GPTOSS`` (two accumulators over the gate and up columns, + biases,
gpt-oss's clamped SwiGLU ``(clamp(up) + 1) * g * sigmoid(alpha * g)`` with
``g = min(gate, limit)``) and ``ACT_SILU`` (``silu(gate) * up``, the SwiGLU
archs). The gate/up columns are ``gate_col0 + j * col_step`` and
``up_col0 + j * col_step`` (gpt-oss interleaves them: 0/1/2; the SwiGLU archs
stack them: 0/I/1).

An all-resident call needs neither the sort nor the tile map apart:
:func:`row_plan` (one program) orders the routed rows by slot, writes their
tokens and cuts the tiles; :func:`weighted_combine` (one launch) weighs each
token's expert outputs back into one row.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from pdflash.models.mxfp4_triton import e2m1_to_f32

WFMT_MXFP4 = 0
WFMT_FP8 = 1
ACT_NONE = 0
ACT_GPTOSS = 1
ACT_SILU = 2

_TL_DTYPES: dict[torch.dtype, Any] = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_INTERPRETING = _interpreting()  # at import, as triton decides (decoration time)


def _configs() -> list[Any]:
    """sm_90 candidates for small M (few rows per group, many groups):
    narrow N tiles for many programs, and few warps per program: the loads
    of the weight bytes are not software-pipelined (they feed arithmetic,
    not the dot), so latency is hidden by many small programs per SM
    (2-4 warps) rather than by stages. The set is the H200 sweep's leaders
    at 16-256 tokens (``bench/h200/mxfp4_sweep.py``) plus an 8-warp tile for
    the register-hungry variants. The interpreter (tests) runs one config;
    ``PDFLASH_FUSED_AUTOTUNE=0`` (read at import) runs :data:`DEFAULT_CONFIG`
    without tuning (no tuning compiles, e.g. in GPU tests);
    ``PDFLASH_FUSED_CONFIGS`` (read at import) replaces the candidates
    (:func:`parse_configs`); shapes under :data:`TUNE_MIN_WEIGHTS` tune only
    the default (:func:`_prune_configs`)."""
    if _INTERPRETING:
        return [triton.Config({"BLOCK_N": 32, "BLOCK_K": 64}, num_warps=4, num_stages=1)]
    if os.environ.get("PDFLASH_FUSED_AUTOTUNE", "1") == "0":
        return [_config(*DEFAULT_CONFIG)]
    if os.environ.get("PDFLASH_FUSED_CONFIGS"):
        return [_config(*c) for c in parse_configs(os.environ["PDFLASH_FUSED_CONFIGS"])]
    shapes = [
        (32, 64, 2, 3), (64, 64, 2, 3), (32, 128, 2, 3), (32, 64, 4, 3), (64, 64, 4, 3),
        (128, 64, 4, 3), (64, 64, 8, 3),
    ]  # fmt: skip
    return [_config(*shape) for shape in shapes]


def parse_configs(text: str) -> list[tuple[int, int, int, int]]:
    """``BLOCK_N:BLOCK_K:warps:stages,...`` as config tuples
    (``PDFLASH_FUSED_CONFIGS``); a clear error on anything else: tile sizes
    and warps are powers of two, ``BLOCK_N >= 16`` (``tl.dot``'s smallest),
    ``BLOCK_K >= 32`` (one MXFP4 scale group), stages ``>= 1``."""
    out = []
    for item in text.split(","):
        try:
            fields = tuple(int(v) for v in item.split(":"))
        except ValueError:
            fields = ()
        if len(fields) != 4 or fields[3] < 1:
            raise ValueError(
                f"PDFLASH_FUSED_CONFIGS: {item!r} is not BLOCK_N:BLOCK_K:warps:stages "
                "(positive integers)"
            )
        block_n, block_k, warps, stages = fields
        if not all(v > 0 and v & (v - 1) == 0 for v in (block_n, block_k, warps)) or (
            block_n < 16 or block_k < 32
        ):
            raise ValueError(
                f"PDFLASH_FUSED_CONFIGS: {item!r}: BLOCK_N (>= 16), BLOCK_K (>= 32) and "
                "warps must be powers of two"
            )
        out.append((block_n, block_k, warps, stages))
    return out


#: (BLOCK_N, BLOCK_K, num_warps, num_stages) without autotuning: 8 warps keep
#: every variant (MXFP4 in registers or through tl.dot_scaled, FP8; BLOCK_M
#: 16 to 64) from spilling (ptxas, sm_90a)
DEFAULT_CONFIG = (64, 64, 8, 3)

#: below this many weights per slot (output columns x inputs), a shape gets
#: :data:`DEFAULT_CONFIG` alone: its run is too short for the candidates'
#: timings to matter, and each candidate costs a compile and a benchmark (the
#: first-use probe's small case; tiny test models)
TUNE_MIN_WEIGHTS = 1 << 16


def _config_shape(config: Any) -> tuple[int, int, int, int]:
    kw = config.kwargs
    return (kw["BLOCK_N"], kw["BLOCK_K"], config.num_warps, config.num_stages)


def _prune_configs(configs: list[Any], named_args: dict[str, Any], **kwargs: Any) -> list[Any]:
    """The autotuner's candidates for one call: all of them, or for a shape
    of fewer than :data:`TUNE_MIN_WEIGHTS` weights per slot only
    :data:`DEFAULT_CONFIG` (the first candidate where it is not one)."""
    if int(named_args["N"]) * int(kwargs["K"]) >= TUNE_MIN_WEIGHTS:
        return configs
    default = [c for c in configs if _config_shape(c) == DEFAULT_CONFIG]
    return default or configs[:1]


def _config(block_n: int, block_k: int, warps: int, stages: int) -> Any:
    return triton.Config(
        {"BLOCK_N": block_n, "BLOCK_K": block_k}, num_warps=warps, num_stages=stages
    )


@triton.jit
def _to_dot(values, DOT_DTYPE: tl.constexpr):
    # one return per path: triton compiles the code after a static branch's
    # return too, and two return types would not compile
    if DOT_DTYPE == tl.bfloat16:  # noqa: SIM300 (constexpr first: triton unwraps it)
        # exact products (<= 2 significant bits, >= 2^-128): bf16 is the fp32 bits' top half
        top = values.to(tl.uint32, bitcast=True) >> 16
        out = top.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = values
    return out


@triton.jit
def _e2m1_scaled_bits(code, scale_m1):
    """fp32 bits of e2m1 ``code`` times ``2^(s - 127)`` for ``2 <= s <= 252``
    (``scale_m1 = (s - 1) << 23``) by adding exponents: magnitude ``m >= 2``
    has exponent field ``(m >> 1) + s - 1`` and mantissa bit ``m & 1``, which
    is ``(m << 22) + scale_m1``; ``m = 1`` (0.5) drops that mantissa bit;
    ``m = 0`` is zero. Every result is a normal fp32 (no rounding, no
    subnormal): the same bits as the general path, in fewer operations."""
    mag = code & 7
    bits = (mag << 22) + scale_m1 - tl.where(mag == 1, 1 << 22, 0)
    return tl.where(mag == 0, 0, bits) | ((code & 8) << 28)


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _mxfp4_tiles(
    w_base, s_base, cols, col_live, k0, KB, stride_wn, stride_sn, stride_sk,
    BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr, FAST: tl.constexpr,
):  # fmt: skip
    """Low- and high-nibble value tiles ``[BLOCK_N, BLOCK_K/2]`` of rows
    ``cols`` at values ``k0 .. k0 + BLOCK_K`` (the even and odd ``k``).
    ``FAST``: the caller checked every scale byte is in 2..252."""
    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    live = col_live[:, None] & (kb[None, :] < KB)
    packed = tl.load(w_base + cols[:, None] * stride_wn + kb[None, :], mask=live, other=0).to(
        tl.int32
    )
    s = tl.load(
        s_base + cols[:, None] * stride_sn + (kb[None, :] // 16) * stride_sk, mask=live, other=127
    ).to(tl.int32)
    if FAST:  # every scale byte of the program's rows is in 2..252
        scale_m1 = (s - 1) << 23
        lo = _e2m1_scaled_bits(packed & 0x0F, scale_m1).to(tl.float32, bitcast=True)
        hi = _e2m1_scaled_bits(packed >> 4, scale_m1).to(tl.float32, bitcast=True)
    else:
        scale = tl.where(s == 0, 0x00400000, s << 23).to(tl.float32, bitcast=True)
        lo = e2m1_to_f32(packed & 0x0F) * scale
        hi = e2m1_to_f32(packed >> 4) * scale
    return _to_dot(lo, DOT_DTYPE), _to_dot(hi, DOT_DTYPE)


@triton.jit
def _fp8_tile(w_base, cols, col_live, ks, K, stride_wn, stride_wk, DOT_DTYPE: tl.constexpr):
    """``[BLOCK_N, BLOCK_K]`` e4m3 values of rows ``cols`` at columns ``ks``."""
    live = col_live[:, None] & (ks[None, :] < K)
    raw = tl.load(
        w_base + cols[:, None] * stride_wn + ks[None, :] * stride_wk, mask=live, other=0.0
    )
    return raw.to(tl.float32).to(DOT_DTYPE)


@triton.jit
def _dot(a, b_nk, acc, DOT_DTYPE: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:
        # the interpreter's dot multiplies bf16's raw bits: take the (exact)
        # fp32 values of the same bf16 tiles there
        out = tl.dot(a.to(tl.float32), tl.trans(b_nk.to(tl.float32)), acc, input_precision="ieee")
    elif DOT_DTYPE == tl.float32:  # noqa: SIM300
        out = tl.dot(a, tl.trans(b_nk), acc, input_precision="ieee")
    else:
        out = tl.dot(a, tl.trans(b_nk), acc)
    return out


@triton.jit
def _mxfp4_dot_scaled(
    xt, w_base, s_base, cols, col_live, k0, KB, stride_wn, stride_sn, stride_sk, acc,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``acc + xt @ W[cols]^T`` through ``tl.dot_scaled`` (bf16 x e2m1 with
    e8m0 scales): Triton's own MXFP4 upcast (emulated before the MMA on
    sm_90). Not available under the interpreter."""
    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    packed = tl.load(
        w_base + cols[None, :] * stride_wn + kb[:, None],
        mask=col_live[None, :] & (kb[:, None] < KB),
        other=0,
    )  # [BLOCK_K / 2, BLOCK_N], two codes per byte along K, low nibble first
    groups = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    scales = tl.load(
        s_base + cols[:, None] * stride_sn + groups[None, :] * stride_sk,
        mask=col_live[:, None] & (groups[None, :] < KB // 16),
        other=127,
    )  # [BLOCK_N, BLOCK_K / 32]
    return tl.dot_scaled(xt, None, "bf16", packed, scales, "e2m1", acc, fast_math=True)


@triton.jit
def _k_loop(
    x_base, stride_xk, row_live, w_base, stride_wn, stride_wk, s_base, stride_sn, stride_sk,
    gate_cols, up_cols, j_live,
    K: tl.constexpr, WFMT: tl.constexpr, ACT: tl.constexpr, DOT_DTYPE: tl.constexpr,
    UPCAST_DOT: tl.constexpr, MXFP4_DOT_SCALED: tl.constexpr, FAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The gate (and up, when ``ACT``) accumulators over all of K.
    ``FAST``: MXFP4 values by exponent add (scale bytes checked)."""
    # builtins only (tl.full, not tl.zeros; no tl.sigmoid): the kernel also
    # runs under an interpreter enabled after triton was imported
    acc_g = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    acc_u = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    HALF_K: tl.constexpr = BLOCK_K // 2
    for k0 in range(0, K, BLOCK_K):
        if MXFP4_DOT_SCALED:  # MXFP4 through tl.dot_scaled (bf16 activations)
            ks = k0 + tl.arange(0, BLOCK_K)
            x_live = row_live[:, None] & (ks[None, :] < K)
            xt = tl.load(x_base + ks[None, :] * stride_xk, mask=x_live, other=0.0)
            xt = xt.to(tl.bfloat16)
            acc_g = _mxfp4_dot_scaled(
                xt, w_base, s_base, gate_cols, j_live, k0, K // 2,
                stride_wn, stride_sn, stride_sk, acc_g, BLOCK_K,
            )  # fmt: skip
            if ACT != 0:
                acc_u = _mxfp4_dot_scaled(
                    xt, w_base, s_base, up_cols, j_live, k0, K // 2,
                    stride_wn, stride_sn, stride_sk, acc_u, BLOCK_K,
                )  # fmt: skip
        elif WFMT == 0:  # MXFP4, dequantized in registers
            half = tl.arange(0, HALF_K)
            k_even = k0 + 2 * half
            x_live = row_live[:, None] & (k_even[None, :] < K)
            x_even = tl.load(x_base + k_even[None, :] * stride_xk, mask=x_live, other=0.0)
            x_odd = tl.load(x_base + (k_even[None, :] + 1) * stride_xk, mask=x_live, other=0.0)
            x_even = x_even.to(DOT_DTYPE)
            x_odd = x_odd.to(DOT_DTYPE)
            lo, hi = _mxfp4_tiles(
                w_base, s_base, gate_cols, j_live, k0, K // 2,
                stride_wn, stride_sn, stride_sk, BLOCK_K, DOT_DTYPE, FAST,
            )  # fmt: skip
            acc_g = _dot(x_even, lo, acc_g, DOT_DTYPE, UPCAST_DOT)
            acc_g = _dot(x_odd, hi, acc_g, DOT_DTYPE, UPCAST_DOT)
            if ACT != 0:
                lo, hi = _mxfp4_tiles(
                    w_base, s_base, up_cols, j_live, k0, K // 2,
                    stride_wn, stride_sn, stride_sk, BLOCK_K, DOT_DTYPE, FAST,
                )  # fmt: skip
                acc_u = _dot(x_even, lo, acc_u, DOT_DTYPE, UPCAST_DOT)
                acc_u = _dot(x_odd, hi, acc_u, DOT_DTYPE, UPCAST_DOT)
        else:  # FP8, per-output-channel scales applied after the loop
            ks = k0 + tl.arange(0, BLOCK_K)
            x_live = row_live[:, None] & (ks[None, :] < K)
            xt = tl.load(x_base + ks[None, :] * stride_xk, mask=x_live, other=0.0).to(DOT_DTYPE)
            wt = _fp8_tile(w_base, gate_cols, j_live, ks, K, stride_wn, stride_wk, DOT_DTYPE)
            acc_g = _dot(xt, wt, acc_g, DOT_DTYPE, UPCAST_DOT)
            if ACT != 0:
                wt = _fp8_tile(w_base, up_cols, j_live, ks, K, stride_wn, stride_wk, DOT_DTYPE)
                acc_u = _dot(xt, wt, acc_u, DOT_DTYPE, UPCAST_DOT)

    return acc_g, acc_u


@triton.jit
def _scales_in_range(
    s_base, gate_cols, up_cols, j_live, stride_sn, stride_sk,
    K: tl.constexpr, ACT: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Whether every MXFP4 scale byte of the program's gate (and up) rows is
    in 2..252, where values come by adding exponents (outside it, never in
    released checkpoints, products can be subnormal or overflow)."""
    groups0 = tl.arange(0, BLOCK_K // 32)
    bad = tl.full((gate_cols.shape[0], BLOCK_K // 32), 0, tl.int32)
    for g0 in range(0, K // 32, BLOCK_K // 32):
        groups = g0 + groups0
        live = j_live[:, None] & (groups[None, :] < K // 32)
        sg = tl.load(
            s_base + gate_cols[:, None] * stride_sn + groups[None, :] * stride_sk,
            mask=live, other=127,
        ).to(tl.int32)  # fmt: skip
        bad = tl.maximum(bad, tl.where((sg < 2) | (sg > 252), 1, 0))
        if ACT != 0:
            su = tl.load(
                s_base + up_cols[:, None] * stride_sn + groups[None, :] * stride_sk,
                mask=live, other=127,
            ).to(tl.int32)  # fmt: skip
            bad = tl.maximum(bad, tl.where((su < 2) | (su > 252), 1, 0))
    return tl.reduce(tl.reduce(bad, 1, _max_combine), 0, _max_combine) == 0


@triton.autotune(
    configs=_configs(),
    key=["N", "K", "BLOCK_M", "WFMT", "ACT", "MXFP4_DOT_SCALED"],
    prune_configs_by={"early_config_prune": _prune_configs},
)
@triton.jit
def _grouped_qgemm_kernel(
    x_ptr, x_rows_ptr, stride_xm, stride_xk,
    w_ptr, stride_ws, stride_wn, stride_wk,
    sc_ptr, stride_ss, stride_sn, stride_sk,
    bias_ptr, stride_bs,
    out_ptr, stride_om,
    tile_slot_ptr, tile_start_ptr, tile_end_ptr,
    N, gate_col0, up_col0, col_step, alpha, limit,
    K: tl.constexpr, WFMT: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_DTYPE: tl.constexpr,
    UPCAST_DOT: tl.constexpr, MXFP4_DOT_SCALED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.load(tile_slot_ptr + pid_t)
    if slot < 0:  # past the last live tile (the grid is a bound, known without a sync)
        return
    start = tl.load(tile_start_ptr + pid_t)
    end = tl.load(tile_end_ptr + pid_t)
    rows = start + tl.arange(0, BLOCK_M)
    row_live = rows < end
    x_rows = tl.load(x_rows_ptr + rows, mask=row_live, other=0).to(tl.int64)
    x_base = x_ptr + x_rows[:, None] * stride_xm

    j = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns
    j_live = j < N
    gate_cols = gate_col0 + j * col_step
    up_cols = up_col0 + j * col_step
    slot64 = slot.to(tl.int64)
    w_base = w_ptr + slot64 * stride_ws
    s_base = sc_ptr + slot64 * stride_ss

    if WFMT == 0 and not MXFP4_DOT_SCALED:
        # one check of the program's scale bytes picks the loop: no branch inside it
        if _scales_in_range(
            s_base, gate_cols, up_cols, j_live, stride_sn, stride_sk, K, ACT, BLOCK_K
        ):
            acc_g, acc_u = _k_loop(
                x_base, stride_xk, row_live, w_base, stride_wn, stride_wk, s_base, stride_sn,
                stride_sk, gate_cols, up_cols, j_live, K, WFMT, ACT, DOT_DTYPE, UPCAST_DOT,
                MXFP4_DOT_SCALED, True, BLOCK_M, BLOCK_N, BLOCK_K,
            )  # fmt: skip
        else:
            acc_g, acc_u = _k_loop(
                x_base, stride_xk, row_live, w_base, stride_wn, stride_wk, s_base, stride_sn,
                stride_sk, gate_cols, up_cols, j_live, K, WFMT, ACT, DOT_DTYPE, UPCAST_DOT,
                MXFP4_DOT_SCALED, False, BLOCK_M, BLOCK_N, BLOCK_K,
            )  # fmt: skip
    else:
        acc_g, acc_u = _k_loop(
            x_base, stride_xk, row_live, w_base, stride_wn, stride_wk, s_base, stride_sn,
            stride_sk, gate_cols, up_cols, j_live, K, WFMT, ACT, DOT_DTYPE, UPCAST_DOT,
            MXFP4_DOT_SCALED, True, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip

    if WFMT == 1:
        sg = tl.load(s_base + gate_cols * stride_sn, mask=j_live, other=0.0)
        acc_g = acc_g * sg[None, :]
        if ACT != 0:
            su = tl.load(s_base + up_cols * stride_sn, mask=j_live, other=0.0)
            acc_u = acc_u * su[None, :]
    if HAS_BIAS:
        b_base = bias_ptr + slot64 * stride_bs
        acc_g += tl.load(b_base + gate_cols, mask=j_live, other=0.0).to(tl.float32)[None, :]
        if ACT != 0:
            acc_u += tl.load(b_base + up_cols, mask=j_live, other=0.0).to(tl.float32)[None, :]
    if ACT == 1:  # gpt-oss: clamped SwiGLU
        gate = tl.minimum(acc_g, limit)
        up = tl.minimum(tl.maximum(acc_u, -limit), limit)
        y = (up + 1.0) * (gate / (1.0 + tl.exp(-gate * alpha)))
    elif ACT == 2:  # silu(gate) * up
        y = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    else:
        y = acc_g
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + j[None, :]
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=row_live[:, None] & j_live[None, :])


@triton.jit
def _add_combine(a, b):
    return a + b


@triton.jit
def _search(sorted_ptr, count, target, strict: tl.constexpr, STEPS: tl.constexpr):
    """Per lane: how many of ``sorted_ptr[0:count]`` (ascending) are
    ``<= target`` (``< target`` when ``strict``); binary search, ``STEPS >=
    ceil(log2(count + 1))`` rounds."""
    lo = tl.full(target.shape, 0, tl.int32)
    hi = tl.full(target.shape, 0, tl.int32) + count
    for _ in range(STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        v = tl.load(sorted_ptr + mid, mask=active, other=0)
        if strict:  # noqa: SIM108 (a static if on a constexpr in a triton kernel)
            below = v < target
        else:
            below = v <= target
        lo = tl.where(active & below, mid + 1, lo)
        hi = tl.where(active & (below == 0), mid, hi)
    return lo


@triton.jit
def _group_tiles_kernel(
    key_ptr, n, width, starts_ptr, ends_ptr, tile_ends_ptr,
    BLOCK_W: tl.constexpr, STEPS_N: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """One program: each group's row range in the sorted keys and the
    cumulative count of its ``BLOCK_M`` tiles."""
    g = tl.arange(0, BLOCK_W)
    live = g < width
    starts = _search(key_ptr, n, g, True, STEPS_N)
    ends = _search(key_ptr, n, g, False, STEPS_N)
    tiles = tl.where(live, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    tile_ends = tl.associative_scan(tiles, 0, _add_combine)
    tl.store(starts_ptr + g, starts, mask=live)
    tl.store(ends_ptr + g, ends, mask=live)
    tl.store(tile_ends_ptr + g, tile_ends, mask=live)


@triton.jit
def _tile_rows_kernel(
    starts_ptr, ends_ptr, tile_ends_ptr, width, bound, slot_ptr, start_ptr, end_ptr,
    BLOCK_T: tl.constexpr, STEPS_W: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Per tile: its group (-1 past the last live tile) and row range."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_live = t < bound
    g = _search(tile_ends_ptr, width, t, False, STEPS_W)
    live = t_live & (g < width)
    gc = tl.where(live, g, 0)
    group_start = tl.load(starts_ptr + gc, mask=live, other=0)
    group_end = tl.load(ends_ptr + gc, mask=live, other=0)
    first = (
        tl.load(tile_ends_ptr + gc, mask=live, other=0)
        - (group_end - group_start + BLOCK_M - 1) // BLOCK_M
    )
    tl.store(slot_ptr + t, tl.where(live, g, -1), mask=t_live)
    tl.store(start_ptr + t, group_start + (t - first) * BLOCK_M, mask=t_live)
    tl.store(end_ptr + t, group_end, mask=t_live)


def tile_map(
    key_sorted: torch.Tensor, width: int, block_m: int, max_groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`pdflash.models.compressed_gemm.tile_map` in two small launches
    (the torch version takes ~20); the same tiles (tests compare them). Dead
    tiles carry slot -1 (their row ranges are not used)."""
    if width < 1 or block_m < 1:
        raise ValueError(f"tile_map needs width >= 1 and block_m >= 1, got {width}, {block_m}")
    n = int(key_sorted.numel())
    device = key_sorted.device
    bound = -(-n // block_m) + min(width, n, max(0, max_groups))
    starts = torch.empty(width, dtype=torch.int32, device=device)
    ends = torch.empty_like(starts)
    tile_ends = torch.empty_like(starts)
    slot = torch.empty(bound, dtype=torch.int32, device=device)
    start = torch.empty_like(slot)
    end = torch.empty_like(slot)
    if bound == 0:
        return slot, start, end
    _group_tiles_kernel[(1,)](
        key_sorted, n, width, starts, ends, tile_ends,
        BLOCK_W=triton.next_power_of_2(width), STEPS_N=max(1, n.bit_length() + 1),
        BLOCK_M=block_m,
    )  # fmt: skip
    block_t = 256
    _tile_rows_kernel[(triton.cdiv(bound, block_t),)](
        starts, ends, tile_ends, width, bound, slot, start, end,
        BLOCK_T=block_t, STEPS_W=max(1, width.bit_length() + 1), BLOCK_M=block_m,
    )  # fmt: skip
    return slot, start, end


#: :func:`row_plan` takes at most this many ``rows x keys`` cells (keys
#: rounded up to a power of two): one program walks them all, ~16 ns a row
#: over 32 keys on an H100, so past this (1024 rows over 32 keys, 256 over
#: 128) the caller's sort, whose kernels spread over the GPU, is kept (up to
#: here the plan measured faster; past it the two were not compared)
ROW_PLAN_MAX_CELLS = 1 << 15
#: one-hot cells a program holds at a time (``keys x rows`` of a chunk)
_ROW_PLAN_CHUNK_CELLS = 16384
_ROW_PLAN_WARPS = 8
#: what the atomic plan (:func:`row_plan` with ``ordered=False``) takes
ROW_PLAN_ATOMIC_MAX_ROWS = 1 << 16
ROW_PLAN_ATOMIC_MAX_KEYS = 1024
#: rows the atomic plan reads at a time
_ROW_PLAN_ATOMIC_CHUNK = 1024


@triton.jit
def _chunk_keys(ids_ptr, keys_ptr, c0, n, dead_key, CHUNK: tl.constexpr):
    """Rows ``c0 .. c0 + CHUNK``: their indices, which are live (``< n``) and
    their slot keys ``keys[ids[r]]`` (``dead_key`` past ``n``)."""
    r = c0 + tl.arange(0, CHUNK)
    live = r < n
    e = tl.load(ids_ptr + r, mask=live, other=0)
    key = tl.load(keys_ptr + e, mask=live, other=dead_key).to(tl.int32)
    return r, live, key


@triton.jit
def _row_plan_kernel(
    ids_ptr, keys_ptr, n, width, k, bound, position_ptr, token_ptr, slot_ptr, start_ptr,
    end_ptr, BLOCK_W: tl.constexpr, CHUNK: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_M: tl.constexpr, N_PAD: tl.constexpr, T_PAD: tl.constexpr,
):  # fmt: skip
    """One program: each routed row's key ``keys[ids[r]]``, its place in the
    rows ordered stably by key, the token of the row at each place and the
    ``BLOCK_M`` tile map over the ordered rows (the counting sort of
    :func:`pdflash.models.offload.sort_rows` and :func:`tile_map` fused).
    The loops run to ``N_PAD >= n`` and ``T_PAD >= bound`` (powers of two:
    few compiles), masked past them."""
    g = tl.arange(0, BLOCK_W)
    # pass 1: rows per key
    counts = tl.full((BLOCK_W,), 0, tl.int32)
    for c0 in range(0, N_PAD, CHUNK):
        r, live, key = _chunk_keys(ids_ptr, keys_ptr, c0, n, -1, CHUNK)
        hit = (key[None, :] == g[:, None]).to(tl.int32)  # [BLOCK_W, CHUNK]
        counts += tl.reduce(hit, 1, _add_combine)
    ends = tl.associative_scan(counts, 0, _add_combine)
    # pass 2: a row's place is its key's next free place, in row order
    nxt = ends - counts
    for c0 in range(0, N_PAD, CHUNK):
        r, live, key = _chunk_keys(ids_ptr, keys_ptr, c0, n, -1, CHUNK)
        hit = (key[None, :] == g[:, None]).to(tl.int32)
        rank = tl.associative_scan(hit, 1, _add_combine)  # 1-based among the chunk's rows of a key
        place = tl.reduce(hit * (nxt[:, None] + rank - 1), 0, _add_combine)
        tl.store(position_ptr + r, place, mask=live)
        tl.store(token_ptr + place, r // k, mask=live)
        nxt += tl.reduce(hit, 1, _add_combine)
    _plan_tiles(
        counts, ends, g, width, bound, slot_ptr, start_ptr, end_ptr, BLOCK_T, BLOCK_M, T_PAD
    )


@triton.jit
def _row_plan_atomic_kernel(
    ids_ptr, keys_ptr, n, width, k, bound, cursor_ptr, position_ptr, token_ptr, slot_ptr,
    start_ptr, end_ptr, BLOCK_W: tl.constexpr, CHUNK: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_M: tl.constexpr, N_PAD: tl.constexpr, T_PAD: tl.constexpr,
):  # fmt: skip
    """:func:`_row_plan_kernel` without its one-hot: a histogram counts the
    rows per key, and each row takes its place by an atomic add on its key's
    next free place (``cursor_ptr``, ``BLOCK_W`` int32 scratch), so the rows
    of one key land in no fixed order among themselves (each row's output is
    its own: the block's result is the same)."""
    g = tl.arange(0, BLOCK_W)
    counts = tl.full((BLOCK_W,), 0, tl.int32)
    for c0 in range(0, N_PAD, CHUNK):
        r, live, key = _chunk_keys(ids_ptr, keys_ptr, c0, n, 0, CHUNK)
        counts += tl.histogram(key, BLOCK_W, mask=live)
    ends = tl.associative_scan(counts, 0, _add_combine)
    tl.store(cursor_ptr + g, ends - counts)
    tl.debug_barrier()  # every key's first place is written before any row takes one
    for c0 in range(0, N_PAD, CHUNK):
        r, live, key = _chunk_keys(ids_ptr, keys_ptr, c0, n, 0, CHUNK)
        place = tl.atomic_add(cursor_ptr + key, 1, mask=live)
        tl.store(position_ptr + r, place, mask=live)
        tl.store(token_ptr + place, r // k, mask=live)
    _plan_tiles(
        counts, ends, g, width, bound, slot_ptr, start_ptr, end_ptr, BLOCK_T, BLOCK_M, T_PAD
    )


@triton.jit
def _plan_tiles(
    counts, ends, g, width, bound, slot_ptr, start_ptr, end_ptr, BLOCK_T: tl.constexpr,
    BLOCK_M: tl.constexpr, T_PAD: tl.constexpr,
):  # fmt: skip
    """The ``BLOCK_M`` tile map over rows ordered by key, from the rows per
    key ``counts`` and their cumulative ``ends`` (keys ``g``)."""
    tiles = tl.where(g < width, (counts + BLOCK_M - 1) // BLOCK_M, 0)
    tile_ends = tl.associative_scan(tiles, 0, _add_combine)
    first = tile_ends - tiles
    starts = ends - counts
    for t0 in range(0, T_PAD, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_live = t < bound
        # a tile's group: how many groups' tiles end at or before it
        grp = tl.reduce((tile_ends[None, :] <= t[:, None]).to(tl.int32), 1, _add_combine)
        live = t_live & (grp < width)
        sel = (g[None, :] == grp[:, None]).to(tl.int32)  # [BLOCK_T, BLOCK_W]
        group_start = tl.where(live, tl.reduce(sel * starts[None, :], 1, _add_combine), 0)
        group_end = tl.where(live, tl.reduce(sel * ends[None, :], 1, _add_combine), 0)
        group_first = tl.where(live, tl.reduce(sel * first[None, :], 1, _add_combine), 0)
        tl.store(slot_ptr + t, tl.where(live, grp, -1), mask=t_live)
        tl.store(start_ptr + t, group_start + (t - group_first) * BLOCK_M, mask=t_live)
        tl.store(end_ptr + t, group_end, mask=t_live)


@dataclass(frozen=True)
class RowPlan:
    """What the fused MLP needs of the routed rows, from one launch
    (:func:`row_plan`): ``position[r]`` is row ``r``'s place in the rows
    ordered stably by slot key, ``token[p]`` the token of the row at place
    ``p`` (the GEMM's ``x_rows``), ``tiles`` the ``block_m`` tile map over
    the ordered rows (all int32)."""

    position: torch.Tensor
    token: torch.Tensor
    tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    block_m: int


def row_plan_fits(rows: int, width: int, *, ordered: bool = True) -> bool:
    """Whether :func:`row_plan` takes ``rows`` routed rows over ``width`` keys
    (``ordered``: the stable plan; else the atomic one, which holds no
    one-hot and takes up to :data:`ROW_PLAN_ATOMIC_MAX_ROWS` rows over up to
    :data:`ROW_PLAN_ATOMIC_MAX_KEYS` keys)."""
    if not ordered:
        return 1 <= width <= ROW_PLAN_ATOMIC_MAX_KEYS and rows <= ROW_PLAN_ATOMIC_MAX_ROWS
    return width >= 1 and rows * triton.next_power_of_2(width) <= ROW_PLAN_MAX_CELLS


def row_plan(
    ids: torch.Tensor,
    keys: torch.Tensor,
    width: int,
    k: int,
    block_m: int,
    max_groups: int,
    *,
    chunk_cells: int | None = None,
    num_warps: int | None = None,
    ordered: bool = True,
) -> RowPlan:
    """The routed rows ``r`` (token ``r // k``, expert ``ids[r]``) ordered
    stably by slot key ``keys[ids[r]]`` (every key in ``[0, width)``) and
    cut into ``block_m`` tiles, in one launch: the places, tokens and tiles
    that :func:`pdflash.models.offload.sort_rows` (``position``, ``token``)
    and :func:`tile_map` (the tiles, same count; dead tiles' row ranges are
    not read) give, exactly. ``ids``: int64 ``[n]``; ``keys``: int64 table
    indexed by expert id. :func:`row_plan_fits` says which sizes it takes.
    ``chunk_cells`` (one-hot cells a program holds at a time) and
    ``num_warps`` override the launch's tuning (``bench/h200/row_plan_sweep.py``).
    ``ordered=False``: the atomic plan (:func:`_row_plan_atomic_kernel`):
    the same tiles and the same rows per key, each key's rows at its places
    in no fixed order (a valid plan: every output row is the same; the
    block's default row sort, ``plan_atomic``)."""
    if width < 1 or block_m < 1 or k < 1:
        raise ValueError(f"row_plan needs width, block_m and k >= 1, got {width}, {block_m}, {k}")
    n = int(ids.numel())
    if not row_plan_fits(max(n, 1), width, ordered=ordered):
        takes = (
            f"rows x keys <= {ROW_PLAN_MAX_CELLS}"
            if ordered
            else f"<= {ROW_PLAN_ATOMIC_MAX_ROWS} rows over <= {ROW_PLAN_ATOMIC_MAX_KEYS} keys"
        )
        raise ValueError(f"row_plan takes {takes}, got {n} x {width}")
    if ids.dim() != 1 or keys.dim() != 1 or not (ids.is_contiguous() and keys.is_contiguous()):
        raise ValueError("row_plan takes contiguous 1-D ids and keys")
    device = ids.device
    bound = -(-n // block_m) + min(width, n, max(0, max_groups))
    position = torch.empty(n, dtype=torch.int32, device=device)
    token = torch.empty(n, dtype=torch.int32, device=device)
    slot = torch.empty(bound, dtype=torch.int32, device=device)
    start = torch.empty_like(slot)
    end = torch.empty_like(slot)
    if n == 0:
        return RowPlan(position, token, (slot, start, end), block_m)
    block_w = triton.next_power_of_2(width)
    cells = chunk_cells or _ROW_PLAN_CHUNK_CELLS
    block_t = max(16, min(triton.next_power_of_2(bound), cells // block_w))
    warps = num_warps or _ROW_PLAN_WARPS
    t_pad = max(block_t, triton.next_power_of_2(bound))
    if ordered:
        chunk = max(16, min(triton.next_power_of_2(n), cells // block_w))
        _row_plan_kernel[(1,)](
            ids, keys, n, width, k, bound, position, token, slot, start, end,
            BLOCK_W=block_w, CHUNK=chunk, BLOCK_T=block_t, BLOCK_M=block_m,
            N_PAD=max(chunk, triton.next_power_of_2(n)), T_PAD=t_pad, num_warps=warps,
        )  # fmt: skip
    else:
        chunk = max(16, min(triton.next_power_of_2(n), _ROW_PLAN_ATOMIC_CHUNK))
        cursor = torch.empty(block_w, dtype=torch.int32, device=device)
        _row_plan_atomic_kernel[(1,)](
            ids, keys, n, width, k, bound, cursor, position, token, slot, start, end,
            BLOCK_W=block_w, CHUNK=chunk, BLOCK_T=block_t, BLOCK_M=block_m,
            N_PAD=max(chunk, triton.next_power_of_2(n)), T_PAD=t_pad, num_warps=warps,
        )  # fmt: skip
    return RowPlan(position, token, (slot, start, end), block_m)


@triton.jit
def _round_bf16(v):
    """fp32 ``v`` rounded to the nearest bf16 (ties to even), kept in fp32:
    by bits, so the interpreter (which truncates in ``.to(bfloat16)``) and the
    GPU round alike. Infinities stay, NaNs stay NaN."""
    bits = v.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    special = (bits & 0x7F800000) == 0x7F800000
    nan = special & ((bits & 0x007FFFFF) != 0)
    out = tl.where(special, tl.where(nan, bits | 0x00400000, bits) & 0xFFFF0000, rounded)
    return out.to(tl.float32, bitcast=True)


@triton.jit
def _weighted_combine_kernel(
    y_ptr, stride_y, position_ptr, w_ptr, out_ptr, stride_o, hidden, K: tl.constexpr,
    HAS_POSITION: tl.constexpr, BF16_PRODUCT: tl.constexpr, BF16_OUT: tl.constexpr,
    BLOCK_H: tl.constexpr,
):  # fmt: skip
    """``out[t] = sum_j round(y[row(t, j)] * w[t, j])`` accumulated in fp32 in
    ``j`` order, rounded to out's dtype once; ``row(t, j)`` is
    ``position[t * K + j]`` (the row's place) or ``t * K + j``."""
    tok = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    live = h < hidden
    acc = tl.full((BLOCK_H,), 0.0, tl.float32)
    for j in tl.static_range(K):
        if HAS_POSITION:
            row = tl.load(position_ptr + tok * K + j).to(tl.int64)
        else:
            row = (tok * K + j).to(tl.int64)
        w = tl.load(w_ptr + tok * K + j).to(tl.float32)
        y = tl.load(y_ptr + row * stride_y + h, mask=live, other=0.0).to(tl.float32)
        product = y * w
        if BF16_PRODUCT:
            product = _round_bf16(product)
        acc += product
    if BF16_OUT:
        acc = _round_bf16(acc)
    tl.store(out_ptr + tok * stride_o + h, acc.to(out_ptr.dtype.element_ty), mask=live)


def weighted_combine(
    y: torch.Tensor,
    weights: torch.Tensor,
    out_dtype: torch.dtype,
    position: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each token's ``k`` expert outputs weighted and summed in one launch:
    ``(y[rows].view(T, k, H) * weights.unsqueeze(-1)).sum(dim=1)`` in
    ``out_dtype``, where ``rows`` is ``position`` (each routed row's place in
    ``y``) or every row in order. The product is rounded to the promoted
    dtype of ``y`` and ``weights`` (as torch's multiply), the sum runs in
    fp32 in ``j`` order and is rounded once."""
    tokens, k = weights.shape
    if y.dim() != 2 or (y.shape[1] > 1 and y.stride(1) != 1) or y.dtype not in _TL_DTYPES:
        raise ValueError("weighted_combine takes fp32/bf16 [rows, H] with contiguous rows")
    if position is not None and (position.numel() != tokens * k or not position.is_contiguous()):
        raise ValueError(f"position must be contiguous with {tokens * k} entries")
    if position is None and y.shape[0] != tokens * k:
        raise ValueError(f"y has {y.shape[0]} rows for {tokens} x {k} routed rows")
    product = torch.promote_types(y.dtype, weights.dtype)
    if product not in _TL_DTYPES or out_dtype not in _TL_DTYPES:
        raise ValueError(f"weighted_combine takes fp32/bf16, got {product} -> {out_dtype}")
    hidden = int(y.shape[1])
    out = torch.empty((tokens, hidden), dtype=out_dtype, device=y.device)
    if tokens == 0 or hidden == 0:
        return out
    weights = weights.contiguous()
    block_h = min(1024, triton.next_power_of_2(hidden))
    _weighted_combine_kernel[(tokens, triton.cdiv(hidden, block_h))](
        y, y.stride(0), position if position is not None else weights, weights, out,
        out.stride(0), hidden, K=k, HAS_POSITION=position is not None,
        BF16_PRODUCT=product == torch.bfloat16, BF16_OUT=out_dtype == torch.bfloat16,
        BLOCK_H=block_h,
    )  # fmt: skip
    return out


@dataclass(frozen=True)
class SlabWeight:
    """One projection's compressed weights over the slots: ``[S, N, K]``
    logically (output channel ``n``, input ``k``).

    ``fmt="mxfp4"``: ``data`` = blocks ``[S, N, K/32, 16]`` uint8 and
    ``scale`` = ``[S, N, K/32]`` uint8 (each row's bytes contiguous).
    ``fmt="fp8"``: ``data`` = e4m3 ``[S, N, K]`` (``n_axis=1``) or
    ``[S, K, N]`` (``n_axis=2``), ``scale`` = fp32 ``[S, N]``.
    ``bias``: ``[S, N]`` or None."""

    fmt: str
    data: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None = None
    n_axis: int = 1

    @property
    def n(self) -> int:
        if self.fmt == "mxfp4":
            return int(self.data.shape[1])
        return int(self.data.shape[self.n_axis])

    @property
    def k(self) -> int:
        if self.fmt == "mxfp4":
            return int(self.data.shape[2]) * 32
        return int(self.data.shape[3 - self.n_axis])

    def check(self) -> None:
        d, s = self.data, self.scale
        if self.fmt == "mxfp4":
            if d.dtype != torch.uint8 or s.dtype != torch.uint8 or d.dim() != 4:
                raise ValueError(
                    "MXFP4 slab weights: uint8 blocks [S, N, G, 16] and scales [S, N, G]"
                )
            if tuple(d.shape[:3]) != tuple(s.shape) or d.shape[3] != 16:
                raise ValueError(
                    f"MXFP4 blocks {tuple(d.shape)} do not match scales {tuple(s.shape)}"
                )
            if d.stride(3) != 1 or d.stride(2) != 16:
                raise ValueError("MXFP4 blocks: each row's bytes must be contiguous")
        elif self.fmt == "fp8":
            if d.dtype != torch.float8_e4m3fn or d.dim() != 3 or self.n_axis not in (1, 2):
                raise ValueError("FP8 slab weights: e4m3 [S, N, K] or [S, K, N]")
            if s.dtype != torch.float32 or tuple(s.shape) != (d.shape[0], self.n):
                raise ValueError(f"FP8 scales must be fp32 [S, N], got {s.dtype} {tuple(s.shape)}")
        else:
            raise ValueError(f"unknown slab weight format {self.fmt!r}")
        if self.bias is not None and (
            self.bias.dim() != 2 or self.bias.shape[1] != self.n or self.bias.stride(1) != 1
        ):
            raise ValueError(f"bias must be [S, {self.n}] with contiguous rows")


def grouped_qgemm(
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
    mxfp4_dot: str = "registers",
) -> torch.Tensor:
    """``out[r] = epilogue(x[x_rows[r]] @ W[slot(r)]^T)`` for the sorted rows
    ``r`` that ``tiles`` (:func:`pdflash.models.compressed_gemm.tile_map`) covers (others are left unset:
    the caller masks them). ``act=ACT_NONE``: ``[n, N]``; otherwise the gate
    and up columns are ``gate_up = (gate_col0, up_col0, col_step)`` and the
    output is ``[n, N_out]`` with ``N_out = (N - max(gate_col0, up_col0)) //
    col_step`` rounded up. ``mxfp4_dot``: ``registers`` (MXFP4 built from
    bits in registers, then ``tl.dot``) or ``scaled`` (``tl.dot_scaled``;
    bf16 activations on a GPU only). The tensors must live where Triton runs (a CUDA
    device, or the CPU under ``TRITON_INTERPRET=1``)."""
    w.check()
    if x.dim() != 2 or x.shape[1] != w.k:
        raise ValueError(f"x must be [rows, {w.k}], got {tuple(x.shape)}")
    if x.dtype not in _TL_DTYPES:
        raise ValueError(f"x must be fp32 or bf16, got {x.dtype}")
    n_rows = int(x_rows.numel())
    if act == ACT_NONE:
        n_out, (g0, u0, step) = w.n, (0, 0, 1)
    else:
        g0, u0, step = gate_up
        n_out = -(-(w.n - max(g0, u0)) // step)
    out = torch.empty((n_rows, n_out), dtype=out_dtype or x.dtype, device=x.device)
    slot, start, end = tiles
    if n_rows == 0 or slot.numel() == 0 or n_out == 0:
        return out
    if w.fmt == "mxfp4":
        wfmt = WFMT_MXFP4
        stride_ws, stride_wn, stride_wk = w.data.stride(0), w.data.stride(1), 1
        stride_ss, stride_sn, stride_sk = w.scale.stride(0), w.scale.stride(1), w.scale.stride(2)
    else:
        wfmt = WFMT_FP8
        stride_ws = w.data.stride(0)
        stride_wn, stride_wk = w.data.stride(w.n_axis), w.data.stride(3 - w.n_axis)
        stride_ss, stride_sn, stride_sk = w.scale.stride(0), w.scale.stride(1), 0
    if mxfp4_dot not in ("registers", "scaled"):
        raise ValueError(f"mxfp4_dot must be registers or scaled, got {mxfp4_dot!r}")
    dot_scaled = mxfp4_dot == "scaled" and w.fmt == "mxfp4"
    if dot_scaled and (x.dtype != torch.bfloat16 or _INTERPRETING):
        raise ValueError("mxfp4_dot='scaled' takes bf16 activations on a GPU (not the interpreter)")
    bias = w.bias
    if x_rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"x_rows must be int32 or int64, got {x_rows.dtype}")

    def grid(meta: dict[str, Any]) -> tuple[int, int]:
        return (int(slot.numel()), triton.cdiv(n_out, meta["BLOCK_N"]))

    _grouped_qgemm_kernel[grid](
        x, x_rows, x.stride(0), x.stride(1),
        w.data, stride_ws, stride_wn, stride_wk,
        w.scale, stride_ss, stride_sn, stride_sk,
        bias if bias is not None else w.scale, bias.stride(0) if bias is not None else 0,
        out, out.stride(0),
        slot, start, end,
        n_out, g0, u0, step, float(alpha), float(limit),
        K=w.k, WFMT=wfmt, ACT=act, HAS_BIAS=bias is not None, DOT_DTYPE=_TL_DTYPES[x.dtype],
        UPCAST_DOT=_INTERPRETING and x.dtype == torch.bfloat16,
        MXFP4_DOT_SCALED=dot_scaled,
        BLOCK_M=block_m,
    )  # fmt: skip
    return out
