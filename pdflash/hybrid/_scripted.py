"""The host kernels' batch loops, for TorchScript (see
:func:`pdflash.hybrid.kernels.batched_kernels`).

Each function is its kernel's ``forward`` (:mod:`pdflash.hybrid.kernels`),
op for op, looped over a layer's HOST experts with every expert's rows
written into ``out``. TorchScript reads these annotations at run time, so
this module spells them with ``typing``'s names (no postponed annotations).
"""

# ruff: noqa: UP006, UP007, UP035, UP045
from typing import List, Optional, Union

import torch
import torch.nn.functional as F


def linear(
    x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], layout: int
) -> torch.Tensor:
    """``kernels._linear`` by layout code: 0 ``out_in``, 1 ``in_out``, 2
    ``onednn``."""
    if layout == 2:
        no_scalars = torch.jit.annotate(  # type: ignore[no-untyped-call]
            List[Optional[Union[int, float, complex]]], []
        )
        y2: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", no_scalars, "")
        return y2
    y = F.linear(x, w) if layout == 0 else torch.mm(x, w)
    if b is not None:
        y.add_(b)
    return y


def gpt_oss_many(
    x: torch.Tensor,
    w1: List[torch.Tensor],
    b1: List[torch.Tensor],
    w2: List[torch.Tensor],
    b2: List[torch.Tensor],
    bounds: List[int],
    out: torch.Tensor,
    layout: int,
    alpha: float,
    limit: float,
) -> None:
    """``GptOssHostKernel.forward`` per expert."""
    for j in range(len(w1)):
        lo = bounds[j]
        hi = bounds[j + 1]
        h = linear(x[lo:hi], w1[j], b1[j], layout)
        i = h.size(1) // 2
        gate = h[:, :i].clamp_(max=limit)
        up = h[:, i:]
        glu = torch.mul(gate, alpha).sigmoid_().mul_(gate)
        glu.mul_(up.clamp_(min=-limit, max=limit).add_(1))
        out[lo:hi].copy_(linear(glu, w2[j], b2[j], layout))


def swiglu_silu_many(
    x: torch.Tensor,
    w1: List[torch.Tensor],
    w2: List[torch.Tensor],
    bounds: List[int],
    out: torch.Tensor,
    layout: int,
) -> None:
    """``SwiGLUHostKernel.forward`` with ``act = F.silu`` per expert."""
    for j in range(len(w1)):
        lo = bounds[j]
        hi = bounds[j + 1]
        h = linear(x[lo:hi], w1[j], None, layout)
        i = h.size(1) // 2
        out[lo:hi].copy_(linear(F.silu(h[:, :i]).mul_(h[:, i:]), w2[j], None, layout))
