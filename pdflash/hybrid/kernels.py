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
CPUs without a fast bf16 GEMM run fp32 faster); ``onednn`` in the model's
dtype, each matrix reordered once into oneDNN's blocked layout for the CPU's
matmul (torch's ``mkldnn._reorder_linear_weight``; opaque tensors, same
bytes). Why the last: torch's plain bf16 GEMM on AMX/AVX-512 cores repacks
the whole weight matrix into that layout on *every* call, which for the
few rows an expert gets here is most of the call; a prepacked matrix is
only read. It exists where torch has oneDNN (:func:`onednn_available`).
``native`` in bf16, packed once for pdflash's own C++ kernel
(:mod:`pdflash.hybrid.native`: each weight read once for all rows, AVX-512
BF16 dot products, fused bias and activation, a team of threads over the
output columns); it exists for bf16 models on CPUs with AVX-512 BF16
(:func:`pdflash.hybrid.native.native_unavailable_reason` says why not).
``native_mxfp4``: the same kernel on an MXFP4 store's own bytes (gpt-oss's
released experts: codes and block scales, a quarter of ``native``'s bytes,
dequantized in L1 inside the kernel; bit-identical outputs to ``native``).
``native_fp8``: the same kernel on an FP8 store's own bytes (e4m3 codes,
half ``native``'s bytes, with their per-channel scales on the accumulators).
``auto`` lets the calibration pick the fastest that fits the budget.

Batches: :meth:`HostKernel.forward_many` computes a layer's HOST experts in
one call, writing each expert's rows straight into the caller's output
buffer. For the prepared formats it is one TorchScript function
(:func:`batched_kernels`) looping over the experts: TorchScript runs without
the GIL, so the whole batch runs on the worker thread with no Python between
the GEMMs while the engine's thread keeps the GIL (a Python loop re-takes
the GIL after every op, up to the interpreter's switch interval each time
the engine's thread holds it). The scripted loop does exactly what
:meth:`HostKernel.forward` does, op for op (its Python reference; the tests
compare them bit for bit); where TorchScript is missing or fails to compile,
``forward_many`` is that Python loop.

The kernels run the GEMMs without a bias (``mm``, then the bias added in
place): torch's ``addmm`` copies the bias into the output and makes
oneDNN accumulate onto it (a ``sum`` post-op), which is a different and
no faster matmul than the bare one, and the adapters add the bias after
the product too.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from pdflash.models.store import ForeignExpertError

Weights = dict[str, torch.Tensor]

#: Host weight formats; ``auto`` (not listed) chooses among them by timing.
HOST_FORMATS: tuple[str, ...] = (
    "packed",
    "out_in",
    "in_out",
    "fp32_out_in",
    "fp32_in_out",
    "onednn",
    "native",
    "native_mxfp4",
    "native_fp8",
)


