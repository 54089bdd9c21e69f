"""The offloaded MoE block: route, fetch the union of routed experts into the
cache, compute each distinct expert once over its tokens, scatter back.

Two execution paths compute the same thing:

* grouped (when the adapter gives a :class:`GroupedExperts` and
  ``torch.nn.functional.grouped_mm`` can read the slab): one grouped GEMM per
  projection per layer with the cache slab itself as the weight tensor, one
  group per slot (empty groups cost nothing); routing becomes slot ids
  through the cache's device slot table, the rows are ordered by slot once
  (:func:`sort_rows`: a counting sort that also gives the group offsets, or
  ``torch.sort``, fewer host dispatches, as :func:`set_row_sort` says),
  and the weighted sum over the k routed experts follows one deterministic
  un-permute (a gather). A layer whose experts are all resident runs as one
  unmasked call over the span of slots holding them, however large the
  slab. No per-expert Python.
  Compressed slabs (MXFP4, FP8): by default (``PDFLASH_COMPRESSED_GEMM=auto``)
  one Triton kernel per projection reads the slab and dequantizes in
  registers where it runs (CUDA, triton), else the used slots are gathered
  and dequantized before the GEMMs (``dequant``; either can be forced)
  (:mod:`pdflash.models.compressed_gemm`; :attr:`OffloadedMoE.compressed_gemm`
  says which runs, :attr:`OffloadedMoE.compressed_gemm_reason` why).
* loop (any ``expert_fn``): one call per distinct expert over views of its slot.

Host syncs of the grouped path (CUDA): none for a layer whose experts are all
resident (checked on the host from the cache's residency, so the routing is
never read; tested under ``torch.cuda.set_sync_debug_mode("error")``). A layer
with non-resident experts reads its routing once (one small D2H, counted on
the host), because the host must choose and submit the copies; a routed hook
that read the same routing tensor just before, in the same
:func:`shared_routing_reads` block, costs no second read
(:func:`routed_ids_on_host`). Elsewhere: the
cache reads deferred routings back once when the host needs them (counters,
an eviction choice), and an eviction waits on the event of the last kernels
that read the victim slot (:mod:`pdflash.cache.expert_cache`).

CUDA graphs (:mod:`pdflash.engine.graphs`): a forward whose every layer is
resident runs inside :meth:`OffloadedMoE.unbooked` while it is captured, so
only its kernels are recorded; :meth:`OffloadedMoE.pin_resident` and
:meth:`OffloadedMoE.book_resident` do, around each replay, the cache's books
the eager path does per layer (pins, access records, the slots' event).

Recorded resident calls (:mod:`pdflash.models.resident_graphs`, switch
``PDFLASH_RESIDENT_GRAPHS=on`` / :func:`~pdflash.models.resident_graphs.set_resident_graphs`,
off by default): an eager all-resident layer call (CUDA, no autograd, not
itself inside a capture, the layer's experts in one slab window) replays a
CUDA graph of its kernels per ``(layer, token bucket)`` over static inputs:
four torch calls (three input copies and the output's clone; two more and
a view's where the count is padded up to its bucket) and one graph launch
instead of ~28-38 torch calls, the bits of an eager run of the same
(padded) inputs. The cache's books around it are the eager path's, per
call, over the call's own routing only.

Hybrid miss service (``host_service``, :mod:`pdflash.hybrid`): right after
that one read of a layer's counts, the service picks the misses the host CPU
computes (:func:`pdflash.hybrid.block.start_host_part`); those experts get no
slot, their rows (chosen on the host from that same read) go to the host
without a sync, and the block writes the
host's rows into its output just before the weighted sum. With the
service's ``thread`` hand-off (the default) the host thread waits there for
the CPU (not for the device); with ``stream`` it only enqueues a device wait
for the job (:mod:`pdflash.hybrid.handoff`) and goes on. On the stream, only
that write and its copy wait for the host.

:class:`OffloadedMoE` runs any layer of one model given its routing;
:class:`OffloadedMoEBlock` is an ``nn.Module`` that replaces a Hugging Face
sparse MoE block (it keeps the HF router submodule, and any shared expert
and its gate, under their original names, so the checkpoint's weights load
into them; the shared expert runs resident on the device and is added to
the routed output), and :func:`install_offloaded_blocks` swaps every block
of an HF model, so a plain HF forward runs with experts offloaded. It
refuses a block holding a part it does not know (never drops one).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast, runtime_checkable

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from torch import nn

from pdflash.cache.expert_cache import CacheTooSmallError, ExpertCache
from pdflash.cache.staging import StagingRing, upload_from_ring
from pdflash.models.compressed_gemm import pick_block_m
from pdflash.models.resident_graphs import ResidentGraphs, StepFn, resident_graphs_mode
from pdflash.protocols import (
    LayerBookingCache,
    SlabCache,
    SlotTableCache,
    layer_booking,
    offers,
    slot_table,
)

if TYPE_CHECKING:
    from pdflash.hybrid.block import HostPart
    from pdflash.hybrid.service import HostExpertService
    from pdflash.models.compressed_gemm import FusedSlabMLP
    from pdflash.models.store import ExpertStore

#: ``hook(layer, topk_ids)``: called with each layer's exact routing
#: (``[T, k]`` int64, on the compute device) before its experts are fetched,
#: so a prefetcher can submit copies for later layers.
RouteHook = Callable[[int, torch.Tensor], None]
ExpertFn = Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]
#: (router logits ``[T, E]``, routing weights ``[T, k]``, expert ids ``[T, k]``)
RouteOutput = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
#: ``route_fn(router_module, x [T, H])``: an arch's routing over its router
RouteFn = Callable[[nn.Module, torch.Tensor], RouteOutput]

#: torch's grouped GEMM takes fewer than 1024 groups per call; larger slabs
#: are split into calls of at most this many slots.
MAX_GROUPS_PER_CALL = 1023

_grouped_mm: Any = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``a [n, K]`` rows grouped by ``offs`` (int32 cumulative ends) times
    ``b [G, K, N]`` -> ``[n, N]`` (torch's grouped GEMM)."""
    if _grouped_mm is None:
        raise RuntimeError("this torch has no grouped_mm")
    out: torch.Tensor = _grouped_mm(a, b, offs=offs)
    return out


class GroupedExperts(Protocol):
    """An architecture's expert MLP over many experts at once.

    ``weights(views)`` turns packed ``[G, ...]`` component views (slab views,
    or a gathered subset) into the compute weights the MLP reads (identity
    for dense layouts; a dequantization for compressed ones). ``compressed``
    says the layout is compressed: the block then gathers the routed slots
    first and dequantizes only those. ``forward(x, w, offs, group_of_row)``:
    ``x [n, H]`` rows sorted by group, ``offs [G]`` int32 cumulative row
    ends, ``group_of_row [n]`` each row's group (for per-expert biases) ->
    ``[n, H]``. An MLP that never reads ``group_of_row`` may say so with an
    attribute ``uses_row_groups = False``: it then gets the rows' groups in
    row order, not sorted order (no kernel spent sorting them). Optionally,
    it is a :class:`FusableGroupedExperts`: while its ``fused`` is not None,
    that MLP's ``forward_slab`` runs instead, over the compressed slab in
    place (no gather, no dequantized copy).
    """

    compressed: bool

    def weights(self, views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def forward(
        self,
        x: torch.Tensor,
        w: dict[str, torch.Tensor],
        offs: torch.Tensor,
        group_of_row: torch.Tensor,
    ) -> torch.Tensor: ...


@runtime_checkable
class FusableGroupedExperts(Protocol):
    """A :class:`GroupedExperts` that may run as fused dequantize-GEMM
    launches over the compressed slab
    (:class:`pdflash.models.adapters.base.SlabExperts`). ``fused`` may be
    switched (None: the dequant path) between forwards; the block reads it
    at each call."""

    fused: FusedSlabMLP | None


_GMM_WORKS: dict[tuple[str, torch.dtype], bool] = {}


def grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch's grouped GEMM runs on ``device`` in ``dtype`` (CPU
    support and dtypes differ between torch versions): one tiny call, cached."""
    key = (device.type, dtype)
    if key not in _GMM_WORKS:
        ok = _grouped_mm is not None
        if ok:
            try:
                a = torch.ones((4, 8), dtype=dtype, device=device)
                b = torch.ones((2, 8, 8), dtype=dtype, device=device)
                offs = torch.tensor([2, 4], dtype=torch.int32, device=device)
                out = grouped_mm(a, b, offs)
                ok = bool(torch.equal(out, torch.full_like(out, 8)))
            except (RuntimeError, NotImplementedError):
                ok = False
        _GMM_WORKS[key] = ok
    return _GMM_WORKS[key]


def grouped_mm_capturable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's grouped GEMM on ``device`` in ``dtype`` can be recorded
    in a CUDA graph. On CUDA only bf16 has a native kernel; other dtypes run
    torch's fallback, a per-group loop that reads the offsets on the host (a
    device-to-host copy, which a capture refuses). CPU: no capture, True."""
    return device.type != "cuda" or dtype == torch.bfloat16


