"""Compute-friendly host copies of the experts, and the functions that use them.

The store packs an expert for one H2D copy: gpt-oss's ``gate_up`` is
``[H, 2I]`` (``x @ W``, gate/up interleaved), MXFP4 experts are blocks and
scales, FP8 experts are e4m3 with scales. On a CPU that layout costs: torch's
bf16 GEMM over a few rows is ~1.4x slower with ``[in, out]`` weights than
with ``[out, in]``, and a compressed expert would be dequantized on every
call. A :class:`HostKernel` turns one expert's packed views into *prepared*
weights once (dense, ``[out, in]`` or ``[in, out]``, in a chosen dtype, with
gpt-oss's gate and up rows de-interleaved) and computes the expert's MLP
from them: the same function as the adapter's ``expert_forward`` (the tests
compare them per architecture), with fewer temporaries.

:class:`PreparedWeights` holds the prepared experts of a whole store (all or
none: a cost per expert that depended on its id would complicate the
planner for little); its host memory is counted and bounded by the caller
(:func:`pdflash.hybrid.build_host_service`'s ``weight_budget_bytes``).
Tensors that already are what the kernel wants (e.g. a dense SwiGLU
expert's ``[out, in]`` weights in the compute dtype) are shared with the
store, not copied, and cost nothing.

Formats (:data:`HOST_FORMATS`): ``packed`` computes on the store's views
with the adapter's own function (no extra memory; what the executor did
before); ``out_in`` / ``in_out`` are prepared in the model's dtype;
``fp32_out_in`` / ``fp32_in_out`` in float32 (twice a bf16 expert's bytes;
CPUs without a fast bf16 GEMM run fp32 faster). ``auto`` lets the
calibration pick the fastest that fits the budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

Weights = dict[str, torch.Tensor]

#: Host weight formats; ``auto`` (not listed) chooses among them by timing.
HOST_FORMATS: tuple[str, ...] = ("packed", "out_in", "in_out", "fp32_out_in", "fp32_in_out")


def format_dtype(fmt: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype a format computes in."""
    if fmt not in HOST_FORMATS:
        raise ValueError(f"unknown host format {fmt!r}; choose one of {HOST_FORMATS} or 'auto'")
    return torch.float32 if fmt.startswith("fp32_") else model_dtype