def onednn_available(dtype: torch.dtype | None = None) -> bool:
    """Whether this torch can prepack weights for oneDNN's CPU matmul (the
    ``onednn`` format), in ``dtype`` where given (bf16 and fp16 need CPU
    support that oneDNN checks)."""
    ops = torch.ops.mkldnn
    if not (
        torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    ):
        return False
    if dtype is None or dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(ops._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(ops._is_mkldnn_fp16_supported())
    return False


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

    def forward_many(
        self, x: torch.Tensor, ws: Sequence[Weights], bounds: Sequence[int], out: torch.Tensor
    ) -> None:
        """``out[bounds[j]:bounds[j + 1]] = forward(x[bounds[j]:bounds[j + 1]],
        ws[j])`` for every expert ``j`` (``x`` in :attr:`dtype`; ``out`` any
        float dtype, written in place)."""
        ...


@runtime_checkable
class DescribedHostKernel(Protocol):
    """The optional part of a :class:`HostKernel` with its own account for result rows (the
    native kernel: the ISA its last batch ran, its threads)."""

    def describe(self) -> dict[str, Any]: ...


@runtime_checkable
class ClosableHostKernel(Protocol):
    """The optional part of a :class:`HostKernel` that owns threads to join when its weights are
    released (the native kernel's team)."""

    def close(self) -> None: ...


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` contiguous in ``dtype`` — the tensor itself when it already is."""
    if t.dtype == dtype and t.is_contiguous():
        return t
    return t.to(dtype).contiguous()


#: how a prepared matrix is laid out: ``[out, in]``, ``[in, out]``, or
#: ``[out, in]`` reordered for oneDNN (an opaque tensor)
Layout = str


def _layout(fmt: str) -> Layout:
    return "onednn" if fmt == "onednn" else ("out_in" if fmt.endswith("out_in") else "in_out")


def _prepare_matrix(w_out_in: torch.Tensor, dtype: torch.dtype, layout: Layout) -> torch.Tensor:
    """One weight matrix, given ``[out, in]`` (any strides, any device), as
    ``layout`` wants it: ``[out, in]`` / ``[in, out]`` contiguous on its
    device, or reordered for oneDNN on the host (where it is used)."""
    if layout == "out_in":
        return _as(w_out_in, dtype)
    if layout == "in_out":
        return _as(w_out_in.t(), dtype)
    dense = w_out_in.to("cpu", dtype).contiguous()
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(dense)
    return packed


def _linear(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, layout: Layout
) -> torch.Tensor:
    """``x @ W^T + b`` for ``w`` in ``layout``; the bias is added in place
    after a bias-free GEMM (see the module doc), except for oneDNN's
    prepacked matmul, which takes it in the primitive (no copy, no post-op
    sum)."""
    if layout == "onednn":
        y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
        return y
    y = F.linear(x, w) if layout == "out_in" else torch.mm(x, w)
    return y if b is None else y.add_(b)


#: layouts as the scripted batches number them
_LAYOUT_CODE: dict[Layout, int] = {"out_in": 0, "in_out": 1, "onednn": 2}


def _loop_many(
    forward: Callable[[torch.Tensor, Weights], torch.Tensor],
    x: torch.Tensor,
    ws: Sequence[Weights],
    bounds: Sequence[int],
    out: torch.Tensor,
) -> None:
    """The Python reference of every ``forward_many``: one ``forward`` per
    expert, its rows copied into ``out``."""
    for j, w in enumerate(ws):
        lo, hi = int(bounds[j]), int(bounds[j + 1])
        out[lo:hi] = forward(x[lo:hi], w)


def check_forward_many(
    x: torch.Tensor, ws: Sequence[Weights], bounds: Sequence[int], out: torch.Tensor
) -> list[int]:
    """The row bounds of a ``forward_many`` call as ints, after checking that
    they split ``x``'s rows into one ascending range per expert of ``ws`` and
    that ``out`` is ``x``'s shape (every host kernel's ``forward_many``
    checks its arguments through this); ValueError otherwise."""
    b = [int(v) for v in bounds]
    if len(b) != len(ws) + 1 or (b and (b[0] != 0 or b[-1] != x.shape[0])):
        raise ValueError(f"bounds {b} do not split {x.shape[0]} rows into {len(ws)} experts")
    if any(hi < lo for lo, hi in itertools.pairwise(b)):
        raise ValueError(f"bounds {b} are not ascending")
    if out.shape != x.shape:
        raise ValueError(f"out {tuple(out.shape)} does not match x {tuple(x.shape)}")
    return b


_SCRIPTED: dict[str, Any] | None = None
_SCRIPT_ERROR: str | None = None


def batched_kernels() -> dict[str, Any] | None:
    """The scripted batch loops (``gpt_oss``, ``swiglu_silu``), compiled on
    first use; None where TorchScript is unavailable here (then
    :func:`batched_kernels_error` says why and ``forward_many`` loops in
    Python)."""
    global _SCRIPTED, _SCRIPT_ERROR
    if _SCRIPTED is None and _SCRIPT_ERROR is None:
        try:
            _SCRIPTED = _compile_batched()
        except Exception as e:  # any failure means: no scripted path
            _SCRIPT_ERROR = f"{type(e).__name__}: {e}"
    return _SCRIPTED


def batched_kernels_error() -> str | None:
    """Why :func:`batched_kernels` is None (None when it is not)."""
    batched_kernels()
    return _SCRIPT_ERROR


def _compile_batched() -> dict[str, Any]:
    import warnings

    with warnings.catch_warnings():
        # NOTE: torch marks torch.jit.script deprecated; it is still the one
        # way to run a loop of ops without the GIL from pure Python
        warnings.simplefilter("ignore")
        from pdflash.hybrid import _scripted

        return {
            "gpt_oss": torch.jit.script(_scripted.gpt_oss_many),
            "swiglu_silu": torch.jit.script(_scripted.swiglu_silu_many),
        }


class GptOssHostKernel:
    """gpt-oss's clamped SwiGLU with biases (see
    :class:`pdflash.models.adapters.gpt_oss.GptOssAdapter.expert_forward`).

    Prepared: ``w1`` = the ``[2I, H]`` matrix (in the kernel's layout) with
    the gate rows (even columns of the packed ``gate_up``) first and the up
    rows after, ``b1`` likewise; ``w2`` = ``down`` (``[H, I]`` as
    ``[out, in]``); ``b2``.
    """

    def __init__(
        self,
        alpha: float,
        limit: float,
        dense: Callable[[Weights], Weights],
        dtype: torch.dtype,
        layout: Layout,
        name: str,
    ) -> None:
        self.alpha, self.limit = float(alpha), float(limit)
        self.dense = dense
        self.dtype = dtype
        self.layout = layout
        self.name = name

    def prepare(self, views: Weights) -> Weights:
        w = self.dense(views)  # gate_up [H, 2I], down [I, H] (views for dense, new for MXFP4)
        rows, b = w["gate_up"].t(), w["gate_up_bias"]
        return {
            "w1": _prepare_matrix(torch.cat([rows[0::2], rows[1::2]]), self.dtype, self.layout),
            "b1": _as(torch.cat([b[0::2], b[1::2]]), self.dtype),
            "w2": _prepare_matrix(w["down"].t(), self.dtype, self.layout),
            "b2": _as(w["down_bias"], self.dtype),
        }

    def forward(self, x: torch.Tensor, w: Weights) -> torch.Tensor:
        h = _linear(x, w["w1"], w["b1"], self.layout)
        i = h.shape[-1] // 2
        gate, up = h[:, :i].clamp_(max=self.limit), h[:, i:]
        # (up + 1) * gate * sigmoid(alpha * gate), in one new [n, I] tensor
        glu = torch.mul(gate, self.alpha).sigmoid_().mul_(gate)
        glu.mul_(up.clamp_(min=-self.limit, max=self.limit).add_(1))
        return _linear(glu, w["w2"], w["b2"], self.layout)

    def forward_many(
        self, x: torch.Tensor, ws: Sequence[Weights], bounds: Sequence[int], out: torch.Tensor
    ) -> None:
        b = check_forward_many(x, ws, bounds, out)
        scripted = batched_kernels()
        if scripted is None or not ws:
            _loop_many(self.forward, x, ws, b, out)
            return
        scripted["gpt_oss"](
            x,
            [w["w1"] for w in ws],
            [w["b1"] for w in ws],
            [w["w2"] for w in ws],
            [w["b2"] for w in ws],
            b,
            out,
            _LAYOUT_CODE[self.layout],
            self.alpha,
            self.limit,
        )


class SwiGLUHostKernel:
    """The plain SwiGLU expert (Qwen3-MoE, Mixtral, OLMoE, ...; see
    ``SwiGLUExpertsMixin.expert_forward``): packed ``gate_up [2I, H]`` (gate
    rows first) and ``down [H, I]``, already ``[out, in]``."""

    def __init__(
        self,
        act: Callable[[torch.Tensor], torch.Tensor],
        dense: Callable[[Weights], Weights],
        dtype: torch.dtype,
        layout: Layout,
        name: str,
    ) -> None:
        self.act = act
        self.dense = dense
        self.dtype = dtype
        self.layout = layout
        self.name = name

    def prepare(self, views: Weights) -> Weights:
        w = self.dense(views)
        return {
            "w1": _prepare_matrix(w["gate_up"], self.dtype, self.layout),
            "w2": _prepare_matrix(w["down"], self.dtype, self.layout),
        }

    def forward(self, x: torch.Tensor, w: Weights) -> torch.Tensor:
        h = _linear(x, w["w1"], None, self.layout)
        i = h.shape[-1] // 2
        return _linear(self.act(h[:, :i]).mul_(h[:, i:]), w["w2"], None, self.layout)

    def forward_many(
        self, x: torch.Tensor, ws: Sequence[Weights], bounds: Sequence[int], out: torch.Tensor
    ) -> None:
        b = check_forward_many(x, ws, bounds, out)
        # NOTE: only SiLU is scripted (every shipped SwiGLU config); another
        # activation loops in Python
        scripted = batched_kernels() if self.act is F.silu else None
        if scripted is None or not ws:
            _loop_many(self.forward, x, ws, b, out)
            return
        scripted["swiglu_silu"](
            x,
            [w["w1"] for w in ws],
            [w["w2"] for w in ws],
            b,
            out,
            _LAYOUT_CODE[self.layout],
        )


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

    def forward_many(
        self, x: torch.Tensor, ws: Sequence[Weights], bounds: Sequence[int], out: torch.Tensor
    ) -> None:
        _loop_many(self.forward, x, ws, check_forward_many(x, ws, bounds, out), out)


def host_kernel_for(adapter: Any, fmt: str) -> HostKernel | None:
    """The kernel of ``fmt`` for ``adapter``'s experts, or None when the
    architecture has no prepared kernel (then only ``packed`` exists)."""
    dtype = format_dtype(fmt, adapter.store.layout.dtype)
    if fmt == "packed":
        return PackedKernel(adapter.expert_forward, dtype)
    if fmt in NATIVE_WEIGHTS:
        return _native_kernel(adapter, dtype, NATIVE_WEIGHTS[fmt])
    if fmt == "onednn" and not onednn_available(dtype):
        return None
    layout = _layout(fmt)
    dense = adapter.dense_expert_weights
    if getattr(adapter, "arch", None) == "gpt_oss" and hasattr(adapter, "_swiglu_params"):
        alpha, limit = adapter._swiglu_params()
        return GptOssHostKernel(alpha, limit, dense, dtype, layout, fmt)
    if hasattr(adapter, "_activation") and _is_swiglu(adapter):
        return SwiGLUHostKernel(adapter._activation(), dense, dtype, layout, fmt)
    return None


#: the native formats and the weights each packs (a store of that format's
#: own bytes, or bf16 values for ``native``)
NATIVE_WEIGHTS = {"native": "bf16", "native_mxfp4": "mxfp4", "native_fp8": "fp8"}


def _native_kernel(adapter: Any, dtype: torch.dtype, weights: str) -> HostKernel | None:
    from pdflash.hybrid.native import native_kernel_for, native_unavailable_reason

    if native_unavailable_reason(dtype) is not None:
        return None
    gpt_oss = getattr(adapter, "arch", None) == "gpt_oss" and hasattr(adapter, "_swiglu_params")
    if weights == "mxfp4":
        from pdflash.hybrid.native import mxfp4_scales_out_of_range

        if not gpt_oss or adapter.store.layout.format != "mxfp4":
            return None
        if mxfp4_scales_out_of_range(adapter.store) is not None:
            return None
        return native_kernel_for(adapter, arch="gpt_oss", weights="mxfp4")
    if weights == "fp8" and adapter.store.layout.format != "fp8":
        return None
    if gpt_oss:
        return native_kernel_for(adapter, arch="gpt_oss", weights=weights)
    if hasattr(adapter, "_activation") and _is_swiglu(adapter) and adapter._activation() is F.silu:
        return native_kernel_for(adapter, arch="swiglu_silu", weights=weights)
    return None


def unavailable_reason(adapter: Any, fmt: str) -> str:
    """Why :func:`host_kernel_for` gives None for ``fmt`` (a format it
    gave None for)."""
    dtype = adapter.store.layout.dtype
    if fmt == "onednn" and not onednn_available(dtype):
        return "torch has no oneDNN matmul for this dtype here"
    if fmt in NATIVE_WEIGHTS:
        from pdflash.hybrid.native import native_unavailable_reason

        why = native_unavailable_reason(dtype)
        if why is not None:
            return why
    if fmt == "native_mxfp4":
        if adapter.store.layout.format != "mxfp4":
            return "the store's experts are not MXFP4 (native_mxfp4 computes gpt-oss MXFP4 experts)"
        from pdflash.hybrid.native import mxfp4_scales_out_of_range

        why = mxfp4_scales_out_of_range(adapter.store)
        if why is not None:
            return why + ", where the native kernel's dequantization is exact"
    if fmt == "native_fp8" and adapter.store.layout.format != "fp8":
        return "the store's experts are not FP8 (native_fp8 computes expert_dtype='fp8' stores)"
    return "no kernel for this architecture"


def kernel_detail(kernel: HostKernel) -> dict[str, Any]:
    """What a row records about the kernel that ran: its name, and for the
    native kernel the ISA it ran and its threads."""
    if isinstance(kernel, DescribedHostKernel):
        return kernel.describe()
    return {"kernel": kernel.name}


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
    #: flat id -> index into ``experts`` (-1: not prepared); None: the flat
    #: id is the index (every expert of the store, in order)
    position: npt.NDArray[np.int64] | None = None

    def of(self, flat_id: int) -> Weights:
        g = int(flat_id)
        if self.position is None:
            return self.experts[g]
        i = int(self.position[g]) if 0 <= g < self.position.size else -1
        if i < 0:
            raise ForeignExpertError(
                f"expert {g} has no prepared host weights: only the {len(self.experts)} "
                "experts of this store's owned set were prepared"
            )
        return self.experts[i]


def prepared_nbytes(prepared: Weights, views: Weights) -> int:
    """Bytes of ``prepared`` not shared with the store's ``views`` (an
    opaque oneDNN tensor is always new memory)."""
    shared = {v.untyped_storage().data_ptr() for v in views.values() if v.layout == torch.strided}
    return sum(
        t.numel() * t.element_size()
        for t in prepared.values()
        if t.layout != torch.strided or t.untyped_storage().data_ptr() not in shared
    )


#: bytes of experts left after the first below which prepare_all uses no pool
THREADED_PREPARE_BYTES = 64 << 20


def prepare_all(
    kernel: HostKernel,
    views_of: Callable[[int], Weights],
    ids: Sequence[int],
    *,
    budget_bytes: int | None = None,
    device: torch.device | str | None = None,
    threads: int = 1,
) -> PreparedWeights | None:
    """Prepare experts ``ids`` (in order; index = position). Returns None,
    having dropped what it prepared, when they would exceed
    ``budget_bytes`` (checked after the first expert, before the rest).

    ``device`` (e.g. the CUDA device of a compressed store): each expert's
    packed views are copied there, prepared there (the device's dequantizer:
    bit-identical to the CPU's, many times faster) and the result copied
    back to host memory; every prepared tensor is then new memory.

    ``threads`` > 1: the experts after the first are prepared by that many
    threads (each its own CUDA stream on a CUDA ``device``; only when the
    rest takes at least :data:`THREADED_PREPARE_BYTES`), which overlaps
    one expert's copy back to the host, and the first touch of its new host
    pages, with another's; each expert's tensors are made by the same
    operations as with one thread, so they are the same."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    t0 = time.perf_counter()
    dev = None if device is None else torch.device(device)
    order = [int(g) for g in ids]
    streams = threading.local()
    main = threading.current_thread()  # prepares on the caller's stream

    def prepare_one(g: int) -> tuple[Weights, int]:
        with torch.inference_mode():  # thread-local: entered by each worker
            views = views_of(g)
            if dev is None:
                w = kernel.prepare(views)
                return w, prepared_nbytes(w, views)
            if dev.type == "cuda" and threading.current_thread() is not main:
                if not hasattr(streams, "s"):
                    streams.s = torch.cuda.Stream(device=dev)  # type: ignore[no-untyped-call]
                ctx: Any = torch.cuda.stream(streams.s)
            else:
                ctx = contextlib.nullcontext()
            with ctx:
                on_dev = kernel.prepare({k: v.to(dev) for k, v in views.items()})
                w = {k: t.to("cpu").contiguous() for k, t in on_dev.items()}
            return w, sum(t.numel() * t.element_size() for t in w.values())

    experts: list[Weights] = []
    total = 0
    if order:
        first, total = prepare_one(order[0])
        experts.append(first)
        if budget_bytes is not None and total * len(order) > budget_bytes:
            return None
    rest = order[1:]
    # a pool costs more than it saves on a few small experts
    if threads > 1 and len(rest) > 1 and total * len(rest) >= THREADED_PREPARE_BYTES:
        with concurrent.futures.ThreadPoolExecutor(
            min(threads, len(rest)), thread_name_prefix="pdflash-prepare"
        ) as pool:
            done = list(pool.map(prepare_one, rest))
    else:
        done = [prepare_one(g) for g in rest]
    for w, n in done:
        experts.append(w)
        total += n
    return PreparedWeights(kernel.name, experts, total, time.perf_counter() - t0)
