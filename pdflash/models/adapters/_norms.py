"""transformers' RMSNorm modules of the adapters' archs in one kernel fewer,
with the same values: where a norm ends in an fp32 product cast to the input
dtype, the multiply writes that dtype itself (the same fp32 product, rounded
once on store, as a separate cast rounds it). Modules not listed here are
called as they are."""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers.models.gpt_oss import modeling_gpt_oss
from transformers.models.qwen3_moe import modeling_qwen3_moe


def needs_grad(*tensors: Any) -> bool:
    """Autograd records these tensors' use (then the modules run as they are)."""
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors
    )


def normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``(x.float() * rsqrt(mean(x.float()^2, -1) + eps)).to(x.dtype)``
    (Llama-style RMSNorm before its weight), the cast done by the multiply."""
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    return torch.mul(h, torch.rsqrt(variance + eps), out=torch.empty_like(x))


def normalized_fp32(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x.float() * rsqrt(mean(x.float()^2, -1) + eps)``, kept in fp32 (the
    gpt-oss RMSNorm multiplies its weight in before the cast)."""
    h = x.to(torch.float32)
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


#: ``PDFLASH_FUSED_NORM``'s values (:func:`fused_norm_setting`)
FUSED_NORM_SETTINGS = ("off", "on")


def fused_norm_setting() -> str:
    """``PDFLASH_FUSED_NORM``: ``on`` (the default, and when unset) runs
    the norms below on CUDA in one Triton launch
    (:mod:`pdflash.models.rmsnorm_triton`; not bit-equal to the torch path:
    the normalized value within a bf16 step or a few fp32 ulps of it),
    ``off`` keeps the torch path. Any other value is a ValueError."""
    setting = os.environ.get("PDFLASH_FUSED_NORM", "") or "on"
    if setting not in FUSED_NORM_SETTINGS:
        raise ValueError(
            f"PDFLASH_FUSED_NORM must be one of {FUSED_NORM_SETTINGS}, got {setting!r}"
        )
    return setting


def _fused(norm: Any, x: torch.Tensor) -> torch.Tensor | None:
    """The one-launch norm where it is switched on and takes these
    arguments (:func:`~pdflash.models.rmsnorm_triton.unsupported`), else
    None."""
    if not x.is_cuda or fused_norm_setting() != "on":
        return None
    from pdflash.models import rmsnorm_triton

    style = (
        rmsnorm_triton.CAST_THEN_WEIGHT
        if type(norm) is modeling_qwen3_moe.Qwen3MoeRMSNorm
        else rmsnorm_triton.WEIGHT_THEN_CAST
    )
    weight: torch.Tensor = norm.weight
    return rmsnorm_triton.rms_norm_rows_if_supported(x, weight, norm.variance_epsilon, style)


def rms_norm(norm: Any, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)``, equal value for value, for transformers'
    ``Qwen3MoeRMSNorm`` (``weight * normed.to(dtype)``) and ``GptOssRMSNorm``
    (``(weight * normed).to(dtype)``) in one kernel fewer (on CUDA with
    ``PDFLASH_FUSED_NORM=on``, :func:`fused_norm_setting`, in one launch,
    within a bf16 step); any other module (or a subclass, which may compute
    otherwise) is called."""
    kind = type(norm)
    if needs_grad(x, norm.weight):  # a multiply into out= records no gradient
        out: torch.Tensor = norm(x)
        return out
    if kind in (modeling_qwen3_moe.Qwen3MoeRMSNorm, modeling_gpt_oss.GptOssRMSNorm):
        fused = _fused(norm, x)
        if fused is not None:
            return fused
    if kind is modeling_qwen3_moe.Qwen3MoeRMSNorm:
        weight: torch.Tensor = norm.weight
        return weight * normalized(x, norm.variance_epsilon)
    if kind is modeling_gpt_oss.GptOssRMSNorm:
        h = normalized_fp32(x, norm.variance_epsilon)
        return torch.mul(norm.weight, h, out=torch.empty_like(x))
    called: torch.Tensor = norm(x)
    return called
