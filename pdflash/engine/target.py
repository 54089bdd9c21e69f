"""The batched target forward over paged KV, through a :class:`MoEModelAdapter`.

All scheduled requests' tokens (prefill prompts or verify blocks) are
flattened into one token batch. Each layer runs
``input_norm -> project_qkv -> paged attention -> project_out -> residual ->
moe_norm -> moe -> residual`` (a dense decoder layer runs its resident MLP
instead of the MoE); the MoE call sees every request's tokens at
once, so each distinct expert is fetched and run once per layer for the
whole batch (the union of experts is where batching pays off). Hidden states
at the drafter's ``target_layer_ids`` are collected for the next draft, and
the routing of every layer is recorded (per request, and as the flat ids the
forward needed, for the Belady replay).

Host syncs (the points where the host waits for the GPU) of one forward on
CUDA, and why each remains:

- none to start it: the index tensors (attention batch, KV slots,
  positions, logit rows) go over in two asynchronous copies from the
  runner's reused pinned buffers (:attr:`TargetRunner.staging`), and the
  chunks' tokens are already on the device (a prefill's prompts went over
  the same way, all in one copy);
- none in a layer's attention (:func:`~pdflash.engine.attention.paged_attention`
  builds nothing per layer and indexes with no boolean mask);
- in the offloaded MoE block (:mod:`pdflash.models.offload`), one per MoE
  layer that has experts outside the cache: the host reads the layer's
  per-expert token counts, because it picks the copies to submit and the
  slots to pin before the experts run. A layer whose experts are all
  resident (every layer under B3) reads nothing. A routed hook that reads
  the routing first (the streaming prefetcher, PD) reads it through
  :func:`~pdflash.models.offload.routed_ids_on_host`, which the block's
  read shares (within the layer's
  :func:`~pdflash.models.offload.shared_routing_reads` block): one sync for
  both;
- in a layer observer running the next-layer gate lookahead (B2, PD), one
  per MoE layer but the last: its E scores, ranked on the host;
- with a trace routing source (:class:`~pdflash.engine.replay.TraceRouting`),
  one per forward for the chunks' tokens (they choose the trace rows) and
  none per layer (the replayed rows go over in one asynchronous copy per
  forward; which rows kept the router's set is counted on the device);
- one at the end: the routing grid (``routed``) comes back to the host for
  the scheduler, the caches' accounting and the Belady trace. The engine
  then reads the logits it accepts with (one batched copy for greedy
  requests).

With :attr:`TargetRunner.graphs` set (:mod:`pdflash.engine.graphs`), a
verify step whose every expert is resident and that no layer hook or
routing source sees runs as one replayed CUDA graph of :meth:`run_layers`
over padded static buffers; its syncs are the same (none before the end,
the routing grid at the end; :mod:`pdflash.engine.graphs` lists the rare
others). Every other step runs as described above.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from itertools import pairwise
from typing import TYPE_CHECKING, Protocol, cast

import numpy as np
import numpy.typing as npt
import torch

from pdflash.engine.attention import AttentionBatch, HostStaging, device_int64, paged_attention
from pdflash.engine.kv_cache import PagedKVCache
from pdflash.engine.replay import RoutingSource
from pdflash.models.offload import OffloadedAdapter, shared_routing_reads
from pdflash.protocols import (
    DenseLayerAdapter,
    MoEModelAdapter,
    RoutedMoEAdapter,
    decoder_layer_plan,
)

if TYPE_CHECKING:
    from pdflash.engine.graphs import GraphRunner
    from pdflash.models.offload import OffloadedMoE


class RegionTimer(Protocol):
    """Times named parts of a forward (see :class:`pdflash.engine.timing.ComputeTimer`)."""

    def region(self, name: str) -> AbstractContextManager[None]: ...


@contextmanager
def _untimed() -> Iterator[None]:
    yield


class LayerObserver(Protocol):
    """Sees each MoE layer's output (the residual stream after its MoE; the
    layer is the MoE layer index) and its exact routing, right after the
    layer was issued: the hook for next-layer
    gate lookahead prefetch (copies submitted here overlap the tail of this
    layer's expert compute and the next layer's attention)."""

    def after_layer(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor) -> None: ...


@dataclass
class Chunk:
    """One request's tokens in a forward: positions ``kv.length(seq_id) ..``."""

    seq_id: int
    tokens: torch.Tensor  # [n] int64
    all_logits: bool  # False: only the last row's logits (prefill)