@runtime_checkable
class HostKernel(Protocol):
    """One architecture's expert MLP over prepared host weights."""

    name: str
    #: the compute dtype (hidden states are converted to it)
    dtype: torch.dtype

    def prepare(self, views: Weights) -> Weights:
        """One expert's packed views -> its prepared weights (new tensors
        where a conversion is needed, the views themselves otherwise)."""
        ...

    def forward(self, x: torch.Tensor, w: Weights) -> torch.Tensor:
        """The expert's MLP over ``x [n, H]`` (in :attr:`dtype`)."""
        ...


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` contiguous in ``dtype`` — the tensor itself when it already is."""
    if t.dtype == dtype and t.is_contiguous():
        return t
    return t.to(dtype).contiguous()


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out_in: bool) -> torch.Tensor:
    if out_in:
        return F.linear(x, w, b)
    y = x @ w
    return y if b is None else y.add_(b)


class GptOssHostKernel:
    """gpt-oss's clamped SwiGLU with biases (see
    :class:`pdflash.models.adapters.gpt_oss.GptOssAdapter.expert_forward`).

    Prepared: ``w1`` = ``[2I, H]`` (``out_in``) or ``[H, 2I]`` (``in_out``)
    with the gate rows (even columns of the packed ``gate_up``) first and the
    up rows after, ``b1`` likewise; ``w2`` = ``down`` as ``[H, I]`` or
    ``[I, H]``; ``b2``.
    """

    def __init__(
        self,
        alpha: float,
        limit: float,
        dense: Callable[[Weights], Weights],
        dtype: torch.dtype,
        out_in: bool,
        name: str,
    ) -> None:
        self.alpha, self.limit = float(alpha), float(limit)
        self.dense = dense
        self.dtype = dtype
        self.out_in = out_in
        self.name = name

    def prepare(self, views: Weights) -> Weights:
        w = self.dense(views)  # gate_up [H, 2I], down [I, H] (views for dense, new for MXFP4)
        gu, b = w["gate_up"], w["gate_up_bias"]
        if self.out_in:  # [2I, H], gate rows first
            rows = gu.t()
            w1 = torch.cat([rows[0::2], rows[1::2]], dim=0)
        else:  # [H, 2I], gate columns first
            w1 = torch.cat([gu[:, 0::2], gu[:, 1::2]], dim=1)
        down = w["down"]
        return {
            "w1": _as(w1, self.dtype),
            "b1": _as(torch.cat([b[0::2], b[1::2]]), self.dtype),
            "w2": _as(down.t() if self.out_in else down, self.dtype),
            "b2": _as(w["down_bias"], self.dtype),
        }

    def forward(self, x: torch.Tensor, w: Weights) -> torch.Tensor:
        h = _linear(x, w["w1"], w["b1"], self.out_in)
        i = h.shape[-1] // 2
        gate, up = h[:, :i], h[:, i:]
        gate = gate.clamp_(max=self.limit)
        up = up.clamp_(min=-self.limit, max=self.limit)
        glu = torch.sigmoid(gate * self.alpha).mul_(gate)
        return _linear(up.add_(1).mul_(glu), w["w2"], w["b2"], self.out_in)


class SwiGLUHostKernel:
    """The plain SwiGLU expert (Qwen3-MoE, Mixtral, OLMoE, ...; see
    ``SwiGLUExpertsMixin.expert_forward``): packed ``gate_up [2I, H]`` (gate
    rows first) and ``down [H, I]``, already ``[out, in]``."""

    def __init__(
        self,
        act: Callable[[torch.Tensor], torch.Tensor],
        dense: Callable[[Weights], Weights],
        dtype: torch.dtype,
        out_in: bool,
        name: str,
    ) -> None:
        self.act = act
        self.dense = dense
        self.dtype = dtype
        self.out_in = out_in
        self.name = name

    def prepare(self, views: Weights) -> Weights:
        w = self.dense(views)
        gu, down = w["gate_up"], w["down"]
        return {
            "w1": _as(gu if self.out_in else gu.t(), self.dtype),
            "w2": _as(down if self.out_in else down.t(), self.dtype),
        }

    def forward(self, x: torch.Tensor, w: Weights) -> torch.Tensor:
        h = _linear(x, w["w1"], None, self.out_in)
        i = h.shape[-1] // 2
        return _linear(self.act(h[:, :i]).mul_(h[:, i:]), w["w2"], None, self.out_in)


class PackedKernel:
    """The ``packed`` format: the adapter's own expert function on the
    store's views (nothing prepared)."""

    def __init__(
        self, expert_fn: Callable[[torch.Tensor, Weights], torch.Tensor], dtype: torch.dtype
    ):
        self.expert_fn = expert_fn
        self.dtype = dtype
        self.name = "packed"

    def prepare(self, views: Weights) -> Weights:
        return views

    def forward(self, x: torch.Tensor, w: Weights) -> torch.Tensor:
        return self.expert_fn(x, w)


def host_kernel_for(adapter: Any, fmt: str) -> HostKernel | None:
    """The kernel of ``fmt`` for ``adapter``'s experts, or None when the
    architecture has no prepared kernel (then only ``packed`` exists)."""
    dtype = format_dtype(fmt, adapter.store.layout.dtype)
    if fmt == "packed":
        return PackedKernel(adapter.expert_forward, dtype)
    out_in = fmt.endswith("out_in")
    dense = adapter.dense_expert_weights
    if getattr(adapter, "arch", None) == "gpt_oss" and hasattr(adapter, "_swiglu_params"):
        alpha, limit = adapter._swiglu_params()
        return GptOssHostKernel(alpha, limit, dense, dtype, out_in, fmt)
    if hasattr(adapter, "_activation") and _is_swiglu(adapter):
        return SwiGLUHostKernel(adapter._activation(), dense, dtype, out_in, fmt)
    return None


def _is_swiglu(adapter: Any) -> bool:
    from pdflash.models.adapters._swiglu import SwiGLUExpertsMixin

    # an override of expert_forward may compute something else
    return (
        isinstance(adapter, SwiGLUExpertsMixin)
        and type(adapter).expert_forward is SwiGLUExpertsMixin.expert_forward
    )


@dataclass
class PreparedWeights:
    """Every expert of a store in one format (flat id -> prepared weights).

    ``nbytes`` counts only the tensors the preparation allocated (tensors
    shared with the store cost nothing); ``prepare_s`` is the wall time it
    took.
    """

    format: str
    experts: list[Weights]
    nbytes: int
    prepare_s: float

    def of(self, flat_id: int) -> Weights:
        return self.experts[int(flat_id)]


def prepared_nbytes(prepared: Weights, views: Weights) -> int:
    """Bytes of ``prepared`` not shared with the store's ``views``."""
    shared = {v.untyped_storage().data_ptr() for v in views.values()}
    return sum(
        t.numel() * t.element_size()
        for t in prepared.values()
        if t.untyped_storage().data_ptr() not in shared
    )


def prepare_all(
    kernel: HostKernel,
    views_of: Callable[[int], Weights],
    ids: Sequence[int],
    *,
    budget_bytes: int | None = None,
    device: torch.device | str | None = None,
) -> PreparedWeights | None:
    """Prepare experts ``ids`` (in order; index = position). Returns None,
    having dropped what it prepared, when they would exceed
    ``budget_bytes`` (checked after the first expert, before the rest).

    ``device`` (e.g. the CUDA device of a compressed store): each expert's
    packed views are copied there, prepared there (the device's dequantizer:
    bit-identical to the CPU's, many times faster) and the result copied
    back to host memory; every prepared tensor is then new memory."""
    t0 = time.perf_counter()
    dev = None if device is None else torch.device(device)
    experts: list[Weights] = []
    total = 0
    with torch.inference_mode():
        for n, g in enumerate(ids):
            views = views_of(int(g))
            if dev is None:
                w = kernel.prepare(views)
                total += prepared_nbytes(w, views)
            else:
                on_dev = kernel.prepare({k: v.to(dev) for k, v in views.items()})
                w = {k: t.to("cpu").contiguous() for k, t in on_dev.items()}
                total += sum(t.numel() * t.element_size() for t in w.values())
            experts.append(w)
            if n == 0 and budget_bytes is not None and total * len(ids) > budget_bytes:
                return None
    return PreparedWeights(kernel.name, experts, total, time.perf_counter() - t0)