def _gmm_readable(t: torch.Tensor) -> bool:
    """torch's grouped GEMM needs 16-byte aligned data and strides."""
    size = t.element_size()
    if t.data_ptr() % 16:
        return False
    return all(st == 1 or (st * size) % 16 == 0 for st in t.stride())


class _HostRouting:
    """One routing tensor's host copy, kept while that tensor is the last
    one read in a :func:`shared_routing_reads` block."""

    __slots__ = ("host", "tensor", "version")

    def __init__(self, tensor: torch.Tensor, version: int, host: npt.NDArray[np.int64]) -> None:
        self.tensor = tensor
        self.version = version
        self.host = host


class _RoutingReads(threading.local):
    """This thread's :func:`shared_routing_reads` nesting and its memo."""

    def __init__(self) -> None:
        self.depth = 0
        self.last: _HostRouting | None = None


_ROUTING_READS = _RoutingReads()


@contextmanager
def shared_routing_reads() -> Iterator[None]:
    """Within this block (on this thread) the readers of one routing tensor
    share one device read through :func:`routed_ids_on_host`; nested blocks
    join the outermost, whose exit drops the kept copy.

    The block must span one layer's readers only (the runner opens it around
    a layer's routed hooks and MoE block): a CUDA graph replay rewrites its
    static outputs in place without bumping their version counter, so a copy
    kept across a replay could be stale; none is kept outside a block."""
    state = _ROUTING_READS
    state.depth += 1
    try:
        yield
    finally:
        state.depth -= 1
        if state.depth == 0:
            state.last = None


def routed_ids_on_host(topk_ids: torch.Tensor) -> npt.NDArray[np.int64]:
    """``topk_ids`` (a layer's routing, any shape, integer) flattened on the
    host as a read-only int64 array.

    A layer's routing is needed on the host by more than one reader (a routed
    hook such as the streaming prefetcher, then the offloaded block choosing
    its copies); each read of a device tensor is a host sync. Inside a
    :func:`shared_routing_reads` block the last tensor read is kept with its
    host copy: a second call with that very tensor object, unmodified since
    (same version counter), returns the same array without reading the
    device again. Holding the tensor keeps its identity from being reused by
    another tensor; an in-place change bumps its version and is read anew; a
    tensor without a version counter (an inference-mode tensor) is read every
    time. Outside a block every call reads the device (an in-place write that
    bumps no version, such as a graph replay's, cannot be seen)."""
    try:
        version = int(topk_ids._version)
    except RuntimeError:  # inference tensors track no version
        version = -1
    state = _ROUTING_READS
    memo = state.last
    if memo is not None and version >= 0 and memo.tensor is topk_ids and memo.version == version:
        return memo.host
    # a copy: never a view of a CPU tensor's memory
    host = np.array(topk_ids.detach().reshape(-1).cpu().numpy(), dtype=np.int64, copy=True)
    host.flags.writeable = False
    keep = state.depth > 0 and version >= 0
    state.last = _HostRouting(topk_ids, version, host) if keep else None
    return host


@runtime_checkable
class OffloadedAdapter(Protocol):
    """An adapter whose MoE layers may run offloaded
    (:class:`pdflash.models.MoEAdapterBase`): ``runtime`` is the
    :class:`OffloadedMoE` its blocks run while a cache is attached, None
    otherwise (it changes with ``attach_cache`` / ``detach_cache``, so
    read it where it is used)."""

    runtime: OffloadedMoE | None


def _room(cache: ExpertCache, layer: int) -> int:
    """Slots a layer may pin now (> 0). When every slot is pinned or still
    being filled by a copy, wait for in-flight copies to land (they settle or
    free their slots) instead of failing; only a cache whose every slot is
    pinned with nothing in flight is too small."""
    room = cache.free_capacity()
    if room <= 0:
        room = cache.wait_for_capacity()
    if room <= 0:
        raise CacheTooSmallError(
            f"layer {layer}: no expert slot is free or evictable "
            f"({cache.num_slots} slots, all pinned with no copy in flight)"
        )
    return int(room)


