"""Choosing the host weight format and preparing a store's experts in it.

:func:`host_weights_for` returns the kernel and the prepared experts the
executor computes from. With ``fmt="auto"`` it times every candidate format
(:data:`AUTO_CANDIDATES` that the architecture has a kernel for and whose
prepared copy fits the memory budget) with the calibration itself
(:func:`pdflash.hybrid.cost.calibrate_host`) on a sample of experts large
enough (:data:`SAMPLE_BYTES`) that they are timed cold, as a forward finds
them, and keeps the one with the lowest mean seconds per expert over
:data:`SELECT_TOKEN_POINTS`. The result (format, prepared experts, every
candidate's measured time) is kept with the store, so the runs of one
process reuse it; one entry per store, so at most one prepared copy lives.
The chosen format's timed sample (its first experts, prepared as the final
copy prepares them) becomes the start of that copy: only the rest is
prepared after the choice (:attr:`HostWeights.sample_reused`). While the
later candidates are timed the best one's sample is kept, so the selection
holds at most one sample (about :data:`SAMPLE_BYTES`) beyond the one it times.

The store owns that entry: it is reused by a later request with the same
format, budget, pool workers and torch thread count (the native kernel's
team is sized by the thread count and ``auto`` timed the formats with it;
another setting prepares anew and replaces the entry), and
:func:`release_host_weights` drops it and joins the kernel's threads (the
bench calls it when it drops its cached models). :attr:`HostWeights.uses`
counts the requests it served, so a row can say whether its weights were
prepared for it or reused.
A store that packs only some experts (an expert-parallel rank's,
``ExpertStore(owned=...)``) has only those prepared and timed.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pdflash.hybrid.cost import calibrate_host
from pdflash.hybrid.executor import HostExpertExecutor
from pdflash.hybrid.kernels import (
    HOST_FORMATS,
    ClosableHostKernel,
    HostKernel,
    PreparedWeights,
    host_kernel_for,
    kernel_detail,
    prepare_all,
    prepared_nbytes,
    unavailable_reason,
)

#: formats ``auto`` times (``in_out`` in the model dtype is left out: for the
#: dense layouts it is the packed layout, for compressed ones out_in's twin;
#: ``onednn`` only where this torch has it, see
#: :func:`pdflash.hybrid.kernels.onednn_available`; ``native`` only for bf16
#: models on CPUs with AVX-512 BF16, see
#: :func:`pdflash.hybrid.native.native_unavailable_reason`; ``native_mxfp4``
#: only for gpt-oss MXFP4 stores, ``native_fp8`` only for FP8 stores)
AUTO_CANDIDATES: tuple[str, ...] = (
    "packed",
    "out_in",
    "onednn",
    "native",
    "native_mxfp4",
    "native_fp8",
    "fp32_out_in",
    "fp32_in_out",
)
#: bytes of prepared experts each candidate is timed over (cold caches)
SAMPLE_BYTES = 1 << 30
MAX_SAMPLE_EXPERTS = 64
SELECT_TOKEN_POINTS: tuple[int, ...] = (1, 4, 16)
#: a format whose outputs on the store's first packed expert differ from the
#: adapter's own function (``packed``), at each of SELECT_TOKEN_POINTS rows,
#: by more than this relative L2 norm is never used: correct formats differ
#: by rounding only (bf16 products and roundings, another summation order:
#: at most 0.008 on the tests' checkpoints, every format and architecture),
#: a kernel that the CPU or the compiler runs wrongly by far more
AGREEMENT_RTOL = 0.05
#: threads preparing a store's experts (:func:`prepare_all`'s ``threads``):
#: this many at most, and no more than the CPU has
PREPARE_MAX_THREADS = 8
#: the same where experts are prepared on a GPU (copied there, packed, copied
#: back; bench/h200/prepfast.sh times 1 thread against this, same bits)
PREPARE_MAX_DEVICE_THREADS = 8
#: default budget for prepared copies: this share of MemAvailable
DEFAULT_BUDGET_SHARE = 0.4


def mem_available_bytes() -> int | None:
    """``MemAvailable`` from /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def prepare_threads(device: torch.device | str | None = None) -> int:
    """Threads :func:`host_weights_for` prepares experts with on ``device``
    (None or CPU: prepared by the CPU; else on that device)."""
    on_cpu = device is None or torch.device(device).type == "cpu"
    cap = PREPARE_MAX_THREADS if on_cpu else PREPARE_MAX_DEVICE_THREADS
    return max(1, min(cap, os.cpu_count() or 1))


