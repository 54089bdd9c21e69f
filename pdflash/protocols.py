"""The typed seams between pdflash's layers.

Policies and the engine (Python) talk to the native hot loops and to each
other only through these Protocols, so each side can be replaced, faked in a
test, or embedded in someone else's serving loop.

Conventions used everywhere:

* An *expert id* is flat: ``g = layer * num_experts + expert`` (int32/int64),
  ``0 <= g < num_layers * num_experts``.
* An *expert set* is a boolean (or uint8) array of shape
  ``(num_layers, num_experts)``, or a 1-D array of flat ids.
* Sizes are bytes (int); times are seconds (float) unless a name says ``_us``.

Domain-specific Protocols (eviction policies, scheduler weight policies,
acceptance models) live beside their concept: ``pdflash.cache``,
``pdflash.scheduler``, ``pdflash.engine``.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, cast, runtime_checkable

import numpy as np
import numpy.typing as npt

from pdflash._native import load_native

if TYPE_CHECKING:
    import torch

    # mypy types the copy errors from the checked stub (_issuer.pyi)
    from pdflash_native import _issuer as _issuer_native
else:
    _issuer_native = load_native("_issuer")


class Band(enum.IntEnum):
    """H2D priority bands; a lower value is served first."""

    ON_DEMAND = 0  # the forward is stalled on this copy
    ROUTE_AHEAD = 1  # predicted for the verify about to run
    BACKGROUND = 2  # opportunistic (frequency prior, warm-up)


# --------------------------------------------------------------------------
# H2D copy issuer (cuda/ + pdflash_native; Python class in pdflash.h2d)
# --------------------------------------------------------------------------


class TicketState(enum.IntEnum):
    """A copy ticket's state, as ``states(tickets)`` of an issuer that has it
    (:meth:`pdflash.h2d.H2DIssuer.states`) reports it: ``>= DONE`` means
    finished, ``> DONE`` finished without landing. Equal to
    ``pdflash_native._issuer.STATE_*`` (a native test checks it)."""

    QUEUED = 0
    RUNNING = 1
    DONE = 2
    FAILED = 3
    CANCELLED = 4


#: A failed copy, raised by ``wait``/``stream_wait``: the message carries the
#: backend's (CUDA) error text; ``.ticket`` names the copy.
CopyFailedError = _issuer_native.CopyFailedError
#: A copy cancelled (``cancel`` or ``close``) before it completed, raised by
#: ``wait``/``stream_wait``; ``.ticket`` names the copy.
CopyCancelledError = _issuer_native.CopyCancelledError


@runtime_checkable
class CopyIssuer(Protocol):
    """Moves expert bytes host -> device in named bands.

    Pointers are raw integer addresses (``tensor.data_ptr()``,
    ``ndarray.ctypes.data``); the issuer never sees a torch object.
    """

    @property
    def backend(self) -> str:
        """``"cuda"`` or ``"host"``."""
        ...

    def submit(
        self,
        src: npt.ArrayLike,
        dst: npt.ArrayLike,
        nbytes: npt.ArrayLike,
        keys: npt.ArrayLike,
        band: Band,
    ) -> npt.NDArray[np.int64]:
        """Queue N copies in one call; returns N tickets. A key already queued
        is not copied twice (its ticket is returned; a higher band promotes it)."""
        ...

    def poll(self, tickets: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        """Done flags, without blocking. A failed copy raises on wait, not here."""
        ...

    def wait(self, tickets: npt.ArrayLike, timeout_s: float | None = None) -> None:
        """Block until all tickets are done; raises on timeout or a failed copy."""
        ...

    def stream_wait(self, tickets: npt.ArrayLike, stream_handle: int) -> None:
        """Make a CUDA stream (raw ``cudaStream_t``) wait for the tickets
        without a host sync. On the host backend this waits on the host."""
        ...

    def cancel(self, band: Band | None = None) -> int:
        """Cancel queued, not-yet-started copies (of one band, or all); returns
        how many. The issuer stays usable."""
        ...

    def stats(self) -> dict[str, Any]:
        """Per-band counters (copies, bytes, queue delay p50/p99, blocked wait s...)."""
        ...

    def close(self) -> None:
        """Stop the issuer thread and free everything; idempotent."""
        ...


class LinkState(NamedTuple):
    """The link now (:meth:`pdflash.h2d.H2DIssuer.link_state`): copies
    queued and not yet issued, chunks in flight, and the link-rate estimate
    in bytes/s (None before a chunk finished)."""

    queued_copies: int
    inflight_chunks: int
    link_rate_estimate_bps: float | None

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing in flight."""
        return self.queued_copies == 0 and self.inflight_chunks == 0