class OffloadedMoE:
    """Offloaded expert execution for every MoE layer of one model.

    Args:
        store: the packed host experts (gives the layout for slot views).
        cache: the device expert cache (its slots are filled from ``store``).
        expert_fn: ``(x [n, H], weights) -> [n, H]``, one expert's MLP over
            views of its packed tensors (the adapter's ``expert_forward``).
    """

    def __init__(
        self,
        store: ExpertStore,
        cache: ExpertCache,
        expert_fn: ExpertFn,
        grouped: GroupedExperts | None = None,
    ) -> None:
        if cache.expert_nbytes != store.expert_nbytes:
            raise ValueError(
                f"cache slots are {cache.expert_nbytes} bytes but the store packs "
                f"{store.expert_nbytes} bytes per expert"
            )
        self.store = store
        #: the cache's optional capabilities (typed once, see :attr:`cache`)
        self._layer_books: LayerBookingCache | None = None
        self._slot_table: SlotTableCache | None = None
        self.cache = cache
        self.expert_fn = expert_fn
        self.num_experts = store.num_experts
        self.route_hooks: list[RouteHook] = []
        #: the hybrid miss service (:mod:`pdflash.hybrid`): when set, the
        #: host CPU computes the layer's misses it chooses (None: every miss
        #: is copied)
        self.host_service: HostExpertService | None = None
        #: perf_counter seconds the current layer's routing read began
        self._routing_began = 0.0
        # NOTE: views per slot are built once; a slot's bytes change, its views do not.
        self._slot_views = [
            store.layout.views(cache.slot_tensor(s)) for s in range(cache.num_slots)
        ]
        self._slab_views: dict[str, torch.Tensor] = {}
        #: inside :meth:`unbooked`: resident layers run their kernels only
        self._unbooked = False
        self._window_cache: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self._key_tables: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}
        #: CUDA: page-locked staging of :meth:`_phase_rows`' uploads, per shape
        self._row_rings: dict[tuple[int, ...], StagingRing] = {}
        self._fusable: FusableGroupedExperts | None = None
        #: recorded all-resident layer calls (:mod:`pdflash.models.resident_graphs`)
        self.resident_graphs = ResidentGraphs()
        self.grouped = None
        self._gmm_capturable = True
        if grouped is not None and _grouped_mm is not None and offers(cache, SlabCache):
            slab = cast(SlabCache, cache).slab
            if isinstance(slab, torch.Tensor) and grouped_mm_works(slab.device, store.layout.dtype):
                views = store.layout.slab_views(slab)
                if grouped.compressed or all(_gmm_readable(v) for v in views.values()):
                    self._slab_views = views
                    self.grouped = grouped
                    self._gmm_capturable = grouped_mm_capturable(slab.device, store.layout.dtype)

    @property
    def cache(self) -> ExpertCache:
        """The device expert cache. Setting it (the engine wraps it in a
        stall timer) checks its optional capabilities once: whether it books
        every layer in one call (:class:`~pdflash.protocols.LayerBookingCache`)
        and has a readable host slot table
        (:class:`~pdflash.protocols.SlotTableCache`)."""
        return self._cache

    @cache.setter
    def cache(self, cache: ExpertCache) -> None:
        self._cache = cache
        recorded = getattr(self, "resident_graphs", None)
        if recorded is not None:  # recordings read the slot keys of the cache they saw
            recorded.clear()
        self._layer_books = layer_booking(cache)
        self._slot_table = slot_table(cache)

    @property
    def grouped(self) -> GroupedExperts | None:
        """The grouped expert MLP (None: the loop path). Setting it checks
        once whether it may run fused
        (:class:`FusableGroupedExperts`)."""
        return self._grouped

    @grouped.setter
    def grouped(self, grouped: GroupedExperts | None) -> None:
        self._grouped = grouped
        self._fusable = grouped if isinstance(grouped, FusableGroupedExperts) else None

    def _fused(self) -> FusedSlabMLP | None:
        """The grouped MLP's fused slab MLP now, or None."""
        return None if self._fusable is None else self._fusable.fused

    @property
    def path(self) -> str:
        """``grouped`` or ``loop`` (see the module docstring)."""
        return "grouped" if self.grouped is not None else "loop"

    @property
    def compressed_gemm(self) -> str | None:
        """How the grouped path multiplies by a compressed slab: ``fused``
        (dequantized inside the GEMM kernel), ``dequant`` (dequantized first,
        then grouped_mm), or None (dense slab, or the loop path)."""
        if self.grouped is None or not self.grouped.compressed:
            return None
        return "fused" if self._fused() is not None else "dequant"

    @property
    def compressed_gemm_reason(self) -> str | None:
        """Why :attr:`compressed_gemm` is what it is (the setting and how it
        resolved on this device), or None where that is None."""
        if self.compressed_gemm is None:
            return None
        return getattr(self.grouped, "gemm_reason", None)

    # -- CUDA-graph seam -------------------------------------------------------

    def graph_blocker(self) -> str | None:
        """Why the block's work cannot be recorded once and replayed now
        (names the reason), or None: the grouped path with a capturable
        GEMM (:func:`grouped_mm_capturable`), no route hooks, no host
        service running (one switched off by the PD controller computes
        nothing), every layer resident (so no layer reads its routing on the
        host)."""
        if self.grouped is None:
            return "moe_loop_path"
        if self.route_hooks:
            return "moe_route_hooks"
        if self.host_service is not None and self.host_service.enabled:
            return "host_experts"
        cache = self.cache
        books = self._layer_books
        resident = (
            books.all_resident()
            if books is not None
            else all(cache.layer_resident(layer) for layer in range(cache.num_layers))
        )
        if not resident:
            return "experts_not_resident"
        if not self._gmm_capturable and self._fused() is None:
            return "grouped_mm_fallback"
        return None

    @contextmanager
    def unbooked(self) -> Iterator[None]:
        """Within: an all-resident layer launches its kernels and touches no
        cache state (no pins, no access record, no event), which is what a
        graph capture (and its warm-up) must record; any other layer raises.
        The caller books each replay with :meth:`pin_resident` and
        :meth:`book_resident`."""
        before = self._unbooked
        self._unbooked = True
        try:
            yield
        finally:
            self._unbooked = before

    def pin_resident(self) -> list[npt.NDArray[np.int64]]:
        """Before a replay: pin every layer (all resident, see
        :meth:`graph_blocker`) as the eager path does per layer, and make the
        stream wait for copies still in flight (no host sync). Returns each
        layer's pinned ids (for :meth:`book_resident` or :meth:`abort_pins`).
        Raises with nothing pinned if a layer is not resident."""
        cache = self.cache
        books = self._layer_books
        if books is not None:  # every layer in one pass (raises with nothing pinned)
            per_layer, tickets_all = books.pin_layers_joined(range(cache.num_layers))
            if (tickets_all >= 0).any():
                try:
                    cache.wait_ready(tickets_all)
                except BaseException:
                    self.abort_pins(per_layer)
                    raise
            return list(per_layer)
        pinned: list[npt.NDArray[np.int64]] = []
        try:
            for layer in range(cache.num_layers):
                ids, tickets = cache.pin_layer(layer)
                pinned.append(ids)
                if (tickets >= 0).any():
                    cache.wait_ready(tickets)
        except BaseException:
            self.abort_pins(pinned)
            raise
        return pinned

    def unpin_resident(self) -> None:
        """Undo :meth:`pin_resident` when no step ran (no access to record)."""
        if self._layer_books is not None:
            self._layer_books.unpin_layers(range(self.cache.num_layers))
            return
        for layer in range(self.cache.num_layers):
            self.cache.unpin_layer(layer)

    def abort_pins(self, pinned: Sequence[npt.NDArray[np.int64]]) -> None:
        """Undo :meth:`pin_resident` after a failure (as the eager layer's
        abort: copies not yet landed are dropped)."""
        for ids in pinned:
            self.cache.abort(ids)

    def book_resident(self, topk_ids: Sequence[torch.Tensor] | torch.Tensor) -> None:
        """After a replay: each layer's routing (``[T, k]`` device ids of the
        real rows, owned by the caller; or all of them as one ``[layers, T,
        k]`` tensor) recorded as a deferred access, and the layer unpinned
        (one event guards its slots), as the eager path. A
        :class:`~pdflash.protocols.LayerBookingCache` books every layer in
        one call of each."""
        cache = self.cache
        if len(topk_ids) != cache.num_layers:
            raise ValueError(f"{len(topk_ids)} routings for {cache.num_layers} layers")
        books = self._layer_books
        if isinstance(topk_ids, torch.Tensor) and books is not None:
            books.defer_accesses(range(cache.num_layers), topk_ids.long())
            books.unpin_layers(range(cache.num_layers))
            return
        for layer, ids in enumerate(topk_ids):
            cache.defer_access(layer, ids.reshape(-1).long())
            if books is None:
                cache.unpin_layer(layer)
        if books is not None:  # one pass, one slot event for every layer
            books.unpin_layers(range(cache.num_layers))

    def add_route_hook(self, hook: RouteHook) -> Callable[[], None]:
        """Register ``hook(layer, topk_ids)``; returns a function that removes it."""
        self.route_hooks.append(hook)

        def remove() -> None:
            if hook in self.route_hooks:
                self.route_hooks.remove(hook)

        return remove

    def forward_routed(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """The MoE output ``[T, H]`` of ``x [T, H]`` under the given routing."""
        # the routing read's start on the forward thread (a routed hook may
        # read it first), for the host service's clock
        self._routing_began = time.perf_counter()
        if not self.route_hooks:  # this block is the routing's only reader
            return self._forward_block(layer, x, topk_ids, topk_weights)
        # the route hooks and this block read the one routing: one device read
        with shared_routing_reads():
            for hook in self.route_hooks:
                hook(layer, topk_ids)
            return self._forward_block(layer, x, topk_ids, topk_weights)

    def _forward_block(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        if topk_ids.shape[0] == 0:
            return torch.zeros_like(x)
        if self.grouped is not None:
            return self._forward_grouped(layer, x, topk_ids, topk_weights)
        return self._forward_loop(layer, x, topk_ids, topk_weights)

    def _forward_loop(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        num_tokens, k = topk_ids.shape
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        # the one host sync: routing decides the copies
        flat_host, counts_host = self._routing_on_host(topk_ids)
        routed = (self._routing_began, time.perf_counter())
        experts = np.flatnonzero(counts_host)
        # NOTE: per-expert work is kept to the expert's own MLP: the tokens are
        # gathered in expert order once and split into one view per expert,
        # the outputs are concatenated once, and the routing weights and the
        # scatter back to tokens are applied once per layer, not per expert.
        # Each token's k rows are distinct, so the un-permute is a plain
        # (deterministic) indexed write; the k-way weighted sum is one
        # reduction in the routing weights' precision, rounded to x's dtype once.
        x_parts = torch.split(x[order // k], counts_host[experts].tolist())
        y_parts: list[torch.Tensor | None] = [None] * int(experts.size)
        host_part = self._start_host_part(layer, x, flat_host, k, experts, counts_host, routed)
        todo = np.arange(experts.size)  # positions in `experts` computed here
        if host_part is not None:
            todo = np.flatnonzero(~host_part.mask)
            for p in np.flatnonzero(host_part.mask).tolist():
                # NOTE: a placeholder of the right shape (no allocation); the
                # host's rows overwrite these rows below
                y_parts[p] = x_parts[p]
        try:
            self._compute_on_device(layer, experts, todo, x_parts, y_parts)
        except BaseException:
            if host_part is not None:
                host_part.cancel()
            raise
        y_sorted = torch.cat(y_parts)  # type: ignore[arg-type]  # every entry set above
        y = torch.empty_like(y_sorted)
        y[order] = y_sorted
        if host_part is not None:
            host_part.write_into(y)
        weighted = y.view(num_tokens, k, -1) * topk_weights.unsqueeze(-1)
        return weighted.sum(dim=1).to(x.dtype)

    def _start_host_part(
        self,
        layer: int,
        x: torch.Tensor,
        flat_host: npt.NDArray[np.int64],
        k: int,
        experts: np.ndarray,
        counts_host: np.ndarray,
        routed: tuple[float, float] | None = None,
    ) -> HostPart | None:
        """The hybrid hook: start the host on the misses the service picks
        (``routed``: the span of the layer's routing read). The HOST rows are
        chosen from ``flat_host``, the routing :meth:`_routing_on_host` read
        (no second read)."""
        if self.host_service is None:
            return None
        from pdflash.hybrid.block import start_host_part

        return start_host_part(
            self.host_service,
            self.cache,
            layer,
            x,
            flat_host,
            k,
            experts,
            counts_host,
            routed=routed,
        )

    def _compute_on_device(
        self,
        layer: int,
        experts: np.ndarray,
        todo: np.ndarray,
        x_parts: Sequence[torch.Tensor],
        y_parts: list[torch.Tensor | None],
    ) -> None:
        """Pin/copy/compute ``experts[todo]`` from the cache, into ``y_parts``."""
        base = layer * self.num_experts
        cache = self.cache
        i = 0
        while i < todo.size:
            room = _room(cache, layer)
            pos = todo[i : i + room]
            flat_ids = base + experts[pos]
            slots, tickets = cache.acquire(flat_ids)
            # NOTE: ready experts first, then the missing ones in submission
            # order, each waited on just before use: copy j+1 overlaps compute j.
            # A ready expert (ticket -1) needs no wait call at all.
            schedule = np.argsort(tickets, kind="stable").tolist()
            slot_list, ticket_list, pos_list = slots.tolist(), tickets.tolist(), pos.tolist()
            try:
                for j in schedule:
                    if ticket_list[j] >= 0:
                        cache.wait_ready(tickets[j : j + 1])
                    p = pos_list[j]
                    y_parts[p] = self.expert_fn(x_parts[p], self._slot_views[slot_list[j]])
            except BaseException:
                cache.abort(flat_ids)
                raise
            cache.release(flat_ids)
            i += pos.size

    # -- grouped path ------------------------------------------------------------

    def _forward_grouped(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        k = topk_ids.shape[1]
        flat = topk_ids.reshape(-1)
        if flat.dtype != torch.int64:  # NOTE: each skipped no-op call is a dispatch saved
            flat = flat.long()
        cache = self.cache
        if self._unbooked:
            if not cache.layer_resident(layer):
                raise RuntimeError(f"layer {layer} is not resident: it cannot run unbooked")
            return self._resident_output(layer, x, k, flat, topk_weights)
        if cache.layer_resident(layer):
            # Every expert of the layer holds a slot: nothing to copy whatever
            # the routing, so the host never reads it (no sync). The layer's
            # experts are pinned (without counting) so no eviction reuses a
            # slot the kernels below read; the routing is handed to the cache
            # as a device tensor and counted when the host next needs it.
            ids, tickets = cache.pin_layer(layer)
            try:
                if (tickets >= 0).any():  # copies still in flight (e.g. prefetched)
                    cache.wait_ready(tickets)  # CUDA: the stream waits, no host sync
                cache.defer_access(layer, flat)
                # a replay of the layer's recorded kernels where it can (the
                # books above and below stay per call), else eagerly
                out = self._resident_replay(layer, x, flat, topk_weights)
                if out is None:
                    out = self._resident_output(layer, x, k, flat, topk_weights)
            except BaseException:
                cache.abort(ids)
                raise
            cache.unpin_layer(layer)
            return out
        y_flat = torch.empty((flat.numel(), x.shape[1]), dtype=x.dtype, device=x.device)
        self._grouped_with_misses(layer, x, k, flat, y_flat, topk_ids)
        return self._weighted_sum(y_flat, topk_weights, x.dtype)

    def _weighted_sum(
        self, y_flat: torch.Tensor, topk_weights: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """Each token's ``k`` rows of ``y_flat`` (in routed-row order)
        weighted and summed: one reduction in the routing weights'
        precision, rounded to ``dtype`` once (each token's rows are distinct
        experts). With a fused MLP, its kernels' one-launch combine (the
        same sum in a fixed order, as :meth:`_planned`'s, so every path of
        the block gives the same bits)."""
        fused = self._fused()
        if fused is not None:
            out: torch.Tensor = fused.k.weighted_combine(y_flat, topk_weights, dtype)
            return out
        tokens, k = topk_weights.shape
        out = (y_flat.view(tokens, k, -1) * topk_weights.unsqueeze(-1)).sum(dim=1)
        return out if out.dtype == dtype else out.to(dtype)

    def _planned(
        self,
        x: torch.Tensor,
        k: int,
        flat: torch.Tensor,
        keys: torch.Tensor,
        width: int,
        views: dict[str, torch.Tensor],
        topk_weights: torch.Tensor,
    ) -> torch.Tensor | None:
        """An all-resident call of the fused MLP in four launches: the rows'
        plan (slot keys, stable order, tiles: the kernels' ``row_plan``),
        the two GEMMs and the weighted combine, in place of the sort,
        tile-map, gather, multiply and sum kernels of :meth:`_run_sorted`
        (the same rows, tiles and sums). ``keys``: the layer's ``[E]`` slot
        keys in ``views``. None where it does not apply: no fused MLP, the
        row sort (:func:`set_row_sort`) not ``plan_atomic`` or ``plan``, or
        more rows or keys than that plan takes."""
        fused = self._fused()
        n = int(flat.numel())
        mode = row_sort_mode()
        ordered = mode == "plan"
        if fused is None or mode not in _PLAN_MODES:
            return None
        if not fused.k.row_plan_fits(n, width, ordered=ordered):
            return None
        block_m = pick_block_m(n, self.num_experts)
        plan = fused.k.row_plan(flat, keys, width, k, block_m, self.num_experts, ordered=ordered)
        out = fused.forward_slab(x, plan.token, None, width, views, self.num_experts, plan=plan)
        combined: torch.Tensor = fused.k.weighted_combine(out, topk_weights, x.dtype, plan.position)
        return combined

    def resident_graph_blocker(self, layer: int, x: torch.Tensor, tokens: int) -> str | None:
        """Why an all-resident call of ``layer`` over ``x`` (``tokens`` rows)
        runs eagerly rather than from a recording
        (:mod:`pdflash.models.resident_graphs`), or None: the switch is on,
        the call is not itself being recorded (inside :meth:`unbooked` or a
        capture), autograd is off, the recorder runs on ``x``'s device, the grouped GEMM can
        be recorded, ``tokens`` is within the bound and the layer's experts
        sit in one window of the slab (:meth:`_resident_window`)."""
        plan = self._resident_graph_plan(layer, x, tokens)
        return plan if isinstance(plan, str) else None

    def _resident_graph_plan(
        self, layer: int, x: torch.Tensor, tokens: int
    ) -> str | tuple[int, int]:
        """:meth:`resident_graph_blocker`'s reason, or the layer's window."""
        graphs = self.resident_graphs
        if resident_graphs_mode() == "off":
            return "off"
        if self._unbooked:
            return "unbooked"
        if torch.is_grad_enabled():  # a replay records no autograd history
            return "grad_enabled"
        blocker = graphs.backend_blocker(x.device)
        if blocker is not None:
            return blocker
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return "capturing"
        if not self._gmm_capturable and self._fused() is None:
            return "grouped_mm_fallback"
        if tokens > graphs.max_tokens:
            return "tokens_over_max"
        window = self._resident_window(layer)
        return "no_resident_window" if window is None else window

    def _resident_replay(
        self, layer: int, x: torch.Tensor, flat: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor | None:
        """The call's output from a replay of the layer's recorded kernels
        (:class:`~pdflash.models.resident_graphs.ResidentGraphs`; the same
        kernels as :meth:`_resident_output`, so the same
        bits), or None where it runs eagerly (the reason noted there)."""
        graphs = self.resident_graphs
        tokens, k = topk_weights.shape
        plan = self._resident_graph_plan(layer, x, tokens)
        if isinstance(plan, str):
            graphs.eager(plan)
            return None
        lo, width = plan
        assert self._slot_table is not None  # a window was read from it
        base = layer * self.num_experts
        slots = self._slot_table.slot_of[base : base + self.num_experts]
        grouped, fused = self.grouped, self._fused()
        # static buffers made under inference mode take no in-place write outside it
        inference = torch.is_inference_mode_enabled()
        # the recording runs over the padded count (its padding rows routed to
        # the call's own first token's experts with zero weight; dropped)
        padded = graphs.padded_tokens(tokens)
        shape = (padded, *x.shape[1:])
        sig = (shape, x.dtype, topk_weights.dtype, str(x.device), k, inference)
        key = (layer, *sig, row_sort_mode(), id(grouped), id(fused))

        def make_fn() -> tuple[StepFn, tuple[Any, ...]]:
            keys = self._layer_keys(layer, lo)
            views = self._window_views(lo, width)

            def step(
                xs: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
            ) -> tuple[torch.Tensor, ...]:
                out = self._planned(xs, k, ids, keys, width, views, weights)
                if out is None:
                    y_flat = torch.empty(
                        (ids.numel(), xs.shape[1]), dtype=xs.dtype, device=xs.device
                    )
                    self._run_sorted(xs, k, keys[ids], width, views, y_flat)
                    out = self._weighted_sum(y_flat, weights, xs.dtype)
                return (out,)

            # the recording reads these (and the MLP objects its key names)
            return step, (keys, views, grouped, fused)

        return graphs.run(key, sig, slots, x, flat, topk_weights, make_fn, padded)

    def close(self) -> None:
        """Free the recorded resident calls (their pools and buffers)."""
        self.resident_graphs.close()

    def _resident_output(
        self, layer: int, x: torch.Tensor, k: int, flat: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """An all-resident layer's output, eagerly: over the span of slots
        holding the layer's experts when it fits (:meth:`_resident_window`),
        the fused MLP's planned call (:meth:`_planned`) where it applies,
        else one unmasked call over the span; otherwise one call over the
        whole slab; the routed rows then weighted and summed."""
        window = self._resident_window(layer)
        if window is None:
            y_flat = torch.empty((flat.numel(), x.shape[1]), dtype=x.dtype, device=x.device)
            self._grouped_rows(x, k, self._layer_slots(layer)[flat], None, y_flat)
            return self._weighted_sum(y_flat, topk_weights, x.dtype)
        lo, width = window
        views = self._window_views(lo, width)
        keys = self._layer_keys(layer, lo)
        out = self._planned(x, k, flat, keys, width, views, topk_weights)
        if out is not None:
            return out
        y_flat = torch.empty((flat.numel(), x.shape[1]), dtype=x.dtype, device=x.device)
        self._run_sorted(x, k, keys[flat], width, views, y_flat)
        return self._weighted_sum(y_flat, topk_weights, x.dtype)

    def _layer_keys(self, layer: int, lo: int) -> torch.Tensor:
        """``[E]`` device tensor: each of the layer's experts' slot minus
        ``lo``, kept while the cache's device slot table is the same tensor
        (it is replaced whenever a slot changes). Not kept when made inside a
        CUDA-graph capture (whose kernels do not run then)."""
        table = self.cache.device_slot_table()
        base = layer * self.num_experts
        held = self._key_tables.get(layer)
        if held is not None and held[0] is table and held[1] == lo:
            return held[2]
        keys = table[base : base + self.num_experts] - lo
        if not (table.is_cuda and torch.cuda.is_current_stream_capturing()):
            self._key_tables[layer] = (table, lo, keys)
        return keys

    def _layer_slots(self, layer: int) -> torch.Tensor:
        """``[E]`` device tensor: each of the layer's experts' slot (or -1)."""
        base = layer * self.num_experts
        return self.cache.device_slot_table()[base : base + self.num_experts]

    def _grouped_with_misses(
        self,
        layer: int,
        x: torch.Tensor,
        k: int,
        flat: torch.Tensor,
        y_flat: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> None:
        flat_host, counts_host = self._routing_on_host(topk_ids)
        routed = (self._routing_began, time.perf_counter())
        experts = np.flatnonzero(counts_host)
        host_part = self._start_host_part(layer, x, flat_host, k, experts, counts_host, routed)
        if host_part is not None:
            # NOTE: HOST experts get no slot, so their rows map to slot -1 in
            # the device slot table and every grouped call below skips them
            experts = experts[~host_part.mask]
        try:
            self._grouped_misses_on_device(
                layer,
                x,
                k,
                flat,
                y_flat,
                experts,
                partial=host_part is not None,
                flat_host=flat_host,
            )
        except BaseException:
            if host_part is not None:
                host_part.cancel()
            raise
        if host_part is not None:
            host_part.write_into(y_flat)

    def _routing_on_host(
        self, topk_ids: torch.Tensor
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """The layer's routing on the host, ``(ids [T * k], per-expert
        counts)`` (the ids also choose the rows of a HOST part). NOTE: the
        one host sync of a layer with non-resident experts: the host must
        learn the routed set to choose (and submit) the copies. The routing
        is read through :func:`routed_ids_on_host`, so a routed hook that
        read this layer's routing already (the streaming prefetcher) costs
        no second sync, and the counting is a host bincount (no device
        kernels)."""
        ids = routed_ids_on_host(topk_ids)
        counts: npt.NDArray[np.int64] = np.bincount(ids, minlength=self.num_experts).astype(
            np.int64, copy=False
        )
        return ids, counts

    def _grouped_misses_on_device(
        self,
        layer: int,
        x: torch.Tensor,
        k: int,
        flat: torch.Tensor,
        y_flat: torch.Tensor,
        experts: npt.NDArray[np.int64],
        *,
        partial: bool = False,
        flat_host: npt.NDArray[np.int64] | None = None,
    ) -> None:
        """Pin/copy/compute ``experts`` from the cache into their rows of
        ``y_flat``; ``partial``: other routed experts (HOST) hold no slot, so
        every grouped call must select its rows (an unmasked call assumes
        every row's expert has a slot). ``flat_host``: ``flat`` on the host
        when already read (else read here, once, if a group needs it)."""
        cache = self.cache
        base = layer * self.num_experts
        i = 0
        while i < experts.size:
            room = _room(cache, layer)
            group = experts[i : i + room]
            flat_ids = base + group
            _, tickets = cache.acquire(flat_ids)
            try:
                # the ready experts' rows first; the misses' copies land meanwhile
                ready = tickets < 0
                phase_rows: torch.Tensor | None = None  # one upload serves both phases
                # the slot table holds still while the group is pinned: one gather
                row_slot: torch.Tensor | None = None
                for phase, waits in ((ready, False), (~ready, True)):
                    if not phase.any():
                        continue
                    if waits:
                        cache.wait_ready(tickets[phase])
                    whole = not partial and group.size == experts.size and bool(phase.all())
                    row_in = None
                    if not whole:
                        if phase_rows is None:
                            if flat_host is None:
                                flat_host = routed_ids_on_host(flat)
                            phase_rows = self._phase_rows(flat_host, group, ready, flat.device)
                        row_in = phase_rows[int(waits)]
                    if row_slot is None:
                        row_slot = self._layer_slots(layer)[flat]
                    self._grouped_rows(x, k, row_slot, row_in, y_flat)
            except BaseException:
                cache.abort(flat_ids)
                raise
            cache.release(flat_ids)
            i += group.size

    def _phase_rows(
        self,
        flat_host: npt.NDArray[np.int64],
        group: npt.NDArray[np.int64],
        ready: npt.NDArray[np.bool_],
        device: torch.device,
    ) -> torch.Tensor:
        """Bool ``[2, rows]`` on ``device``: row 0 selects the routed rows
        (``flat_host``: the routing on the host) whose expert is a ready one
        of ``group``, row 1 those whose expert is a missing one. Chosen on
        the host, where the routing already is, and sent in one small copy
        per group shared by both phases; on CUDA out of a reused
        page-locked buffer (:class:`~pdflash.cache.staging.StagingRing`),
        so no pinned allocation and no device gather per group."""
        phase = np.zeros(self.num_experts, dtype=np.int8)  # 0: not in group
        group = np.asarray(group, dtype=np.int64)
        phase[group[ready]] = 1
        phase[group[~ready]] = 2
        code = phase[flat_host]
        rows = np.stack((code == 1, code == 2))
        if device.type == "cuda":
            return upload_from_ring(self._row_rings, rows, torch.bool, device)
        out = torch.from_numpy(rows)
        return out if device.type == "cpu" else out.to(device)

    def _resident_window(self, layer: int) -> tuple[int, int] | None:
        """``(lo, width)``: the slab slots ``lo .. lo + width`` hold every
        expert of ``layer`` (read from the cache's host slot table, so no
        sync), when all of them hold a slot and the span fits one grouped
        call; None otherwise. A resident layer's rows then run as one
        unmasked call over that span of the slab, whatever the slab's size."""
        if self._slot_table is None:
            return None
        base = layer * self.num_experts
        slots = self._slot_table.slot_of[base : base + self.num_experts]
        lo = int(slots.min())
        if lo < 0:
            return None
        width = int(slots.max()) - lo + 1
        return (lo, width) if width <= MAX_GROUPS_PER_CALL else None

    def _window_views(self, lo: int, width: int) -> dict[str, torch.Tensor]:
        """The slab's component views of slots ``lo .. lo + width`` (memoised)."""
        if lo == 0 and width == self.cache.num_slots:
            return self._slab_views
        key = (lo, width)
        views = self._window_cache.get(key)
        if views is None:
            if len(self._window_cache) >= 4 * max(1, self.cache.num_layers):
                self._window_cache.clear()
            views = {n: v[lo : lo + width] for n, v in self._slab_views.items()}
            self._window_cache[key] = views
        return views

    def _grouped_rows(
        self,
        x: torch.Tensor,
        k: int,
        row_slot: torch.Tensor,
        row_in: torch.Tensor | None,
        y_flat: torch.Tensor,
    ) -> None:
        """``y_flat[r] = expert(slot_r)(x[r // k])`` for the rows selected by
        ``row_in`` (all when None), one grouped call per projection per
        :data:`MAX_GROUPS_PER_CALL` slots. Rows outside a call's slots are
        sorted past its last group (grouped_mm leaves them out) and masked
        from the write-back, so no row count reaches the host."""
        num_slots = self.cache.num_slots
        if row_in is None and num_slots <= MAX_GROUPS_PER_CALL:
            self._run_sorted(x, k, row_slot, num_slots, self._slab_views, y_flat)
            return
        for lo in range(0, num_slots, MAX_GROUPS_PER_CALL):
            width = min(MAX_GROUPS_PER_CALL, num_slots - lo)
            local = row_slot - lo
            take = (local >= 0) & (local < width)
            if row_in is not None:
                take = take & row_in
            key_sorted, order = torch.sort(torch.where(take, local, width), stable=True)
            views = {n: v[lo : lo + width] for n, v in self._slab_views.items()}
            self._run_groups(x, k, key_sorted, order, width, views, y_flat)

    def _run_sorted(
        self,
        x: torch.Tensor,
        k: int,
        key: torch.Tensor,
        width: int,
        views: dict[str, torch.Tensor],
        y_flat: torch.Tensor,
    ) -> None:
        """One unmasked grouped MLP call: every row's key (its slot in
        ``views``) is in ``[0, width)``. The rows are ordered by
        :func:`sort_rows` and the outputs gathered back in row order straight
        into ``y_flat`` (no indexed write)."""
        grouped = self.grouped
        assert grouped is not None
        rows = sort_rows(key, width, k)
        fused = self._fused()
        if fused is not None:
            out = fused.forward_slab(
                x, rows.token, rows.key_sorted(), width, views, self.num_experts
            )
        elif grouped.compressed:
            group_of_row, offs, views = _compact(rows.key_sorted(), width, views)
            out = grouped.forward(x[rows.token], grouped.weights(views), offs, group_of_row)
        else:
            # an MLP without per-expert biases reads no row groups: no kernel for them
            groups = rows.key_sorted() if getattr(grouped, "uses_row_groups", True) else rows.key
            out = grouped.forward(x[rows.token], grouped.weights(views), rows.offs, groups)
        torch.index_select(out, 0, rows.position, out=y_flat)

    def _run_groups(
        self,
        x: torch.Tensor,
        k: int,
        key_sorted: torch.Tensor,
        order: torch.Tensor,
        width: int,
        views: dict[str, torch.Tensor],
        y_flat: torch.Tensor,
    ) -> None:
        """One masked grouped MLP call over rows ``order`` whose group keys
        are ``key_sorted`` (``width``: masked out, its row of ``y_flat`` kept)."""
        grouped = self.grouped
        assert grouped is not None
        fused = self._fused()
        if fused is not None:
            # compressed slab read in place: no gather of the used slots, no
            # dequantized copy, x rows gathered inside the kernel
            out = fused.forward_slab(x, order // k, key_sorted, width, views, self.num_experts)
        else:
            if grouped.compressed:
                group_of_row, offs, views = _compact(key_sorted, width, views)
            else:
                group_of_row = key_sorted.clamp(max=width - 1)
                offs = torch.searchsorted(
                    key_sorted, _group_ids(width, key_sorted.device), right=True, out_int32=True
                )
            out = grouped.forward(x[order // k], grouped.weights(views), offs, group_of_row)
        valid = (key_sorted < width).unsqueeze(-1)
        y_flat[order] = torch.where(valid, out, y_flat[order])


#: :func:`sort_rows` counts (one-hot, ``keys x rows`` cells) up to this many
#: cells and sorts past it (the one-hot grows with both)
COUNTING_SORT_MAX_CELLS = 1 << 22

#: how the offloaded block orders its routed rows (:func:`set_row_sort`)
ROW_SORT_MODES = ("plan_atomic", "plan", "counting", "sort")
#: the mode when neither :func:`set_row_sort` nor ``PDFLASH_ROW_SORT`` names one
DEFAULT_ROW_SORT = "plan_atomic"
#: the modes whose all-resident fused calls take the kernels' ``row_plan``
_PLAN_MODES = ("plan_atomic", "plan")
_row_sort: str | None = None  # None: read PDFLASH_ROW_SORT on first use


def set_row_sort(mode: str | None) -> None:
    """How the offloaded block orders its routed rows from now on:
    ``plan_atomic`` (the default: an all-resident call of a fused MLP of up
    to 65536 rows over 1024 slot keys orders and tiles its rows in one
    launch, the kernels' ``row_plan(ordered=False)``, which places each
    key's rows with atomic counters in no fixed order, and weighs them back
    in one more, ``weighted_combine``; every other call as ``counting``),
    ``plan`` (the same with the stable plan, ``row_plan``, up to 2^15 rows
    x keys), ``counting`` (:func:`sort_rows` by a counting sort of a
    handful of small kernels) or ``sort`` (``torch.sort`` +
    ``searchsorted``: 5 torch calls instead of 12, so less host time for an
    eager call whose host is the limit, one radix-sort kernel more device
    time). All give the same values. None: back to the environment's
    ``PDFLASH_ROW_SORT``."""
    if mode is not None and mode not in ROW_SORT_MODES:
        raise ValueError(f"row sort must be one of {ROW_SORT_MODES}, got {mode!r}")
    global _row_sort
    _row_sort = mode


def row_sort_mode() -> str:
    """The :func:`set_row_sort` setting now (else ``PDFLASH_ROW_SORT``, else
    :data:`DEFAULT_ROW_SORT`)."""
    global _row_sort
    if _row_sort is None:
        mode = os.environ.get("PDFLASH_ROW_SORT", "") or DEFAULT_ROW_SORT
        if mode not in ROW_SORT_MODES:
            raise ValueError(f"PDFLASH_ROW_SORT must be one of {ROW_SORT_MODES}, got {mode!r}")
        _row_sort = mode
    return _row_sort


class RowSort:
    """Rows ordered by key, stably (see :func:`sort_rows`): ``position[r]``
    is row ``r``'s place in the order (int64), ``token[p]`` the token of the
    row at place ``p`` (row // k, int64), ``offs`` the int32 cumulative row
    ends of keys ``0 .. width-1`` (grouped_mm's group offsets);
    :meth:`key_sorted` the keys in that order."""

    __slots__ = ("_key_sorted", "key", "offs", "position", "token")

    def __init__(
        self,
        key: torch.Tensor,
        position: torch.Tensor,
        token: torch.Tensor,
        offs: torch.Tensor,
        key_sorted: torch.Tensor | None = None,
    ) -> None:
        self.key = key
        self.position = position
        self.token = token
        self.offs = offs
        self._key_sorted = key_sorted  # given by a sort; else scattered on demand

    def key_sorted(self) -> torch.Tensor:
        if self._key_sorted is None:
            self._key_sorted = torch.empty_like(self.key).scatter_(0, self.position, self.key)
        return self._key_sorted


def sort_rows(key: torch.Tensor, width: int, k: int) -> RowSort:
    """Order the routed rows ``r`` (token ``r // k``) by ``key [n]`` (int64,
    every key in ``[0, width)``), stably: the order, offsets and inverse
    ``torch.sort(key, stable=True)`` + ``searchsorted`` + a scatter give,
    exactly. Up to :data:`COUNTING_SORT_MAX_CELLS` it is a counting sort of
    a handful of small elementwise/scan kernels (a row's place is its key's
    start plus its rank among earlier rows of that key), not a radix sort;
    past it, or when :func:`row_sort_mode` is ``sort``, ``torch.sort`` (fewer
    torch calls, more device time). No host sync either way."""
    n = int(key.numel())
    device = key.device
    if width * n <= COUNTING_SORT_MAX_CELLS and row_sort_mode() != "sort":
        key_row = key.unsqueeze(0)  # [1, n]: the one-hot's and the gather's index
        onehot = key_row == _group_column(width, device)  # [width, n]
        # one scan over the one-hot laid out key by key: at (g, r) it counts
        # the rows of keys < g plus the rows of key g up to r, so at a row's
        # own key it is the row's 1-based place, and at (g, n-1) the end of
        # group g
        running = onehot.view(-1).cumsum(0).view(width, n)
        offs = running[:, -1].to(torch.int32)
        position = running.gather(0, key_row).squeeze(0).sub_(1)
    else:
        key_sorted, order = torch.sort(key, stable=True)
        offs = torch.searchsorted(key_sorted, _group_ids(width, device), right=True, out_int32=True)
        position = torch.empty_like(order).scatter_(0, order, _group_ids(n, device))
        # the row at place p is order[p]: its token order[p] // k, no scatter
        return RowSort(key, position, order // k, offs, key_sorted)
    token = torch.empty_like(position).scatter_(0, position, _row_tokens(n, k, device))
    return RowSort(key, position, token, offs)


_ARANGES: dict[tuple[int, int, bool, str], torch.Tensor] = {}


def _cached_arange(
    n: int, device: torch.device, div: int = 1, column: bool = False
) -> torch.Tensor:
    """``arange(n) // div`` on ``device``, as a column where ``column``
    (cached: built once per shape, not on every layer call)."""
    key = (n, div, column, str(device))
    out = _ARANGES.get(key)
    if out is None:
        out = torch.arange(n, device=device)
        if div != 1:
            out = out // div
        out = _ARANGES[key] = out.unsqueeze(1) if column else out
    return out


def _row_tokens(n: int, k: int, device: torch.device) -> torch.Tensor:
    """Each of ``n`` routed rows' token (``k`` rows a token)."""
    return _cached_arange(n, device, div=k)


def _group_ids(n: int, device: torch.device) -> torch.Tensor:
    return _cached_arange(n, device)


def _group_column(n: int, device: torch.device) -> torch.Tensor:
    return _cached_arange(n, device, column=True)


def _compact(
    key_sorted: torch.Tensor, width: int, views: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """For compressed slabs: gather only the slots the rows use, as a fixed
    number of groups ``m = min(width, rows)`` (no host sync for the count):
    the used slots in slot order first, then unused ones as empty padding.
    Returns each row's compact group, the int32 group ends and the gathered
    views. Masked rows (key ``width``) fall past the used groups' rows."""
    rows = int(key_sorted.numel())
    m = max(1, min(width, rows))
    device = key_sorted.device
    used = torch.zeros(width + 1, dtype=torch.bool, device=device)
    used.index_fill_(0, key_sorted, True)
    used = used[:width]
    slot_ids = _group_ids(width, device)
    picked = torch.sort(torch.where(used, slot_ids, slot_ids + width)).indices[:m]
    rank = torch.cumsum(used, 0) - 1  # compact group of each used slot
    group_sorted = torch.where(key_sorted < width, rank[key_sorted.clamp(max=width - 1)], m)
    offs = torch.searchsorted(group_sorted, _group_ids(m, device), right=True, out_int32=True)
    group_of_row = group_sorted.clamp(max=m - 1)
    return group_of_row, offs, {n: v.index_select(0, picked) for n, v in views.items()}


class UnknownMoEPartError(TypeError):
    """An HF sparse MoE block holds a submodule, parameter or buffer the
    offloaded block would not run (it is refused, never dropped)."""


@dataclass(frozen=True)
class MoEBlockSpec:
    """What an architecture's HF sparse MoE block holds and how
    :func:`install_offloaded_blocks` replaces it.

    ``router_attr``/``experts_attr``: the router and routed-experts
    submodules; ``shared_expert_attr``: an always-on shared expert (kept,
    resident); ``shared_expert_gate_attr``: its gate (output scaled by
    ``sigmoid(gate(x))``); ``returns_router_scores``: the block returns
    ``(hidden, router_scores)`` (gpt-oss); ``route_fn``: the arch's routing
    (default: the router's own forward); ``moe_layers``: the decoder layers
    holding MoE blocks (None: every layer; the others are dense and left
    alone).
    """

    router_attr: str = "gate"
    experts_attr: str = "experts"
    returns_router_scores: bool = False
    shared_expert_attr: str | None = None
    shared_expert_gate_attr: str | None = None
    route_fn: RouteFn | None = None
    moe_layers: tuple[int, ...] | None = None

    def known_parts(self) -> set[str]:
        return {
            n
            for n in (
                self.router_attr,
                self.experts_attr,
                self.shared_expert_attr,
                self.shared_expert_gate_attr,
            )
            if n is not None
        }


class OffloadedMoEBlock(nn.Module):
    """Drop-in replacement for an HF sparse MoE block (``[B, S, H]`` in/out).

    Routes with the HF router it keeps (attribute ``router_attr``; through
    ``route_fn`` when given), then runs :meth:`OffloadedMoE.forward_routed`
    and adds the shared expert's output (:meth:`with_shared`).
    ``returns_router_scores`` mirrors blocks such as gpt-oss's that return
    ``(hidden, router_scores)``. ``layer`` is the MoE layer index (the
    cache's numbering), not necessarily the decoder layer.
    """

    def __init__(
        self,
        layer: int,
        runtime: OffloadedMoE | None,
        router: nn.Module,
        router_attr: str,
        returns_router_scores: bool = False,
        *,
        route_fn: RouteFn | None = None,
        shared_expert: nn.Module | None = None,
        shared_expert_attr: str | None = None,
        shared_expert_gate: nn.Module | None = None,
        shared_expert_gate_attr: str | None = None,
    ) -> None:
        super().__init__()
        self.layer = layer
        self.runtime = runtime
        self.router_attr = router_attr
        self.returns_router_scores = returns_router_scores
        self.route_fn = route_fn
        self.add_module(router_attr, router)
        if (shared_expert is None) != (shared_expert_attr is None):
            raise ValueError("give shared_expert and shared_expert_attr together")
        if (shared_expert_gate is None) != (shared_expert_gate_attr is None):
            raise ValueError("give shared_expert_gate and shared_expert_gate_attr together")
        if shared_expert_gate is not None and shared_expert is None:
            raise ValueError("a shared expert gate needs a shared expert")
        self.shared_expert_attr = shared_expert_attr
        self.shared_expert_gate_attr = shared_expert_gate_attr
        if shared_expert is not None:
            self.add_module(str(shared_expert_attr), shared_expert)
        if shared_expert_gate is not None:
            self.add_module(str(shared_expert_gate_attr), shared_expert_gate)

    @property
    def router_module(self) -> nn.Module:
        module = getattr(self, self.router_attr)
        assert isinstance(module, nn.Module)
        return module

    def route(self, x: torch.Tensor) -> RouteOutput:
        """``x [T, H]`` -> (logits ``[T, E]``, weights ``[T, k]``, ids ``[T, k]``)."""
        if self.route_fn is not None:
            return self.route_fn(self.router_module, x)
        logits, scores, ids = self.router_module(x)
        return logits, scores, ids

    def shared_output(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shared expert's (gated) output for ``x [T, H]``, or None."""
        if self.shared_expert_attr is None:
            return None
        out: torch.Tensor = getattr(self, self.shared_expert_attr)(x)
        if self.shared_expert_gate_attr is not None:
            out = torch.sigmoid(getattr(self, self.shared_expert_gate_attr)(x)) * out
        return out

    def with_shared(self, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """``routed`` (the routed experts' output for ``x``) plus the shared expert's."""
        shared = self.shared_output(x)
        return routed if shared is None else routed + shared

    def forward(self, hidden_states: torch.Tensor) -> Any:
        if self.runtime is None:
            raise RuntimeError(f"offloaded MoE block of layer {self.layer} has no runtime attached")
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        _, scores, ids = self.route(x)
        routed = self.runtime.forward_routed(self.layer, x, ids, scores)
        out = self.with_shared(x, routed).reshape(shape)
        if self.returns_router_scores:
            return out, scores
        return out


def decoder_layers(hf_model: nn.Module) -> nn.ModuleList:
    """The decoder layers of an HF causal LM (``model.model.layers``)."""
    inner = getattr(hf_model, "model", hf_model)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(hf_model).__name__} has no model.layers ModuleList")
    return layers


def _unknown_parts(block: nn.Module, known: set[str]) -> list[str]:
    """``block``'s own submodules, parameters and buffers not in ``known``."""
    names = [n for n, _ in block.named_children()]
    names += [n for n, _ in block.named_parameters(recurse=False)]
    names += [n for n, _ in block.named_buffers(recurse=False)]
    return [n for n in names if n not in known]


def install_offloaded_blocks(
    hf_model: nn.Module,
    runtime: OffloadedMoE | None,
    *,
    router_attr: str = "gate",
    returns_router_scores: bool = False,
    mlp_attr: str = "mlp",
    spec: MoEBlockSpec | None = None,
) -> list[OffloadedMoEBlock]:
    """Replace the sparse MoE block of every MoE decoder layer with an
    :class:`OffloadedMoEBlock` that keeps the block's router and shared
    expert (with its gate); the old block's routed-expert parameters are
    dropped. ``spec`` describes the block (default: ``router_attr`` and
    ``returns_router_scores``, every layer MoE, no shared expert). A block
    holding any other submodule, parameter or buffer raises
    :class:`UnknownMoEPartError` naming it. Returns the new blocks (MoE
    layer order). Use :meth:`pdflash.models.MoEAdapterBase.install_offloaded`
    to take the spec from the arch's adapter."""
    if spec is None:
        spec = MoEBlockSpec(router_attr=router_attr, returns_router_scores=returns_router_scores)
    layers = decoder_layers(hf_model)
    moe_layers = tuple(range(len(layers))) if spec.moe_layers is None else spec.moe_layers
    bad = [d for d in moe_layers if not 0 <= d < len(layers)]
    if bad:
        raise ValueError(f"MoE layer {bad[0]} out of range for {len(layers)} decoder layers")
    known = spec.known_parts()
    # every layer is checked before any is replaced: a refusal leaves the model as it was
    blocks: list[OffloadedMoEBlock | None] = []
    for m, d in enumerate(moe_layers):
        layer = layers[d]
        old = getattr(layer, mlp_attr)
        if isinstance(old, OffloadedMoEBlock):
            blocks.append(None)
            continue
        router = getattr(old, spec.router_attr, None)
        if not isinstance(router, nn.Module):
            raise TypeError(
                f"layer {d}: {type(old).__name__} has no router {spec.router_attr!r} "
                "(is this a dense layer?)"
            )
        unknown = _unknown_parts(old, known)
        if unknown:
            raise UnknownMoEPartError(
                f"layer {d}: {type(old).__name__} holds {unknown[0]!r} "
                f"({type(getattr(old, unknown[0])).__name__}), a MoE-block part pdflash "
                f"does not know (known: {sorted(known)}); the offloaded block would drop it. "
                "Declare it in the adapter (shared_expert_attr, shared_expert_gate_attr, "
                "router_attr, experts_attr) or extend the adapter to run it"
            )
        parts: dict[str, nn.Module] = {}
        for role, name in (
            ("shared expert", spec.shared_expert_attr),
            ("shared expert gate", spec.shared_expert_gate_attr),
        ):
            if name is None:
                continue
            module = getattr(old, name, None)
            if not isinstance(module, nn.Module):
                raise TypeError(
                    f"layer {d}: {type(old).__name__} has no {role} {name!r} "
                    "(the adapter declares one)"
                )
            parts[name] = module
        block = OffloadedMoEBlock(
            m,
            runtime,
            router,
            spec.router_attr,
            spec.returns_router_scores,
            route_fn=spec.route_fn,
            shared_expert=parts.get(spec.shared_expert_attr or ""),
            shared_expert_attr=spec.shared_expert_attr,
            shared_expert_gate=parts.get(spec.shared_expert_gate_attr or ""),
            shared_expert_gate_attr=spec.shared_expert_gate_attr,
        )
        blocks.append(block)
    installed = []
    for d, new in zip(moe_layers, blocks, strict=True):
        if new is None:  # already offloaded: attach the runtime
            current = getattr(layers[d], mlp_attr)
            assert isinstance(current, OffloadedMoEBlock)
            current.runtime = runtime
            installed.append(current)
        else:
            setattr(layers[d], mlp_attr, new)
            installed.append(new)
    return installed