def default_weight_budget() -> int:
    """Bytes prepared host weights may take by default:
    :data:`DEFAULT_BUDGET_SHARE` of the memory available now (0 where that is
    unknown: then only formats that copy nothing are used)."""
    avail = mem_available_bytes()
    return 0 if avail is None else int(avail * DEFAULT_BUDGET_SHARE)


@dataclass
class HostWeights:
    """What the executor computes with: ``kernel.forward`` over
    ``weights_of(flat_id)``."""

    format: str
    kernel: HostKernel
    weights_of: Callable[[int], dict[str, torch.Tensor]]
    nbytes: int  # host memory of the prepared copy (0: shares the store's)
    prepare_s: float
    budget_bytes: int
    #: format -> mean seconds per expert over SELECT_TOKEN_POINTS (``auto``),
    #: or the reason a candidate was not timed
    candidates: dict[str, Any] = field(default_factory=dict)
    select_s: float | None = None
    #: experts of the copy that ``auto`` timed the format on and kept (their
    #: preparation is in ``select_s``; ``prepare_s`` covers the rest)
    sample_reused: int = 0
    #: requests this entry served (1: prepared for the first; more: reused)
    uses: int = 1

    def describe(self) -> dict[str, Any]:
        """What a row records (at the request that got these weights:
        ``reused`` says they were prepared for an earlier one, so
        ``prepare_s`` and ``format_select_s`` were not spent now)."""
        return {
            "host_format": self.format,
            "reused": self.uses > 1,
            "uses": self.uses,
            "host_kernel": kernel_detail(self.kernel),
            "prepared_nbytes": self.nbytes,
            "prepare_s": self.prepare_s,
            "weight_budget_bytes": self.budget_bytes,
            "format_candidates": self.candidates,
            "format_select_s": self.select_s,
            "sample_reused": self.sample_reused,
        }

    def close(self) -> None:
        """Join the kernel's own threads, if it has any (the native team)."""
        _close_kernel(self.kernel)


def _close_kernel(kernel: HostKernel) -> None:
    if isinstance(kernel, ClosableHostKernel):
        kernel.close()


#: the store attribute that keeps its prepared weights (an attribute, not a
#: weak-keyed table: the prepared weights refer back to the store through the
#: kernel, and a cycle through an attribute is collected with the store)
_ATTR = "_pdflash_host_weights"  # ((format, budget, workers, threads) asked, HostWeights)


def release_host_weights(store: Any) -> bool:
    """Drop the prepared weights kept with ``store`` and join their kernel's
    threads; True if there were any. A service still using them must be
    closed first."""
    hit = getattr(store, _ATTR, None)
    if hit is None:
        return False
    setattr(store, _ATTR, None)
    hit[1].close()
    return True


def _executor(
    adapter: Any,
    kernel: HostKernel,
    weights_of: Callable[[int], dict[str, torch.Tensor]],
    workers: int,
) -> HostExpertExecutor:
    return HostExpertExecutor(
        weights_of,
        kernel.forward,
        dtype=kernel.dtype,
        out_dtype=adapter.store.layout.dtype,
        expert_nbytes=adapter.store.expert_nbytes,
        workers=workers,
        batch_fn=kernel.forward_many,
    )


def prepare_device(adapter: Any, kernel: HostKernel | None = None) -> torch.device | None:
    """Where a store's experts are prepared: on the adapter's CUDA device
    when they are compressed (dequantizing there is many times faster than
    on the CPU, and bit-identical) or when ``kernel`` copies all of an
    expert anyway (a transpose or a dtype change: moving it over and back
    is faster than the CPU's strided copy); on the host when the prepared
    weights share the store's memory (nothing to copy)."""
    device = torch.device(getattr(adapter, "device", "cpu"))
    if device.type != "cuda":
        return None
    store = adapter.store
    if store.layout.format != "dense":
        return device
    if kernel is None:
        return None
    views = store.views(int(store.packed_ids()[0]))
    with torch.inference_mode():
        w = kernel.prepare(views)
    total = sum(t.numel() * t.element_size() for t in w.values())
    return device if prepared_nbytes(w, views) >= 0.99 * total else None


def _joined(first: PreparedWeights, rest: PreparedWeights) -> PreparedWeights:
    """``first``'s experts then ``rest``'s (one format, positions in order)."""
    return PreparedWeights(
        first.format,
        first.experts + rest.experts,
        first.nbytes + rest.nbytes,
        first.prepare_s + rest.prepare_s,
    )