@dataclass
class StepPlan:
    """A forward's host-side layout: every chunk's KV start and token count,
    the flat rows' new KV slots and positions, each request's query rows /
    positions and key slots / positions (for :class:`AttentionBatch`), each
    row's chunk and the rows whose logits are wanted."""

    starts: list[int]
    lens: list[int]
    total: int
    new_slots: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    q_rows: list[list[int]] = field(default_factory=list)
    q_pos: list[list[int]] = field(default_factory=list)
    k_slots: list[list[int]] = field(default_factory=list)
    k_pos: list[list[int]] = field(default_factory=list)
    row_chunk: list[int] = field(default_factory=list)
    want: list[int] = field(default_factory=list)
    #: the index lists above are filled (:meth:`TargetRunner.index_plan`);
    #: a replayed step reads its indices from the KV's block tables instead
    indexed: bool = False


def step_logits(adapter: MoEModelAdapter, hidden: torch.Tensor) -> torch.Tensor:
    """The final norm and ``lm_head`` over the wanted rows' hidden states,
    in ``lm_head``'s dtype. No fp32 copy of every row's logits: greedy
    acceptance's argmax is exact on these values (an upcast keeps their
    order and ties, and ``torch.argmax`` takes the first maximum either
    way), and :func:`~pdflash.engine.sampling.target_probs` casts to fp32
    itself, so the tokens are those of fp32 logits; the copy was one
    read and one fp32 write of ``rows x vocab`` on the device per step."""
    out: torch.Tensor = adapter.lm_head(adapter.final_norm(hidden))
    return out


@dataclass
class ForwardOutput:
    #: per chunk: [n, V] or [1, V], in ``lm_head``'s dtype (:func:`step_logits`)
    logits: list[torch.Tensor]
    features: list[torch.Tensor]  # per chunk: [n, len(capture) * hidden] (empty if no capture)
    routed: npt.NDArray[np.bool_]  # [chunks, layers, experts]
    needed_flat: list[npt.NDArray[np.int64]]  # per layer: flat ids the forward routed to
    #: every chunk's ``logits`` rows in chunk order, one tensor (``logits``
    #: are its slices), for batched reads such as one argmax for the step
    logits_flat: torch.Tensor | None = None


def kv_cache_for(
    adapter: MoEModelAdapter,
    *,
    page_size: int,
    num_pages: int,
    dtype: torch.dtype,
    device: torch.device | str,
    scratch: bool = False,
) -> PagedKVCache:
    """A paged KV cache shaped for the adapter's attention (uniform over
    layers; one per decoder layer, dense ones included); ``scratch``: with
    the scratch row padded forwards write to (:class:`PagedKVCache`)."""
    num_decoder_layers = len(decoder_layer_plan(adapter))
    specs = [adapter.attention_spec(i) for i in range(num_decoder_layers)]
    kvh = {s.num_kv_heads for s in specs}
    hd = {s.head_dim for s in specs}
    if len(kvh) != 1 or len(hd) != 1:
        raise ValueError(f"layers differ in kv heads {sorted(kvh)} or head_dim {sorted(hd)}")
    return PagedKVCache(
        num_layers=num_decoder_layers,
        num_kv_heads=kvh.pop(),
        head_dim=hd.pop(),
        page_size=page_size,
        num_pages=num_pages,
        dtype=dtype,
        device=device,
        scratch=scratch,
    )


