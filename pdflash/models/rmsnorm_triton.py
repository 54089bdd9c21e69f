"""transformers' RMSNorm of the adapters' archs in one Triton launch, for
:func:`pdflash.models.adapters._norms.rms_norm` on CUDA when
``PDFLASH_FUSED_NORM`` is ``on`` (the default; B3's verify forward at
gpt-oss-20b shape took 0.92x the torch path's time on an H100, session 59). The
torch path takes five kernels and two fp32 round trips of the rows; this one
reads each row once and writes it once.

Values: the same formula in fp32 (``x * rsqrt(mean(x^2) + eps)``, then the
weight and the casts in each module's order), rounded to nearest even where
the modules round; the mean's summation order differs from torch's, so
the normalized value may differ from the torch path's by one bf16 step, or a
few fp32 ulps; where a module rounds twice (Qwen3: the cast, then the weight's
bf16 product) that step may grow to two in the output (tests bound both)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdflash.models.fused_moe_triton import _add_combine, _round_bf16

#: ``Qwen3MoeRMSNorm``: ``weight * normed.to(dtype)``
CAST_THEN_WEIGHT = 0
#: ``GptOssRMSNorm``: ``(weight * normed).to(dtype)``
WEIGHT_THEN_CAST = 1


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, n_cols, stride_x, stride_o, eps,
    BLOCK: tl.constexpr, STYLE: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # tl.reduce with pdflash's combine, not tl.sum: an interpreted kernel
    # cannot call triton's own @jit helpers when triton was imported first
    h = x * tl.rsqrt(tl.reduce(x * x, 0, _add_combine) / n_cols + eps)
    if STYLE == 0 and BF16:  # CAST_THEN_WEIGHT: normed.to(bf16) before the weight
        h = _round_bf16(h)
    y = w * h
    if BF16:
        y = _round_bf16(y)  # exact in bf16 now: the store's cast keeps it
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def unsupported(x: torch.Tensor, weight: torch.Tensor, style: int) -> str | None:
    """Why :func:`rms_norm_rows` cannot take these arguments, or None."""
    if style not in (CAST_THEN_WEIGHT, WEIGHT_THEN_CAST):
        return f"style must be CAST_THEN_WEIGHT or WEIGHT_THEN_CAST, got {style!r}"
    if x.dtype not in (torch.bfloat16, torch.float32):
        return f"rms_norm_rows takes bf16 or fp32 rows, got {x.dtype}"
    hidden = int(x.shape[-1]) if x.dim() else 0
    if weight.dim() != 1 or weight.numel() != hidden or hidden == 0:
        return f"weight must be [{hidden}] for rows of {hidden}, got {tuple(weight.shape)}"
    if weight.dtype not in (torch.bfloat16, torch.float32):
        return f"weight must be bf16 or fp32, got {weight.dtype}"
    if style == CAST_THEN_WEIGHT and weight.dtype != x.dtype:
        return "CAST_THEN_WEIGHT takes a weight of the rows' dtype (the product keeps it)"
    if x.device != weight.device:
        return f"x and weight on different devices: {x.device}, {weight.device}"
    return None


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float, style: int) -> torch.Tensor:
    """RMSNorm of ``x``'s last dimension with ``weight`` in one launch,
    ``style`` :data:`CAST_THEN_WEIGHT` or :data:`WEIGHT_THEN_CAST`; the
    output has ``x``'s shape and dtype. ``x``: bf16 or fp32 with a
    contiguous last dimension; ``weight``: ``[hidden]``, bf16 or fp32 (with
    :data:`CAST_THEN_WEIGHT`, ``x``'s dtype, as the module's product keeps
    it). A ValueError names what it cannot take (:func:`unsupported`)."""
    why = unsupported(x, weight, style)
    if why is not None:
        raise ValueError(why)
    return _launch(x, weight, eps, style)


def rms_norm_rows_if_supported(
    x: torch.Tensor, weight: torch.Tensor, eps: float, style: int
) -> torch.Tensor | None:
    """:func:`rms_norm_rows`, or None where :func:`unsupported` names a
    reason (the arguments checked once)."""
    if unsupported(x, weight, style) is not None:
        return None
    return _launch(x, weight, eps, style)


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float, style: int) -> torch.Tensor:
    """The kernel over ``x``'s rows (arguments already checked)."""
    hidden = int(x.shape[-1])
    rows = x.reshape(-1, hidden)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight.contiguous(), out, hidden, rows.stride(0), out.stride(0), float(eps),
            BLOCK=block, STYLE=style, BF16=x.dtype == torch.bfloat16,
            num_warps=8 if block >= 4096 else 4,
        )  # fmt: skip
    return out.view(x.shape)