@dataclass
class ReferenceOutputs:
    """The adapter's own expert function (the ``packed`` format) on the
    store's first packed expert, at each of SELECT_TOKEN_POINTS rows of
    random hidden states (fp32; seeded, so every format gets the same)."""

    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]

    @classmethod
    def of(cls, adapter: Any) -> ReferenceOutputs:
        store = adapter.store
        kernel = host_kernel_for(adapter, "packed")
        assert kernel is not None
        views = store.views(int(store.packed_ids()[0]))
        gen = torch.Generator().manual_seed(0)
        inputs = [
            torch.randn(n, int(adapter.hidden_size), generator=gen) for n in SELECT_TOKEN_POINTS
        ]
        with torch.inference_mode():
            outputs = [kernel.forward(x.to(kernel.dtype), views).float() for x in inputs]
        return cls(inputs, outputs)

    def disagreement(self, kernel: HostKernel, first: dict[str, torch.Tensor]) -> str | None:
        """Why ``kernel`` on ``first`` (the same expert, prepared by it) must
        not be used, or None where it agrees within AGREEMENT_RTOL."""
        with torch.inference_mode():
            for x, want in zip(self.inputs, self.outputs, strict=True):
                got = kernel.forward(x.to(kernel.dtype), first).float()
                err = float((got - want).norm() / want.norm().clamp_min(1e-30))
                if not err <= AGREEMENT_RTOL:  # NaN included
                    return (
                        f"its outputs differ from the adapter's expert function by {err:.3g} "
                        f"(relative L2, {x.shape[0]} rows; at most {AGREEMENT_RTOL} expected): "
                        "this CPU or build runs the kernel wrongly"
                    )
        return None


def _time_format(
    adapter: Any,
    kernel: HostKernel,
    dev: torch.device | None,
    workers: int,
    budget: int,
    repeats: int,
    reference: ReferenceOutputs,
) -> tuple[float, PreparedWeights] | tuple[str, None]:
    """Mean seconds per expert of ``kernel`` over a cold sample prepared on
    ``dev`` and that sample (the store's first packed experts, in order), or
    why not (its outputs disagree with ``reference``, its copy exceeds
    ``budget``)."""
    store = adapter.store
    packed = store.packed_ids()  # a rank's store holds only its own experts
    one = prepare_all(kernel, store.views, packed[:1].tolist(), device=dev)
    assert one is not None
    first = one.experts[0]
    # ``packed`` is the reference itself: nothing to compare
    wrong = None if kernel.name == "packed" else reference.disagreement(kernel, first)
    if wrong is not None:
        _close_kernel(kernel)
        return wrong, None
    per_expert = one.nbytes
    if per_expert * packed.size > budget:
        return f"prepared copy {per_expert * packed.size} B over the budget {budget} B", None
    size = sum(t.numel() * t.element_size() for t in first.values())
    k = min(packed.size, MAX_SAMPLE_EXPERTS, max(2 * workers, math.ceil(SAMPLE_BYTES / size)))
    # the sample's experts by position (0..k-1): the calibration times those;
    # the first is the one prepared above
    rest = prepare_all(
        kernel, store.views, packed[1:k].tolist(), device=dev, threads=prepare_threads(dev)
    )
    assert rest is not None
    sample = _joined(one, rest)
    try:
        with _executor(adapter, kernel, sample.of, workers) as ex:
            cost = calibrate_host(
                ex,
                num_ids=k,
                hidden_size=int(adapter.hidden_size),
                token_points=SELECT_TOKEN_POINTS,
                repeats=repeats,
                roundtrip=False,
                # formats are ranked by seconds per expert in full batches
                job_term=False,
            )
    finally:
        _close_kernel(kernel)  # the chosen format gets a kernel of its own
    mean_s = float(statistics.fmean(cost.expert_s(np.asarray(SELECT_TOKEN_POINTS)).tolist()))
    return mean_s, sample