class TargetRunner:
    """Runs flat token batches of many requests through the target."""

    def __init__(
        self,
        adapter: MoEModelAdapter,
        kv: PagedKVCache,
        *,
        capture_layers: Sequence[int] = (),
        device: torch.device | str = "cpu",
    ) -> None:
        #: per decoder layer: its MoE layer, or None (dense). Capture layers,
        #: attention and the KV are per decoder layer; the routing, the hooks
        #: and the observers see MoE layers (the expert grid's numbering).
        self.plan_layers = decoder_layer_plan(adapter)
        n = len(self.plan_layers)
        bad = [i for i in capture_layers if not 0 <= i < n]
        if bad:
            raise ValueError(f"capture layer {bad[0]} out of range for {n} layers")
        #: the adapter's optional parts (typed once, see :attr:`adapter`)
        self._routed_moe: RoutedMoEAdapter | None = None
        self._offloaded: OffloadedAdapter | None = None
        self.adapter = adapter
        self.kv = kv
        self.capture_layers = tuple(capture_layers)
        self.device = torch.device(device)
        #: the reused host buffers of each forward's index copies (pinned on CUDA)
        self.staging = HostStaging(self.device)
        # NOTE: the routed grid's mark, made here (never inside a graph
        # capture, which would record its fill without running it) and only
        # ever read: one allocation and fill kernel less per MoE layer
        self._routed_mark = torch.ones((), dtype=torch.bool, device=self.device)
        self.specs = [adapter.attention_spec(i) for i in range(n)]
        self.observers: list[LayerObserver] = []
        #: called with each MoE layer index right before that layer's MoE runs
        #: (e.g. a layer-cyclic eviction policy tracking the current layer);
        #: host-only: a replayed step (:attr:`graphs`, every expert resident,
        #: so nothing is evicted during it) calls them for every MoE layer in
        #: order right before the replay
        self.before_moe_hooks: list[Callable[[int], None]] = []
        #: called with (layer, topk_ids [T, k], residual [T, H] after the
        #: layer's attention) after ``before_moe_hooks``, right before that
        #: layer's MoE pins its experts (e.g. a streaming prefetcher that
        #: learns the layer's exact routing)
        self.routed_hooks: list[Callable[[int, torch.Tensor, torch.Tensor], None]] = []
        #: when set, each layer's attention, router and experts are timed as
        #: regions (a verify-step breakdown; costs a few events per layer)
        self.region_timer: RegionTimer | None = None
        #: when set, each layer's top-k experts come from it instead of the
        #: router (e.g. :class:`pdflash.engine.replay.TraceRouting`)
        self.routing: RoutingSource | None = None
        #: when set, steps it can take run as replayed CUDA graphs
        #: (:class:`pdflash.engine.graphs.GraphRunner`); the rest run eagerly
        self.graphs: GraphRunner | None = None

    @property
    def adapter(self) -> MoEModelAdapter:
        """The target model. Setting it checks its optional parts once:
        whether its MoE takes a routing from outside
        (:class:`~pdflash.protocols.RoutedMoEAdapter`) and whether it may run
        offloaded (:class:`~pdflash.models.offload.OffloadedAdapter`: the
        hybrid miss service's clock is read from its runtime per forward)."""
        return self._adapter

    @adapter.setter
    def adapter(self, adapter: MoEModelAdapter) -> None:
        self._adapter = adapter
        self._routed_moe = adapter if isinstance(adapter, RoutedMoEAdapter) else None
        self._offloaded = adapter if isinstance(adapter, OffloadedAdapter) else None

    @property
    def takes_routing(self) -> bool:
        """Whether the adapter's MoE takes a routing from outside
        (:class:`~pdflash.protocols.RoutedMoEAdapter`; checked when the
        adapter was set)."""
        return self._routed_moe is not None

    @property
    def offloaded_runtime(self) -> OffloadedMoE | None:
        """The offloaded block the adapter runs now (None: none attached, or
        an adapter that cannot run offloaded); read per call, since
        ``attach_cache`` / ``detach_cache`` change it."""
        return None if self._offloaded is None else self._offloaded.runtime

    def _region(self, name: str) -> AbstractContextManager[None]:
        timer = self.region_timer
        return _untimed() if timer is None else timer.region(name)

    @property
    def hooked(self) -> str | None:
        """Why a forward must run layer by layer on the host (observers,
        routed hooks or a routing source see each layer's tensors), or None."""
        if self.routing is not None:
            return "routing_source"
        if self.observers or self.routed_hooks:
            return "layer_hooks"
        return None

    def plan(self, chunks: Sequence[Chunk], *, lists: bool = True) -> StepPlan:
        """Grow every chunk's KV (host bookkeeping) and, with ``lists``, lay
        out the forward's index lists (:meth:`index_plan`). The caller rolls
        the KV back on failure."""
        kv = self.kv
        starts = [kv.length(c.seq_id) for c in chunks]
        lens = [int(c.tokens.numel()) for c in chunks]
        p = StepPlan(starts=starts, lens=lens, total=sum(lens))
        for c, n in zip(chunks, lens, strict=True):
            kv.grow(c.seq_id, n)
        if lists:
            self.index_plan(p, chunks)
        return p

    def index_plan(self, p: StepPlan, chunks: Sequence[Chunk]) -> None:
        """Fill a plan's index lists (the KV already grown by :meth:`plan`):
        what the eager forward builds its index tensors from."""
        kv = self.kv
        row = 0
        for ci, (c, s, n) in enumerate(zip(chunks, p.starts, p.lens, strict=True)):
            p.new_slots += kv.slot_list(c.seq_id, s, s + n)
            p.positions += list(range(s, s + n))
            p.q_rows.append(list(range(row, row + n)))
            p.q_pos.append(list(range(s, s + n)))
            p.k_slots.append(kv.slot_list(c.seq_id, 0, s + n))
            p.k_pos.append(list(range(s + n)))
            p.row_chunk += [ci] * n
            p.want += list(range(row, row + n)) if c.all_logits else [row + n - 1]
            row += n
        p.indexed = True

    @torch.no_grad()
    def forward(self, chunks: Sequence[Chunk]) -> ForwardOutput:
        """Append every chunk's tokens to its KV and run the layers once
        (through :attr:`graphs` where it takes the step, else eagerly).

        On any exception the KV of every chunk is rolled back to where it was.
        """
        kv = self.kv
        starts = [kv.length(c.seq_id) for c in chunks]
        try:
            # a replayed step fills its static buffers from the KV's block
            # tables (GraphRunner._fill): the index lists only for eager
            plan = self.plan(chunks, lists=self.graphs is None)
            if self.graphs is not None:
                out = self.graphs.forward(self, chunks, plan)
                if out is not None:
                    return out
                if not plan.indexed:
                    self.index_plan(plan, chunks)
            return self._forward_eager(chunks, plan)
        except BaseException:
            for c, s in zip(chunks, starts, strict=False):
                if kv.has(c.seq_id) and kv.length(c.seq_id) > s:
                    kv.truncate(c.seq_id, s)
            raise

    def _forward_eager(self, chunks: Sequence[Chunk], plan: StepPlan) -> ForwardOutput:
        ad = self.adapter
        dev = self.device
        batch = AttentionBatch.build(
            plan.q_rows,
            plan.q_pos,
            plan.k_slots,
            plan.k_pos,
            plan.total,
            dev,
            null_slot=self.kv.null_slot,
            staging=self.staging,
        )
        # one host->device copy for the forward's other index tensors
        slots_t, pos_t, row_chunk_t, want_t = device_int64(
            [plan.new_slots, plan.positions, plan.row_chunk, plan.want], dev, self.staging
        )
        ids = (
            torch.cat([c.tokens.to(dev) for c in chunks])
            if chunks
            else torch.zeros(0, dtype=torch.int64, device=dev)
        )
        if self.routing is not None:
            self.routing.begin_forward(
                [(c.seq_id, s, c.tokens) for c, s in zip(chunks, plan.starts, strict=True)]
            )
        routed = torch.zeros(
            (len(chunks), ad.num_layers, ad.num_experts), dtype=torch.bool, device=dev
        )
        x, captured = self.run_layers(ids, pos_t, slots_t, batch, row_chunk_t, routed)
        logits_all = step_logits(ad, x[want_t])
        features: list[torch.Tensor] = []
        if self.capture_layers:
            feat = torch.cat([captured[i] for i in self.capture_layers], dim=-1)
            features = list(torch.split(feat, plan.lens))
        return self.finish(chunks, plan, logits_all, features, routed.cpu().numpy())

    def run_layers(
        self,
        ids: torch.Tensor,
        pos_t: torch.Tensor,
        slots_t: torch.Tensor,
        batch: AttentionBatch,
        row_chunk_t: torch.Tensor,
        routed: torch.Tensor,
        topk_out: list[torch.Tensor] | None = None,
        *,
        host_hooks: bool = True,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The device part of a forward: embed ``ids``, write each layer's
        K/V at ``slots_t`` and run every layer; marks ``routed[chunk, layer,
        expert]`` for each row's chunk (``row_chunk_t``). Returns the last
        residual ``[T, H]`` and the residual at each capture layer.
        ``topk_out``: collects each MoE layer's top-k ids ``[T, k]``.
        ``host_hooks`` False: :attr:`before_moe_hooks` are not called (a
        recording; the replay calls them). No host sync unless the MoE block
        or a hook needs one (module docstring)."""
        ad = self.adapter
        x = ad.embed(ids)
        captured: dict[int, torch.Tensor] = {}
        # the hybrid miss service's clock: where the thread may wait on the device
        runtime = self.offloaded_runtime
        service = None if runtime is None else runtime.host_service
        clock = None if service is None else service.clock
        #: each top-k choice's chunk (the same for every layer)
        chunk_of_choice: list[torch.Tensor] = []
        for decoder_layer, moe_layer in enumerate(self.plan_layers):
            x = self.attention_block(decoder_layer, x, pos_t, slots_t, batch)
            if moe_layer is None:  # a dense layer: its resident MLP, no routing
                x = self.dense_block(decoder_layer, x)
                if decoder_layer in self.capture_layers:
                    captured[decoder_layer] = x
                continue
            layer = moe_layer
            normed, topk_ids, topk_weights = self.route_block(
                layer, x, row_chunk_t, routed, chunk_of_choice
            )
            if topk_out is not None:
                topk_out.append(topk_ids)
            if host_hooks:
                for hook in self.before_moe_hooks:
                    hook(layer)
            if clock is not None:
                clock.sync(time.perf_counter())  # a routed hook may read the routing
            # the routed hooks and the MoE block share one read of this routing
            with shared_routing_reads():
                for rhook in self.routed_hooks:
                    rhook(layer, topk_ids, x)
                with self._region("experts"):
                    # adapters that take the routing avoid a second router pass
                    if self._routed_moe is not None:
                        x = x + self._routed_moe.moe_routed(layer, normed, topk_ids, topk_weights)
                    elif self.routing is not None:
                        raise RuntimeError(
                            "a routing source needs an adapter with moe_routed (moe() routes "
                            "with its own router)"
                        )
                    else:
                        x = x + ad.moe(layer, normed)
            if clock is not None and self.observers:
                clock.sync(time.perf_counter())  # a lookahead reads its scores
            for obs in self.observers:
                obs.after_layer(layer, x, topk_ids)
            if decoder_layer in self.capture_layers:
                captured[decoder_layer] = x
        return x, captured

    def attention_block(
        self,
        decoder_layer: int,
        x: torch.Tensor,
        pos_t: torch.Tensor,
        slots_t: torch.Tensor,
        batch: AttentionBatch,
    ) -> torch.Tensor:
        """A decoder layer's attention half: norm, q/k/v with rotary, the
        K/V write at ``slots_t``, paged attention, output projection and
        residual."""
        ad = self.adapter
        kv = self.kv
        with self._region("attention"):
            h = ad.input_norm(decoder_layer, x)
            q, k, v = ad.project_qkv(decoder_layer, h, pos_t)
            kv.write(decoder_layer, slots_t, k, v)
            attn = paged_attention(
                q,
                kv.k[decoder_layer],
                kv.v[decoder_layer],
                batch,
                self.specs[decoder_layer],
                ad.attention_sinks(decoder_layer),
            )
            return x + ad.project_out(decoder_layer, attn.to(x.dtype))

    def dense_block(self, decoder_layer: int, x: torch.Tensor) -> torch.Tensor:
        """A dense decoder layer's MLP half (with its residual)."""
        with self._region("dense_mlp"):
            return x + cast(DenseLayerAdapter, self.adapter).dense_mlp(decoder_layer, x)

    def route_block(
        self,
        layer: int,
        x: torch.Tensor,
        row_chunk_t: torch.Tensor,
        routed: torch.Tensor,
        chunk_of_choice: list[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """MoE layer ``layer``'s norm and routing (through :attr:`routing`
        when set); marks ``routed[chunk, layer, expert]``. ``chunk_of_choice``
        holds the per-choice chunk index once built (shared by the layers of
        a forward). Returns ``(normed, topk_ids, topk_weights)``."""
        ad = self.adapter
        with self._region("router"):
            normed = ad.moe_norm(layer, x)
            topk_ids, topk_weights = ad.route(layer, normed)
            if self.routing is not None:
                topk_ids, topk_weights = self.routing.route(layer, normed, topk_ids, topk_weights)
            if not chunk_of_choice or chunk_of_choice[0].numel() != topk_ids.numel():
                k_top = topk_ids.shape[1]
                chunk_of_choice[:] = [row_chunk_t[:, None].expand(-1, k_top).reshape(-1)]
            # NOTE: a device-side True: assigning a Python scalar through an
            # index copies it from pageable host memory, which a CUDA-graph
            # capture refuses (and costs an H2D copy per layer eagerly)
            mark = self._routed_mark
            if mark.device != routed.device:
                mark = torch.ones((), dtype=torch.bool, device=routed.device)
            routed[:, layer].index_put_((chunk_of_choice[0], topk_ids.reshape(-1)), mark)
        return normed, topk_ids, topk_weights

    def finish(
        self,
        chunks: Sequence[Chunk],
        plan: StepPlan,
        logits_all: torch.Tensor,
        features: list[torch.Tensor],
        routed_np: npt.NDArray[np.bool_],
    ) -> ForwardOutput:
        """Split the wanted rows' logits per chunk and derive the routed union."""
        ad = self.adapter
        logits: list[torch.Tensor] = []
        i = 0
        for c, n in zip(chunks, plan.lens, strict=True):
            m = n if c.all_logits else 1
            logits.append(logits_all[i : i + m])
            i += m
        union: npt.NDArray[np.bool_] = np.asarray(routed_np.any(axis=0), dtype=np.bool_)
        e = ad.num_experts
        # the union's flat indices are the flat ids (layer * E + expert), in
        # layer order: one pass, split at the layer boundaries
        flat = np.flatnonzero(union).astype(np.int64)
        # slices at the boundaries (np.split's per-piece overhead is several
        # times a slice's)
        cuts = np.searchsorted(flat, np.arange(ad.num_layers + 1) * e).tolist()
        needed = [flat[lo:hi] for lo, hi in pairwise(cuts)]
        return ForwardOutput(
            logits=logits,
            features=features,
            routed=routed_np,
            needed_flat=needed,
            logits_flat=logits_all if i == int(logits_all.shape[0]) else None,
        )