def link_state_of(issuer: object) -> LinkState | None:
    """``issuer``'s :class:`LinkState` (None: no issuer): its own
    ``link_state()`` where it has one, else read from its ``stats()`` (an
    :class:`CopyIssuer` without the optional ``link_state``, such as a test
    double)."""
    if issuer is None:
        return None
    native = getattr(issuer, "link_state", None)
    if callable(native):
        state = native()
        if not isinstance(state, LinkState):
            raise TypeError(
                f"{type(issuer).__name__}.link_state() returned {type(state).__name__}, "
                "not a pdflash.protocols.LinkState"
            )
        return state
    stats = getattr(issuer, "stats", None)
    if not callable(stats):
        return None
    raw = stats()
    rate = raw.get("link_rate_estimate_bps")
    usable = isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0
    return LinkState(
        int(raw.get("queued_copies", 0)),
        int(raw.get("inflight_chunks", 0)),
        float(rate) if usable else None,
    )


# --------------------------------------------------------------------------
# Expert cache, route stats and horizon: what the engine and the streaming
# prefetcher use of pdflash.cache.ExpertCache,
# pdflash.routeahead.RouteAheadStats and pdflash.routeahead.AcceptanceHorizon
# --------------------------------------------------------------------------


@runtime_checkable
class ExpertCacheView(Protocol):
    """The part of an expert cache (:class:`pdflash.cache.ExpertCache`) the
    engine and the streaming prefetcher read and drive.

    The per-slot arrays (``ticket``, ``band``, ``expert_of``, one entry per
    slot) are read-only here: only the cache writes them.
    """

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one expert (one slot, one copy)."""
        ...

    @property
    def num_slots(self) -> int: ...

    @property
    def issuer(self) -> CopyIssuer: ...

    @property
    def single_band(self) -> Band | None:
        """The one band every copy goes to (an ablation), or None."""
        ...

    @property
    def ticket(self) -> npt.NDArray[np.int64]:
        """Per slot: the in-flight copy's ticket, -1 when none."""
        ...

    @property
    def band(self) -> npt.NDArray[np.int64]:
        """Per slot: the band its copy was submitted in, -1 when none."""
        ...

    @property
    def expert_of(self) -> npt.NDArray[np.int64]:
        """Per slot: the flat expert id it holds, -1 when empty."""
        ...

    def is_resident(self, flat_ids: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        """Per id: resident or in flight."""
        ...

    def resident_mask(self) -> npt.NDArray[np.bool_]:
        """``(num_layers, num_experts)``: resident or in flight."""
        ...

    def free_capacity(self, protect: npt.ArrayLike | None = None) -> int:
        """Slots a copy may take now without evicting ``protect``."""
        ...

    def prefetch(
        self,
        flat_ids: npt.ArrayLike,
        band: Band = Band.ROUTE_AHEAD,
        *,
        protect: npt.ArrayLike | None = None,
    ) -> npt.NDArray[np.int64]:
        """Start copies of the missing ids; returns their tickets."""
        ...

    def set_predicted(self, flat_ids: npt.ArrayLike) -> None:
        """Tell a prediction-aware eviction policy what the next verify needs."""
        ...


def offers(obj: object, capability: type) -> bool:
    """Whether ``obj`` has every member the runtime-checkable Protocol
    ``capability`` declares, looked up as attribute access looks it up, a
    method member not None (``isinstance`` as of Python 3.11).

    Unlike ``isinstance`` from Python 3.12 (which looks members up
    statically), a delegating wrapper's ``__getattr__`` counts: the engine
    wraps the offloaded block's cache in one
    (:class:`pdflash.engine.timing.StallTimedCache`), and the wrapped cache's
    optional capabilities must still be found through it. Meant to run once,
    where a collaborator is attached, not per call."""
    members = vars(capability)
    names = [n for n in members if not n.startswith("_")]
    names += [n for n in members.get("__annotations__", {}) if n not in members]
    for name in names:
        if not hasattr(obj, name):
            return False
        if callable(members.get(name)) and getattr(obj, name) is None:
            return False
    return True


@runtime_checkable
class LayerBookingCache(Protocol):
    """An expert cache that books every layer of a replayed (all-resident)
    step in one call each (:class:`pdflash.cache.ExpertCache`): what the
    offloaded block's CUDA-graph seam
    (:meth:`pdflash.models.offload.OffloadedMoE.pin_resident`,
    :meth:`~pdflash.models.offload.OffloadedMoE.book_resident`) uses where
    the cache has it, instead of one call per layer."""

    def all_resident(self) -> bool:
        """Every layer's experts hold a slot (landed or in flight)."""
        ...

    def pin_layers_joined(
        self, layers: Sequence[int]
    ) -> tuple[list[npt.NDArray[np.int64]], npt.NDArray[np.int64]]:
        """Pin every expert of ``layers`` in one pass: each layer's ids and
        all their tickets end to end. Raises with nothing pinned if a layer
        is not resident."""
        ...

    def unpin_layers(self, layers: Sequence[int]) -> None:
        """Unpin ``layers`` in one pass, one slot event for all of them."""
        ...

    def defer_accesses(self, layers: Sequence[int], routed: torch.Tensor) -> None:
        """Record each layer's routing (``[layers, T, k]`` device ids) as a
        deferred access, read back when the host needs it."""
        ...


@runtime_checkable
class SlotTableCache(Protocol):
    """An expert cache whose host slot table is readable
    (:class:`pdflash.cache.ExpertCache`): ``slot_of[g]`` is flat expert
    ``g``'s slot, -1 when it has none."""

    slot_of: npt.NDArray[np.int64]


@runtime_checkable
class SlabCache(Protocol):
    """An expert cache whose slots are rows of one device tensor
    (:class:`pdflash.cache.ExpertCache`): ``slab[s]`` is slot ``s``'s bytes,
    ``[num_slots, expert_nbytes]`` uint8."""

    slab: torch.Tensor


def layer_booking(cache: object) -> LayerBookingCache | None:
    """``cache`` as a :class:`LayerBookingCache` where it is one (see
    :func:`offers`), else None."""
    return cast(LayerBookingCache, cache) if offers(cache, LayerBookingCache) else None


def slot_table(cache: object) -> SlotTableCache | None:
    """``cache`` as a :class:`SlotTableCache` where it is one (see
    :func:`offers`), else None."""
    return cast(SlotTableCache, cache) if offers(cache, SlotTableCache) else None


@runtime_checkable
class RouteStatsSink(Protocol):
    """Route-ahead bookkeeping (:class:`pdflash.routeahead.RouteAheadStats`):
    what was predicted against what the verify routed."""

    def update(
        self,
        predicted: npt.ArrayLike,
        routed: npt.ArrayLike,
        resident: npt.ArrayLike | None = None,
    ) -> None:
        """One verify step from ``(layers, experts)`` masks; ``resident`` is
        the cache's residency before the step."""
        ...

    def reset(self) -> None:
        """Forget every step recorded so far."""
        ...


@runtime_checkable
class HorizonPolicy(Protocol):
    """How far ahead to predict per request
    (:class:`pdflash.routeahead.AcceptanceHorizon`)."""

    def observe(self, request_id: int, acceptance_length: int) -> None:
        """Tokens the request's last verify committed."""
        ...

    def apply(self, block: DraftedBlock) -> DraftedBlock:
        """``block`` with its ``horizon`` set for its request."""
        ...

    def forget(self, request_id: int) -> None:
        """The request left; drop its history."""
        ...


@runtime_checkable
class PrefetchPlanner(Protocol):
    """The engine's one owner of expert prefetching
    (:class:`pdflash.engine.prefetch.ExpertPrefetcher`): route-ahead copies
    before a verify (one batch, or the streaming prefetcher's plan in layer
    order), next-layer gate lookahead during forwards, and BACKGROUND copies
    of the routing-frequency prior after a verify.

    The engine calls it at fixed points of a step, in this order:
    ``begin_forward`` (before every target forward), ``observe_routing``
    (after every target forward), ``on_predicted`` (the drafted blocks'
    predictions exist), ``before_verify`` (the batch is chosen),
    ``after_verify`` (the verify's routing is known) and ``background``.
    Every call is best-effort: a prefetch is an optimisation (a forward
    copies on demand what is missing), so a failure inside one is counted
    in ``failures`` and never raised. The planner keeps its own counters
    (``bytes_submitted`` per band, ``failures``); ``reset_stats`` zeroes
    them (and the counters of its parts) but keeps what it learned
    (routing prior, plan-source precision).
    """

    @property
    def bytes_submitted(self) -> dict[Band, int]:
        """Bytes of the copies it submitted, per band (ROUTE_AHEAD, BACKGROUND)."""
        ...

    @property
    def failures(self) -> int:
        """Prefetch calls that raised (no request was affected)."""
        ...

    def begin_forward(self) -> None: ...

    def observe_routing(self, routed: npt.NDArray[np.bool_]) -> None:
        """``(layers, experts)``: the experts a forward routed to."""
        ...

    def on_predicted(self, predicted: list[npt.NDArray[np.int64]]) -> None:
        """The route-ahead predictions (flat ids) of every request waiting
        for a verify, as soon as they exist."""
        ...

    def before_verify(
        self, batch_predicted: list[npt.NDArray[np.int64]], missing: npt.NDArray[np.int64]
    ) -> None:
        """The verify batch is chosen: its requests' predictions, and the
        scheduler's list of their predicted experts that are not resident."""
        ...

    def after_verify(
        self, routed: npt.NDArray[np.bool_], next_plan: npt.NDArray[np.bool_] | None
    ) -> None:
        """The verify routed ``routed``; ``next_plan`` is the routed set of
        the requests that go on (None when none does)."""
        ...

    def background(self) -> None:
        """After a verify: BACKGROUND copies with the step's bytes left."""
        ...

    def reset_stats(self) -> None: ...


# --------------------------------------------------------------------------
# Model adapters (pdflash.models): what predictors and the engine need from a
# real MoE architecture. ``num_layers`` counts MoE layers (the expert grid);
# an adapter whose model also has dense decoder layers implements
# :class:`DenseLayerAdapter` too (see :func:`decoder_layer_plan`).
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionSpec:
    """How one decoder layer's attention must be computed."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    sliding_window: int | None  # None: full causal attention
    has_sinks: bool  # gpt-oss learned attention sinks


@runtime_checkable
class MoEModelAdapter(Protocol):
    """One architecture's exact semantics, over weights it holds.

    All tensor arguments are 2-D ``[tokens, features]`` (no batch dim); the
    engine flattens batches into tokens and keeps per-request positions.
    """

    arch: str
    num_layers: int
    num_experts: int
    top_k: int
    hidden_size: int
    vocab_size: int
    expert_nbytes: int  # bytes of one packed expert (one H2D copy)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    def input_norm(self, layer: int, hidden: torch.Tensor) -> torch.Tensor: ...

    def attention_spec(self, layer: int) -> AttentionSpec: ...

    def project_qkv(
        self, layer: int, normed: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[T, heads, D]``, k and v ``[T, kv_heads, D]``, rotary and any
        q/k norms already applied."""
        ...

    def attention_sinks(self, layer: int) -> torch.Tensor | None: ...

    def project_out(self, layer: int, attn: torch.Tensor) -> torch.Tensor:
        """``[T, heads * D]`` -> ``[T, hidden]``."""
        ...

    def moe_norm(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """The norm applied before the router (post-attention norm)."""
        ...

    def router_logits(self, layer: int, normed: torch.Tensor) -> torch.Tensor:
        """``[T, num_experts]`` raw gate logits."""
        ...

    def route(self, layer: int, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact routing: top-k expert ids ``[T, k]`` (int64) and weights."""
        ...

    def moe(self, layer: int, normed: torch.Tensor) -> torch.Tensor:
        """The layer's MoE output ``[T, hidden]`` (offloaded or resident)."""
        ...

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class DenseLayerAdapter(Protocol):
    """An adapter whose model interleaves dense (non-MoE) decoder layers.

    Layer numbering: the attention methods of :class:`MoEModelAdapter`
    (``input_norm``, ``attention_spec``, ``project_qkv``, ``attention_sinks``,
    ``project_out``) take decoder layers ``0 .. num_decoder_layers - 1``; the
    MoE methods (``moe_norm``, ``router_logits``, ``route``, ``moe``) and
    the expert grid take MoE layers ``0 .. num_layers - 1``;
    ``moe_layers[m]`` is MoE layer ``m``'s decoder layer.
    """

    num_decoder_layers: int
    moe_layers: tuple[int, ...]

    def dense_mlp(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """Dense decoder layer ``layer``'s MLP output ``[T, hidden]`` for the
        residual ``hidden`` after its attention (its norm applied inside)."""
        ...


@runtime_checkable
class RoutedMoEAdapter(Protocol):
    """An adapter whose MoE layer takes a routing computed outside it (the
    target runner's, or a replayed trace's), so the router does not run
    twice (:meth:`pdflash.models.MoEAdapterBase.moe_routed`)."""

    def moe_routed(
        self,
        layer: int,
        normed: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        /,
    ) -> torch.Tensor:
        """MoE layer ``layer``'s output ``[T, hidden]`` under the routing
        ``ids`` / ``weights`` ``[T, k]``."""
        ...


def decoder_layer_plan(adapter: MoEModelAdapter) -> list[int | None]:
    """Per decoder layer: its MoE layer index, or None for a dense layer (an
    adapter that is not a :class:`DenseLayerAdapter` is all-MoE)."""
    if not isinstance(adapter, DenseLayerAdapter):
        return list(range(adapter.num_layers))
    plan: list[int | None] = [None] * int(adapter.num_decoder_layers)
    for m, d in enumerate(adapter.moe_layers):
        plan[d] = m
    return plan


# --------------------------------------------------------------------------
# Route-ahead predictors (pdflash.routeahead)
# --------------------------------------------------------------------------


@dataclass
class DraftedBlock:
    """A request's drafted verify block, as a predictor sees it."""

    request_id: int
    token_ids: torch.Tensor  # [B] anchor + drafted tokens
    positions: torch.Tensor  # [B]
    drafter_hidden: torch.Tensor | None = None  # [B, hidden] if the drafter exposes it
    horizon: int | None = None  # predict for the first `horizon` positions only


@runtime_checkable
class ExpertPredictor(Protocol):
    """Predicts the experts a verify pass will route to."""

    name: str

    def predict(self, block: DraftedBlock) -> npt.NDArray[np.float32]:
        """Scores ``[num_layers, num_experts]``; > 0 means predicted, larger
        means more confident (callers rank by it under a byte budget)."""
        ...

    def observe(self, request_id: int, routed: npt.NDArray[np.bool_]) -> None:
        """The experts the verify actually routed to, ``[num_layers, num_experts]``."""
        ...

    def forget(self, request_id: int) -> None:
        """The request left; drop per-request state."""
        ...


@runtime_checkable
class NextLayerPredictor(Protocol):
    """Predicts layer ``l + 1``'s experts inside a forward, once layer ``l``
    is done (the gate lookahead: :class:`pdflash.routeahead.NextLayerLookahead`
    runs the next router; :class:`pdflash.engine.replay.TraceLookahead`
    replays what a trained model's router predicted)."""

    def predict_next(
        self, layer: int, hidden: torch.Tensor
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
        """Flat expert ids of layer ``layer + 1``, most confident first, and
        their scores summed over the forward's rows (gate probabilities or
        top-k shares: ``EngineConfig.lookahead_score``), from
        the residual ``hidden`` ``[rows, hidden]`` after layer ``layer``;
        empty arrays after the last layer."""
        ...


def flat_expert_ids(mask: npt.NDArray[Any]) -> npt.NDArray[np.int64]:
    """Flat ids of a ``(layers, experts)`` expert set."""
    return np.flatnonzero(np.asarray(mask).reshape(-1)).astype(np.int64)


def checked_flat_ids(flat_ids: npt.ArrayLike, num_ids: int) -> npt.NDArray[np.int64]:
    """``flat_ids`` as a 1-D int64 array; ``ValueError`` naming the first id
    outside ``[0, num_ids)`` (the one expert-id check of the package)."""
    ids = np.asarray(flat_ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= num_ids):
        bad = ids[(ids < 0) | (ids >= num_ids)][0]
        raise ValueError(f"expert id {int(bad)} out of range [0, {num_ids})")
    return ids


def expert_mask(
    flat_ids: npt.ArrayLike, num_layers: int, num_experts: int
) -> npt.NDArray[np.bool_]:
    """The ``(layers, experts)`` mask of flat ids; raises on an id out of range."""
    total = num_layers * num_experts
    ids = checked_flat_ids(flat_ids, total)
    mask = np.zeros(total, dtype=np.bool_)
    mask[ids] = True
    return mask.reshape(num_layers, num_experts)