def host_weights_for(
    adapter: Any,
    fmt: str = "auto",
    *,
    workers: int = 1,
    budget_bytes: int | None = None,
    repeats: int = 3,
) -> HostWeights:
    """The kernel and prepared experts for ``adapter``'s store in ``fmt``
    (``auto``: the fastest candidate measured here; see the module doc).
    Raises ``ValueError`` for an unknown format, one the architecture has no
    kernel for, or one whose prepared copy exceeds ``budget_bytes``."""
    if fmt != "auto" and fmt not in HOST_FORMATS:
        raise ValueError(f"unknown host format {fmt!r}; choose one of {HOST_FORMATS} or 'auto'")
    if budget_bytes is not None and budget_bytes < 0:
        raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
    store = adapter.store
    # the native team's size and what `auto` timed depend on the threads
    threads = torch.get_num_threads()
    key = (fmt, budget_bytes, workers, threads)
    hit = getattr(store, _ATTR, None)
    if hit is not None:
        # NOTE: the default budget is read from MemAvailable, which the kept
        # copy itself lowered: a repeated default request reuses the copy
        (asked, asked_budget, asked_workers, asked_threads), kept = hit
        same_pool = (asked_workers, asked_threads) == (workers, threads)
        if same_pool and (
            (asked, asked_budget) == (fmt, budget_bytes)
            or (fmt == kept.format and (budget_bytes is None or kept.nbytes <= budget_bytes))
        ):
            result: HostWeights = kept
            result.uses += 1
            return result
    release_host_weights(store)  # drop an earlier copy before making another
    budget = default_weight_budget() if budget_bytes is None else int(budget_bytes)
    candidates: dict[str, Any] = {}
    select_s = None
    chosen = fmt
    # the fastest candidate so far and its timed sample (the first minimum
    # in candidate order wins a tie)
    best: tuple[str, float, PreparedWeights] | None = None
    devices: dict[str, torch.device | None] = {}  # where each candidate was prepared
    reference = None if fmt == "packed" else ReferenceOutputs.of(adapter)
    if fmt == "auto":
        assert reference is not None
        t0 = time.perf_counter()
        for name in AUTO_CANDIDATES:
            kernel = host_kernel_for(adapter, name)
            if kernel is None:
                candidates[name] = unavailable_reason(adapter, name)
                continue
            devices[name] = None if name == "packed" else prepare_device(adapter, kernel)
            outcome = _time_format(
                adapter, kernel, devices[name], workers, budget, repeats, reference
            )
            candidates[name] = outcome[0]
            if outcome[1] is not None and (best is None or outcome[0] < best[1]):
                best = (name, outcome[0], outcome[1])
            del outcome  # a losing candidate's sample is freed before the next is timed
        chosen = best[0] if best is not None else "packed"
        select_s = time.perf_counter() - t0
    kernel = host_kernel_for(adapter, chosen)
    if kernel is None:
        raise ValueError(f"{type(adapter).__name__} has no host kernel for format {chosen!r}")
    if chosen == "packed":
        hw = HostWeights(chosen, kernel, store.views, 0, 0.0, budget, candidates, select_s)
    else:
        packed = store.packed_ids()  # a rank's store: only its own experts
        kept = best[2] if best is not None else None
        best = None
        done = 0 if kept is None else len(kept.experts)
        # the sample's per-expert size passed the budget check for all
        # experts, so the rest fits what the sample left of the budget
        on = devices[chosen] if chosen in devices else prepare_device(adapter, kernel)
        prepared = prepare_all(
            kernel,
            store.views,
            packed[done:].tolist(),
            budget_bytes=budget - (0 if kept is None else kept.nbytes),
            device=on,
            threads=prepare_threads(on),
        )
        if prepared is None:
            raise ValueError(f"host format {chosen!r}: the prepared copy exceeds {budget} bytes")
        if kept is None and reference is not None:  # asked for by name, not checked yet
            wrong = reference.disagreement(kernel, prepared.experts[0])
            if wrong is not None:
                _close_kernel(kernel)
                raise ValueError(f"host format {chosen!r}: {wrong}")
        if kept is not None:
            prepare_s = prepared.prepare_s  # the sample's preparation is in select_s
            prepared = _joined(kept, prepared)
            prepared.prepare_s = prepare_s
        if packed.size != store.num_ids:
            position = np.full(store.num_ids, -1, dtype=np.int64)
            position[packed] = np.arange(packed.size, dtype=np.int64)
            prepared.position = position
        hw = HostWeights(
            chosen,
            kernel,
            prepared.of,
            prepared.nbytes,
            prepared.prepare_s,
            budget,
            candidates,
            select_s,
            sample_reused=done,
        )
    setattr(store, _ATTR, (key, hw))
    return hw


__all__ = [
    "AUTO_CANDIDATES",
    "HostWeights",
    "PreparedWeights",
    "default_weight_budget",
    "host_weights_for",
    "mem_available_bytes",
    "release_host_weights",
]
