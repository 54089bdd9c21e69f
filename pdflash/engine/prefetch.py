"""PD's route-ahead copy stream: the next-needed experts, in execution order.

In the link-bound regime (a small expert cache: a width-16 verify must copy
most of every layer's experts) the PCIe link is the critical resource, and
two things decide tokens/s: the bytes moved per forward and whether the link
ever idles while a forward still has misses ahead. :class:`StreamingPrefetcher`
keeps a *plan* — the experts the coming (or running) verify forward is
expected to route to, per layer — and submits ROUTE_AHEAD copies from it in
layer order, driven by the forward's own progress:

* **between forwards** (right after a verify, before and while the next
  block is drafted): the plan is the previous round's routed set of the
  requests, then the route-ahead prediction of the drafted blocks; the
  copies go out for the *first* layers (after a verify the cache holds the
  last layers' experts and the next verify starts at layer 0), so drafting
  hides them;
* **when layer l is routed** (its experts are about to be pinned): a few
  experts of the next layers (``ahead`` of them), so the link has work
  queued across the layer boundary;
* **when layer l is released**: layer l+1's experts, refined by next-layer
  gate lookahead (layer l+1's router over layer l's output).

Capacity-aware rules (why: a copy that evicts an expert the same forward
needs earlier is worse than no copy — it moves the evicted expert twice):

1. a copy for layer ``x`` never evicts an expert planned for any layer the
   forward reaches no later than ``x`` (``ExpertCache.prefetch(protect=)``);
   pinned and in-flight experts are never evicted anyway;
2. beyond the next layer the stream only runs ``ahead`` experts deep: under
   the layer-cyclic eviction policy the experts that stay resident from one
   forward to the next are hits in every forward, and each extra slot held
   by a copy far ahead costs one of them (one more copy per forward);
3. between forwards only the first planned layer's misses (plus ``ahead``)
   are copied: those evict what the on-demand path would evict when the
   verify reaches that layer, so hiding them behind drafting costs no bytes
   (likewise, in a forward, the next layer with misses).

Which experts are worth a copy (why: in the link-bound regime a copy of an
expert the forward does not route to costs as much link time as a useful
one, and evicts a useful one): the plan that *protects* experts is the union
of what is known, but copies are made only from the most precise source. The
stream measures, after every verify, the precision of each plan source
(``"prev_round"``: the previous round's routed set; ``"predicted"``: the
route-ahead predictor over the drafted blocks) against the routing that
followed, and copies before a forward only from the source with the best
running precision, and only while it is at least ``min_precision``. During the
forward, the next layer's copies come from the gate lookahead (experts whose
summed gate probability over the batch is at least ``lookahead_min_score``).
The lookahead's experts below that score (its tail) are protected but not
copied, unless ``tail_band`` is given: then they are copied in that band
(BACKGROUND: the issuer serves it only when no miss and no confident copy is
queued, so the tail takes link time nothing else wants; a tail expert the
forward needs is promoted to ON_DEMAND by the cache), and a tail copy that
has not started when its layer is routed and is not routed is given back
(:meth:`pdflash.cache.ExpertCache.give_back_unstarted`).

When a prediction is superseded, queued ROUTE_AHEAD copies of experts the
new plan no longer wants are cancelled (``issuer.cancel(Band.ROUTE_AHEAD)``;
the cache frees their slots) and the stream is re-issued in layer order.

With the hybrid miss service, experts it plans to compute on the host are
never copied ahead (``skip``). Where it splits the stream's own copies
(``host_split``, :mod:`pdflash.hybrid.service`, "Splitting the stream's
copies"), the gate lookahead's set for the next layer goes through that
split before any of it is copied: only its COPY part is.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch

from pdflash.models.offload import routed_ids_on_host
from pdflash.protocols import (
    Band,
    ExpertCacheView,
    MoEModelAdapter,
    NextLayerPredictor,
    TicketState,
    expert_mask,
    link_state_of,
)

if TYPE_CHECKING:
    from pdflash.engine.config import EngineConfig

IdArray = npt.NDArray[np.int64]


class StreamingPrefetcher:
    """Issues ROUTE_AHEAD copies of a forward's planned experts in layer order.

    Args:
        adapter: the target (``num_layers``, ``num_experts``; the router for
            next-layer lookahead).
        cache: the :class:`pdflash.cache.ExpertCache` (``prefetch(ids, band,
            protect=)``, ``resident_mask()``, ``free_capacity(protect)``).
        ahead: experts copied beyond the next layer's set (rule 2).
        lookahead: refine layer l+1's plan with its router over layer l's
            output when layer l is released.
        lookahead_min_score: copy a lookahead expert only if its summed gate
            probability over the forward's tokens reaches this; default
            ``0.6 / top_k``: about one token choosing it with 60% of an
            average top-k gate (on the small gpt-oss shape, CPU: lookahead
            precision 0.88 over every predicted expert, 0.95 above 0.16).
        min_precision: copy from a plan source before the forward only while
            its measured precision is at least this (0.7: on the small gpt-oss
            shape at a tight cache, copies from a 0.6-precise source added
            bytes without a measurable time gain).
        on_submit: called with the bytes of every batch of copies submitted.
        early_lookahead: also run the next-layer lookahead when a layer is
            routed, over its post-attention residual (see :meth:`on_routed`).
            Off by default: on the small gpt-oss shape (CPU, 1 GB/s emulated
            link, cache 0.2, c=1) it moved 534 MB / 624 MB vs 474 / 554 MB
            without it, with more of it wasted (a less precise guess).
        lookahead_predictor: what predicts layer l+1 for ``lookahead``
            (default: :class:`pdflash.routeahead.NextLayerLookahead`, the
            target's router; a trace replay passes
            :class:`pdflash.engine.replay.TraceLookahead`).
        tail_band: the band the lookahead's below-threshold experts are
            copied in (None: they are not copied; see the module doc).
        on_tail_submit: called with the bytes of every batch of tail copies.
    """

    SOURCES = ("prev_round", "predicted")

    def __init__(
        self,
        adapter: MoEModelAdapter,
        cache: ExpertCacheView,
        *,
        ahead: int = 2,
        lookahead: bool = True,
        lookahead_min_score: float | None = None,
        min_precision: float = 0.7,
        on_submit: Callable[[int], None] | None = None,
        early_lookahead: bool = False,
        lookahead_predictor: NextLayerPredictor | None = None,
        tail_band: Band | None = None,
        on_tail_submit: Callable[[int], None] | None = None,
    ) -> None:
        if ahead < 0:
            raise ValueError(f"ahead must be >= 0, got {ahead}")
        if not 0.0 <= min_precision <= 1.0:
            raise ValueError(f"min_precision must be in [0, 1], got {min_precision}")
        if lookahead_min_score is None:
            lookahead_min_score = 0.6 / max(1, int(getattr(adapter, "top_k", 1)))
        if not lookahead_min_score >= 0.0:
            raise ValueError(f"lookahead_min_score must be >= 0, got {lookahead_min_score}")
        self.adapter = adapter
        self.cache = cache
        self.num_layers = int(adapter.num_layers)
        self.num_experts = int(adapter.num_experts)
        self.ahead = int(ahead)
        self.lookahead_min_score = float(lookahead_min_score)
        self.min_precision = float(min_precision)
        self.on_submit = on_submit
        self.early_lookahead = bool(early_lookahead)
        self.tail_band = None if tail_band is None else Band(tail_band)
        self.on_tail_submit = on_tail_submit
        shape = (self.num_layers, self.num_experts)
        #: experts the forward is expected to need (protected from prefetch eviction)
        self.plan = np.zeros(shape, dtype=np.bool_)
        #: experts worth a copy (a subset of ``plan``)
        self.fetch = np.zeros(shape, dtype=np.bool_)
        #: the lookahead's below-threshold experts, copied in ``tail_band``
        #: (a subset of ``plan``, disjoint from ``fetch``; empty without one)
        self.tail = np.zeros(shape, dtype=np.bool_)
        #: per layer, the flat ids of the tail copies issued for it that its
        #: routing has not settled yet (see :meth:`on_routed`)
        self._tail_issued: dict[int, IdArray] = {}
        #: experts never copied ahead (the hybrid miss service plans to
        #: compute them on the host); they stay protected if planned
        self.skip = np.zeros(shape, dtype=np.bool_)
        #: the host split of a layer's gate-lookahead copies (None: no split,
        #: every lookahead expert worth a copy is copied): called with the
        #: layer, its non-resident fetch experts (local ids) and their
        #: expected tokens, it returns the mask of those the host computes
        self.host_split: (
            Callable[[int, IdArray, npt.NDArray[np.float64]], npt.NDArray[np.bool_]] | None
        ) = None
        #: lookahead layers that went through ``host_split``, and the experts
        #: it took from the copies
        self.host_split_layers = 0
        self.host_split_experts = 0
        self._source_plans: dict[str, npt.NDArray[np.bool_]] = {}
        #: running precision per plan source (None until measured)
        self.precision: dict[str, float | None] = dict.fromkeys(self.SOURCES)
        #: the first layer whose experts the forward still needs (0 between
        #: forwards: the next forward starts at layer 0)
        self.first_needed = 0
        #: the layer whose experts are pinned or about to be (None: none)
        self.running: int | None = None
        self._lookahead: NextLayerPredictor | None = None
        if lookahead:
            self._lookahead = lookahead_predictor or _router_lookahead(adapter)
        # counters
        self.copies_submitted = 0
        self.bytes_submitted = 0
        self.cancelled = 0  # queued ROUTE_AHEAD copies cancelled as stale
        self.tail_copies = 0  # tail copies submitted (tail_band)
        self.tail_given_back = 0  # ... given back unstarted and unrouted
        self.submit_log: list[tuple[int, int]] = []  # (first needed layer, flat id), if logging
        self.log_submissions = False
        #: switched off by :meth:`pause`: the forward hooks do nothing
        self.paused = False

    # ------------------------------------------------------------ plan
    def _mask(self, flat_ids: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        return expert_mask(flat_ids, self.num_layers, self.num_experts)

    def set_plan(
        self, flat_ids: npt.ArrayLike, source: str = "predicted", *, cancel_stale: bool = True
    ) -> None:
        """Set ``source``'s plan for the coming forward (flat expert ids) and
        (re)issue the stream. The protected plan is the union of the sources
        given since the last forward; copies come from the most precise one.
        Queued ROUTE_AHEAD copies the new fetch set does not want are
        cancelled (a superseded prediction's copies must not take the link or
        slots from the new one)."""
        if source not in self.SOURCES:
            raise ValueError(f"source must be one of {self.SOURCES}, got {source!r}")
        self._source_plans[source] = self._mask(flat_ids)
        plan = np.zeros_like(self.plan)
        for m in self._source_plans.values():
            plan |= m
        self.plan = plan
        self.fetch = self._fetch_of(self._source_plans)
        self._set_policy_prediction()
        if cancel_stale:
            self._cancel_stale()
        self.pump()

    def fetch_if(self, flat_ids: npt.ArrayLike, source: str = "predicted") -> npt.NDArray[np.bool_]:
        """The fetch set :meth:`set_plan` would give ``source``'s plan
        ``flat_ids`` (``(layers, experts)``), nothing set or issued: what the
        stream would copy for the coming forward."""
        if source not in self.SOURCES:
            raise ValueError(f"source must be one of {self.SOURCES}, got {source!r}")
        return self._fetch_of({**self._source_plans, source: self._mask(flat_ids)})

    def _fetch_of(self, plans: dict[str, npt.NDArray[np.bool_]]) -> npt.NDArray[np.bool_]:
        best = self._best_source(plans)
        return plans[best].copy() if best is not None else np.zeros_like(self.plan)

    def _best_source(self, plans: dict[str, npt.NDArray[np.bool_]]) -> str | None:
        """The source of ``plans`` with the best measured precision (an
        unmeasured source counts as ``min_precision``), if it reaches
        ``min_precision``."""
        best, best_p = None, -1.0
        for name in self.SOURCES:
            if name not in plans:
                continue
            p = self.precision[name]
            p = self.min_precision if p is None else p
            if p >= self.min_precision and p > best_p:
                best, best_p = name, p
        return best

    def _set_policy_prediction(self) -> None:
        setter = getattr(getattr(self.cache, "policy", None), "set_predicted", None)
        if setter is not None:
            setter(np.flatnonzero(self.plan.reshape(-1)).astype(np.int64))

    def _queued_route_ahead(self) -> IdArray:
        """Flat ids of this cache's ROUTE_AHEAD copies not started yet."""
        cache = self.cache
        slots = np.flatnonzero((cache.ticket >= 0) & (cache.band == int(Band.ROUTE_AHEAD)))
        states_fn = getattr(cache.issuer, "states", None)
        if slots.size == 0 or states_fn is None:
            return np.zeros(0, np.int64)
        states = np.asarray(states_fn(cache.ticket[slots]))
        queued = states == int(TicketState.QUEUED)
        return np.asarray(cache.expert_of[slots[queued]], dtype=np.int64)

    def _cancel_stale(self) -> None:
        if getattr(self.cache, "single_band", None) is not None:
            # NOTE: one FIFO band (the PD-one-band ablation): the issuer
            # cancels by band, so stale prefetches cannot be cancelled apart
            # from the on-demand copies queued in the same band
            return
        ids = self._queued_route_ahead()
        if ids.size == 0:
            return
        if self.fetch.reshape(-1)[ids].all():
            return
        # NOTE: the issuer cancels by band, so every queued ROUTE_AHEAD copy
        # goes; the cache frees their slots at its next refresh and pump()
        # re-issues the ones the new plan still wants, in layer order.
        n = int(self.cache.issuer.cancel(Band.ROUTE_AHEAD))
        self.cancelled += n
        self.cache.free_capacity()  # refresh: forget the cancelled copies

    # ------------------------------------------------------------ the stream
    def pump(self) -> int:
        """Submit the missing experts of the stream's target (see the module
        rules): the fetch set of the next layer that has one, then ``ahead``
        more in layer order. Idempotent: calling it again before the forward
        moves on submits nothing new. Returns how many were submitted."""
        nxt = self.first_needed if self.running is None else self.running + 1
        return self._issue(self._target(nxt, whole_first=True))

    def _target(self, first: int, *, whole_first: bool) -> IdArray:
        """Flat ids in layer order: (``whole_first``) every fetch expert of
        the first layer >= ``first`` that has any, then ``ahead`` more."""
        E = self.num_experts
        out: list[npt.NDArray[np.int64]] = []
        extra = self.ahead
        started = not whole_first
        for layer in range(first, self.num_layers):
            ids = np.flatnonzero(self.fetch[layer]).astype(np.int64) + layer * E
            if ids.size == 0:
                continue
            if not started:
                out.append(ids)
                started = True
                continue
            if extra <= 0:
                break
            out.append(ids[:extra])
            extra -= int(min(extra, ids.size))
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def _issue(
        self, target: IdArray, limit: int | None = None, band: Band = Band.ROUTE_AHEAD
    ) -> int:
        """Copy the non-resident ids of ``target`` (layer order), at most
        ``limit``, each only into a slot no earlier-needed expert holds, in
        ``band`` (ROUTE_AHEAD, or ``tail_band`` for the lookahead's tail)."""
        cache = self.cache
        E = self.num_experts
        if target.size == 0:
            return 0
        resident = np.asarray(cache.is_resident(target), dtype=np.bool_)
        want_all = target[~resident & ~self.skip.reshape(-1)[target]]
        if limit is not None:
            want_all = want_all[: max(0, limit)]
        submitted = 0
        layers = want_all // E
        for layer in np.unique(layers).tolist():
            want = want_all[layers == layer]
            # rule 1: protect everything planned for the layers the forward
            # reaches no later than this one (the running layer included)
            lo = self.first_needed
            protect = (
                np.flatnonzero(self.plan[lo : layer + 1].reshape(-1)).astype(np.int64) + lo * E
            )
            # NOTE: as the plain lookahead does, leave half of the usable
            # slots to the forward's own on-demand misses: with a tight cache
            # (a layer's routed set is half the slots at gpt-oss-20b shape,
            # cache 0.2) copies that fill every slot turn each misprediction
            # into an eviction of something needed
            room = int(cache.free_capacity(protect)) // 2
            if room <= 0:
                break
            take = want[:room]
            cache.prefetch(take, band, protect=protect)
            has_slot = np.asarray(cache.is_resident(take), dtype=np.bool_)  # in flight or landed
            got = int(has_slot.sum())
            submitted += got
            nbytes = got * int(cache.expert_nbytes)
            if band == Band.ROUTE_AHEAD:
                self.copies_submitted += got
                self.bytes_submitted += nbytes
                if self.on_submit is not None and got:
                    self.on_submit(nbytes)
            else:
                self.tail_copies += got
                issued = self._tail_issued.get(layer)
                new_ids = take[has_slot]
                self._tail_issued[layer] = (
                    new_ids if issued is None else np.concatenate([issued, new_ids])
                )
                if self.on_tail_submit is not None and got:
                    self.on_tail_submit(nbytes)
            if self.log_submissions:
                self.submit_log += [(lo, int(g)) for g in take[:got].tolist()]
            if got < want.size:
                break  # no safe slot for the rest: later layers must wait too
        return submitted

    # ------------------------------------------------------------ switching
    def pause(self) -> None:
        """Stop streaming (the PD controller switched it off): forget the
        plan (no expert stays protected for it) and ignore the forward's
        hooks until :meth:`resume`. Copies already issued complete."""
        self.paused = True
        self._source_plans = {}
        self.plan[:] = False
        self.fetch[:] = False
        self.tail[:] = False
        self._tail_issued = {}
        self.first_needed = 0
        self.running = None
        self._set_policy_prediction()

    def resume(self) -> None:
        """Stream again from the next plan (:meth:`set_plan`)."""
        self.paused = False

    # ------------------------------------------------------------ forward hooks
    def begin_forward(self) -> None:
        self.first_needed = 0
        self.running = None

    def on_routed(
        self, layer: int, topk_ids: torch.Tensor, hidden: torch.Tensor | None = None
    ) -> None:
        """Layer ``layer``'s exact routing is known (its experts are about to
        be pinned): the plan of this layer becomes exact; queue ``ahead``
        experts of the next layers so the link has work across the boundary.
        With ``early_lookahead`` and ``hidden`` (the residual after this
        layer's attention), layer+1's router over it (this layer's expert
        output not yet added) sets layer+1's plan now and its confident
        experts are queued too, a whole layer's compute earlier than the
        lookahead at release."""
        if self.paused:
            return
        self.running = int(layer)
        self.first_needed = int(layer)
        # the offloaded block reads this same routing next: one host sync for both
        ids = np.unique(routed_ids_on_host(topk_ids))
        self.plan[layer] = False
        self.plan[layer, ids] = True
        self.fetch[layer] = self.plan[layer]
        self.tail[layer] = False
        self._give_back_tail(layer, ids)
        nxt = layer + 1
        if nxt >= self.num_layers:
            return
        early = False
        if self.early_lookahead and self._lookahead is not None and hidden is not None:
            self._apply_lookahead(layer, hidden)
            early = True
        if self.ahead <= 0 and not early:
            return
        cache = self.cache
        flat = (ids + layer * self.num_experts).astype(np.int64)
        # keep room for this layer's own on-demand misses
        own_missing = int((~np.asarray(cache.is_resident(flat), dtype=np.bool_)).sum())
        spare = int(cache.free_capacity(flat)) - own_missing
        if spare > 0:
            self._issue(self._target(nxt, whole_first=early), limit=spare)

    def _give_back_tail(self, layer: int, routed: IdArray) -> None:
        """Layer ``layer`` is routed (local ids ``routed``): give back its
        tail copies that have not started and that it does not route (a
        routed one stays: the forward's acquire promotes it)."""
        issued = self._tail_issued.pop(layer, None)
        if issued is None or issued.size == 0:
            return
        unused = issued[~np.isin(issued - layer * self.num_experts, routed)]
        give_back = getattr(self.cache, "give_back_unstarted", None)
        if unused.size and give_back is not None:
            self.tail_given_back += int(np.asarray(give_back(unused), dtype=np.bool_).sum())

    def _apply_lookahead(self, layer: int, hidden: torch.Tensor) -> None:
        assert self._lookahead is not None
        nxt = layer + 1
        ids, scores = self._lookahead.predict_next(layer, hidden)
        if ids.size:
            # NOTE: the gate lookahead sees this forward's real hidden state:
            # it replaces the route-ahead guess for layer l+1 (a union of the
            # two moved more bytes that went unused); its low-score tail is
            # protected, and copied only in tail_band (else the on-demand
            # path fetches it if it is routed)
            local = ids - nxt * self.num_experts
            self.plan[nxt] = False
            self.plan[nxt, local] = True
            self.fetch[nxt] = False
            confident = scores >= self.lookahead_min_score
            self.fetch[nxt, local[confident]] = True
            self.tail[nxt] = False
            if self.tail_band is not None:
                self.tail[nxt, local[~confident]] = True
            if self.host_split is not None:
                self._split_lookahead(nxt, ids[confident], scores[confident])

    def _split_lookahead(self, layer: int, ids: IdArray, scores: npt.NDArray[np.float32]) -> None:
        """Layer ``layer``'s lookahead copies through the host split: its
        non-resident fetch experts, each expected to get ``score x top_k``
        tokens (a score sums the gate probabilities of the top-k choices
        over the forward's tokens, ~1/top_k a token that picks the expert);
        the split's HOST part is skipped, the rest copied."""
        assert self.host_split is not None
        self.skip[layer] = False
        missing = ~np.asarray(self.cache.is_resident(ids), dtype=np.bool_)
        if not missing.any():
            return
        local = ids[missing] - layer * self.num_experts
        top_k = max(1, int(getattr(self.adapter, "top_k", 1)))
        expected = np.asarray(scores[missing], dtype=np.float64) * top_k
        host = np.asarray(self.host_split(layer, local, expected), dtype=np.bool_)
        self.skip[layer, local[host]] = True
        self.host_split_layers += 1
        self.host_split_experts += int(host.sum())

    def after_layer(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor) -> None:
        """Layer ``layer`` is released: refine layer+1's plan with next-layer
        lookahead and copy its misses (they evict what the on-demand path
        would evict a moment later: layer ``layer``'s experts)."""
        if self.paused:
            return
        self.running = None
        nxt = layer + 1
        self.first_needed = nxt
        if nxt >= self.num_layers:
            self.first_needed = 0  # the forward is done; the next one starts at layer 0
            return
        if self._lookahead is not None:
            self._apply_lookahead(layer, hidden)
        self.pump()
        if self.tail_band is not None:
            # after the confident copies: the tail gets only the slots they left
            tail = np.flatnonzero(self.tail[nxt]).astype(np.int64) + nxt * self.num_experts
            self._issue(tail, band=self.tail_band)

    def end_forward(
        self,
        routed: npt.NDArray[np.bool_] | None = None,
        next_plan: npt.NDArray[np.bool_] | None = None,
    ) -> None:
        """The forward finished. ``routed`` (``[layers, experts]``, the
        forward's routed union) scores the plan sources that were given for
        it; ``next_plan`` (the routed set of the requests that go on) becomes
        the next forward's ``prev_round`` plan, and its first layers' copies
        start now, before drafting (rule 3)."""
        self.first_needed = 0
        self.running = None
        self.tail[:] = False
        self._tail_issued = {}
        if routed is not None:
            r = np.asarray(routed, dtype=np.bool_).reshape(self.plan.shape)
            for name, m in self._source_plans.items():
                n = int(m.sum())
                if n == 0:
                    continue
                p = float((m & r).sum()) / n
                old = self.precision[name]
                # NOTE: a short memory (EMA, weight 0.3 on the newest forward)
                self.precision[name] = p if old is None else 0.7 * old + 0.3 * p
        self._source_plans = {}
        if next_plan is not None:
            self.set_plan(
                np.flatnonzero(np.asarray(next_plan, dtype=np.bool_).reshape(-1)), "prev_round"
            )
        else:
            self.plan[:] = False
            self.fetch[:] = False

    def stats(self) -> dict[str, Any]:
        return {
            "stream_copies": self.copies_submitted,
            "stream_bytes": self.bytes_submitted,
            "stream_cancelled": self.cancelled,
            # the lookahead's tail copies (tail_band) and those given back
            "stream_tail_copies": self.tail_copies,
            "stream_tail_given_back": self.tail_given_back,
            "stream_precision": dict(self.precision),
            # the lookahead's layers split for the host, and the experts the
            # host took from their copies
            "stream_host_split_layers": self.host_split_layers,
            "stream_host_split_experts": self.host_split_experts,
        }


def _router_lookahead(adapter: MoEModelAdapter, score: str = "prob") -> NextLayerPredictor:
    from pdflash.routeahead import NextLayerLookahead

    return NextLayerLookahead(adapter, score=score)


class GateLookahead:
    """Next-layer gate lookahead without the stream: ``predictor`` (default:
    layer l+1's router over layer l's output,
    :class:`pdflash.routeahead.NextLayerLookahead`) predicts l+1's experts;
    the missing ones are prefetched ROUTE_AHEAD while layer l finishes.
    ``on_submit`` gets the bytes of every batch of copies."""

    def __init__(
        self,
        adapter: MoEModelAdapter,
        cache: ExpertCacheView,
        on_submit: Callable[[int], None] | None = None,
        predictor: NextLayerPredictor | None = None,
    ) -> None:
        self.adapter = adapter
        self.cache = cache
        self.on_submit = on_submit
        self.predictor = predictor or _router_lookahead(adapter)

    def after_layer(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor) -> None:
        cache = self.cache
        if layer + 1 >= self.adapter.num_layers:
            return
        ids, _ = self.predictor.predict_next(layer, hidden)
        if ids.size == 0:
            return
        missing = ids[~np.asarray(cache.is_resident(ids), dtype=np.bool_)]
        # NOTE: most confident first; keep half the usable slots for on-demand misses
        missing = missing[: max(0, int(cache.free_capacity()) // 2)]
        if missing.size:
            if self.on_submit is not None:
                self.on_submit(int(missing.size) * int(cache.expert_nbytes))
            cache.prefetch(missing, Band.ROUTE_AHEAD)


class _WhileStreamOff:
    """Forward hooks of a gate lookahead that run only while the planner's
    streaming prefetcher is switched off."""

    def __init__(self, planner: ExpertPrefetcher, inner: GateLookahead) -> None:
        self.planner = planner
        self.inner = inner

    @property
    def paused(self) -> bool:
        """While the stream runs, these hooks have nothing to do."""
        return self.planner.stream is not None

    def after_layer(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor) -> None:
        if not self.paused:
            self.inner.after_layer(layer, hidden, topk_ids)

    def on_routed(self, layer: int, topk_ids: torch.Tensor, hidden: torch.Tensor) -> None:
        return None


class _BestEffortHooks:
    """Runs a prefetcher's forward hooks so that their failure only counts in
    the planner's ``failures`` (a forward copies on demand whatever a
    prefetch did not bring), their host time in its ``forward_hooks``
    stage. A prefetcher whose ``paused`` is true is not called at all: it
    would ignore the hook, and the books would time the call."""

    def __init__(self, planner: ExpertPrefetcher, inner: Any) -> None:
        self.planner = planner
        self.inner = inner

    def after_layer(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor) -> None:
        if getattr(self.inner, "paused", False):
            return  # a paused prefetcher ignores its hooks: nothing to run or time
        self.planner._timed("forward_hooks", self.inner.after_layer, layer, hidden, topk_ids)

    def on_routed(self, layer: int, topk_ids: torch.Tensor, hidden: torch.Tensor) -> None:
        if getattr(self.inner, "paused", False):
            return
        # NOTE: the routing's host read (a device sync) before the clock:
        # the offloaded block reads it next anyway (the same read, kept),
        # so the wait is the forward's, not the hook's own time
        try:
            routed_ids_on_host(topk_ids)
        except Exception:
            self.planner.failures += 1
            return
        self.planner._timed("forward_hooks", self.inner.on_routed, layer, topk_ids, hidden)


def _union(parts: list[IdArray]) -> IdArray:
    parts = [p for p in parts if p is not None and p.size]
    return np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)


class ExpertPrefetcher:
    """The engine's prefetch planner (:class:`~pdflash.protocols.PrefetchPlanner`):
    every expert copy the engine starts ahead of need goes through it.

    Its parts, chosen by the :class:`~pdflash.engine.config.EngineConfig`:

    * ``streaming_prefetch``: a :class:`StreamingPrefetcher` (route-ahead in
      layer order from drafting on, gate lookahead inside the forward);
    * else ``route_ahead``: one batch of ROUTE_AHEAD copies of the batch's
      predicted missing experts before the verify; and ``lookahead``: a
      :class:`GateLookahead` inside forwards;
    * ``background_prefetch``: after a verify, BACKGROUND copies of the most
      frequently routed missing experts with the step's byte budget left.

    Without an expert cache (resident experts) every call is a no-op.

    Args:
        adapter: the target (its shape; the router for lookahead).
        cache: the expert cache, or None.
        config: the engine's configuration.
        lookahead_predictor: what predicts the next layer for the gate
            lookahead (None: the target's router; a trace replay passes
            :class:`pdflash.engine.replay.TraceLookahead`).
    """

    #: a short-memory prior: each forward's routing enters with weight 1 and
    #: the past decays by this factor (half-life ~7 forwards)
    ROUTE_FREQ_DECAY = 0.9

    def __init__(
        self,
        adapter: MoEModelAdapter,
        cache: ExpertCacheView | None,
        config: EngineConfig,
        lookahead_predictor: NextLayerPredictor | None = None,
    ) -> None:
        self.adapter = adapter
        self.cache = cache
        self.config = config
        #: where the gate lookahead's predictions come from (rows record it)
        self.lookahead_source = "router" if lookahead_predictor is None else "trace"
        self.route_ahead = bool(config.route_ahead and cache is not None)
        self.background_enabled = bool(config.background_prefetch and cache is not None)
        self.stream: StreamingPrefetcher | None = None
        self.lookahead: GateLookahead | None = None
        if cache is not None and config.streaming_prefetch:
            self.stream = StreamingPrefetcher(
                adapter,
                cache,
                ahead=config.stream_ahead,
                lookahead=config.lookahead,
                lookahead_min_score=config.stream_lookahead_min_score,
                on_submit=self._count_route_ahead,
                lookahead_predictor=lookahead_predictor
                or _router_lookahead(adapter, config.lookahead_predictor_score),
                tail_band=Band.BACKGROUND if config.lookahead_tail == "background" else None,
                on_tail_submit=self._count_background,
            )
        elif cache is not None and config.lookahead:
            self.lookahead = GateLookahead(
                adapter, cache, on_submit=self._count_route_ahead, predictor=lookahead_predictor
            )
        # the parts this planner was built with; set_parts switches within them
        self._built_route_ahead = self.route_ahead
        #: the streaming prefetcher it was built with (``stream`` is None while
        #: set_parts has it switched off; its books stay here)
        self.built_stream = self.stream
        # with the stream switched off (set_parts), the plain gate lookahead
        # runs instead, as in PD-no-stream; idle while the stream runs
        self._fallback_lookahead: GateLookahead | None = None
        if cache is not None and self.stream is not None and config.lookahead:
            self._fallback_lookahead = GateLookahead(
                adapter, cache, on_submit=self._count_route_ahead, predictor=lookahead_predictor
            )
        #: host seconds spent per prefetch stage: "route_ahead" (the copies
        #: issued before a verify), "stream_plan" (the stream's plans, from
        #: the predictions and after a verify), "forward_hooks" (whichever
        #: prefetcher's hooks run inside the forward: the stream's or the
        #: gate lookahead's), "background_prefetch"
        self.stage_s: dict[str, float] = {}
        #: the routing-frequency prior of the background copies, ``(layers, experts)``
        self.route_freq = np.zeros((adapter.num_layers, adapter.num_experts), dtype=np.float64)
        self._bytes = {Band.ROUTE_AHEAD: 0, Band.BACKGROUND: 0}
        self.failures = 0
        # route-ahead bytes of this step's before_verify (the background
        # budget's share already used)
        self._step_route_ahead_bytes = 0
        # the stream's "predicted" plan set this forward (see before_verify)
        self._planned: IdArray | None = None

    # ------------------------------------------------------------ counters
    @property
    def bytes_submitted(self) -> dict[Band, int]:
        return self._bytes

    def _count_route_ahead(self, nbytes: int) -> None:
        self._bytes[Band.ROUTE_AHEAD] += int(nbytes)

    def _count_background(self, nbytes: int) -> None:
        self._bytes[Band.BACKGROUND] += int(nbytes)

    def reset_stats(self) -> None:
        self._bytes = {Band.ROUTE_AHEAD: 0, Band.BACKGROUND: 0}
        self.failures = 0
        self.stage_s.clear()
        stream = self.built_stream
        if stream is not None:
            stream.copies_submitted = stream.bytes_submitted = 0
            stream.cancelled = 0
            stream.tail_copies = stream.tail_given_back = 0
            stream.host_split_layers = stream.host_split_experts = 0

    def _best_effort(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            self.failures += 1

    def _timed(self, stage: str, fn: Callable[..., None], *args: Any) -> None:
        t0 = time.perf_counter()
        try:
            self._best_effort(fn, *args)
        finally:
            self.stage_s[stage] = self.stage_s.get(stage, 0.0) + time.perf_counter() - t0

    # ------------------------------------------------------------ switching
    def set_parts(self, *, route_ahead: bool, stream: bool) -> None:
        """Switch route-ahead and the streaming prefetcher at run time (the
        PD controller); a part the planner was not built with stays off. With
        the stream off, route-ahead is one batch of copies before the verify
        (PD-no-stream); without route-ahead nothing is copied ahead."""
        self.route_ahead = bool(route_ahead and self._built_route_ahead)
        built = self.built_stream
        on = bool(stream and self.route_ahead and built is not None)
        if built is not None:
            if on:
                built.resume()
            else:
                built.pause()
        self.stream = built if on else None

    # ------------------------------------------------------------ wiring
    def install(self, runner: Any) -> None:
        """Register the forward hooks (gate lookahead, the stream's layer
        hooks) on a :class:`~pdflash.engine.target.TargetRunner`. Call after
        the eviction policy's ``before_layer`` hook is registered, so the
        stream's victims are ranked from the layer about to run."""
        if self.lookahead is not None:
            runner.observers.append(_BestEffortHooks(self, self.lookahead))
        if self._fallback_lookahead is not None:
            runner.observers.append(
                _BestEffortHooks(self, _WhileStreamOff(self, self._fallback_lookahead))
            )
        if self.stream is not None:
            hooks = _BestEffortHooks(self, self.stream)
            runner.routed_hooks.append(hooks.on_routed)
            runner.observers.append(hooks)

    def set_host_planned(
        self,
        mask: npt.NDArray[np.bool_] | None,
        split: Callable[[int, IdArray, npt.NDArray[np.float64]], npt.NDArray[np.bool_]]
        | None = None,
    ) -> None:
        """Experts the hybrid miss service plans to compute on the host in
        the coming verify (``(layers, experts)``, None: none): never copied
        ahead. ``split``: the stream's gate lookahead splits each next
        layer's copies through it (:attr:`StreamingPrefetcher.host_split`;
        None: it copies them all)."""
        stream = self.built_stream
        if stream is None:
            return
        stream.host_split = split
        if mask is None:
            stream.skip[:] = False
        else:
            # its own copy: the lookahead's splits rewrite its rows
            stream.skip = np.array(mask, dtype=np.bool_)

    def stream_fetch_if(self, predicted: list[IdArray]) -> npt.NDArray[np.bool_] | None:
        """What the running stream would copy for the coming forward once
        ``predicted`` (the requests' route-ahead predictions) is its
        ``predicted`` plan (:meth:`StreamingPrefetcher.fetch_if`); None: no
        stream runs."""
        if self.stream is None:
            return None
        return self.stream.fetch_if(_union(predicted))

    def load_every_expert(self) -> None:
        """B3 (``all_resident``): every expert resident before the first
        request (blocking; not counted as prefetch bytes). Raises
        ``ValueError`` when the cache cannot hold them all."""
        cache = self.cache
        assert cache is not None
        total = self.adapter.num_layers * self.adapter.num_experts
        if int(cache.num_slots) < total:
            raise ValueError(
                f"baseline {self.config.baseline!r} keeps every expert resident: the expert "
                f"cache has {cache.num_slots} slots for {total} experts"
            )
        tickets = np.asarray(cache.prefetch(np.arange(total, dtype=np.int64), Band.BACKGROUND))
        cache.issuer.wait(tickets[tickets >= 0])

    # ------------------------------------------------------------ the step
    def begin_forward(self) -> None:
        self._planned = None
        if self.stream is not None:
            self.stream.begin_forward()

    def observe_routing(self, routed: npt.NDArray[np.bool_]) -> None:
        self.route_freq *= self.ROUTE_FREQ_DECAY
        self.route_freq += routed

    def on_predicted(self, predicted: list[IdArray]) -> None:
        if self.stream is None or not predicted:
            return
        plan = np.unique(np.concatenate(predicted))
        self._timed("stream_plan", self.stream.set_plan, plan, "predicted")
        self._planned = plan

    def before_verify(self, batch_predicted: list[IdArray], missing: IdArray) -> None:
        if not self.route_ahead:
            return
        self._timed("route_ahead", self._before_verify, batch_predicted, missing)

    def _before_verify(self, batch_predicted: list[IdArray], missing: IdArray) -> None:
        cache = self.cache
        assert cache is not None
        if self.stream is not None:
            # NOTE: the scheduler's missing list is not used here: the stream
            # finds the missing experts of its plan itself, at issue time and
            # in layer order, under its capacity rules (module docstring), and
            # skips the ones planned for the host.
            plan = _union(batch_predicted)
            before = self.stream.bytes_submitted
            if self._planned is not None and np.array_equal(plan, self._planned):
                # the batch is every request on_predicted planned for: the
                # plan stands (set once this step); copy what has room now
                self.stream.pump()
            else:
                # the scheduler deferred some requests (or nothing was
                # planned this step): the plan becomes the batch's
                self.stream.set_plan(plan, "predicted")
                self._planned = plan
            self._step_route_ahead_bytes = self.stream.bytes_submitted - before
            return
        ids = missing
        if ids.size == 0:
            if not any(p is not None and p.size for p in batch_predicted):
                return
            ids = _union(batch_predicted)
            ids = ids[~np.asarray(cache.is_resident(ids), dtype=np.bool_)]
        # NOTE: in-flight copies cannot be evicted, and a forward needs free or
        # evictable slots for its on-demand misses: never put more than half of
        # the slots a forward could use into flight. Flat ids are in layer
        # order, so the earliest layers (needed first) go first.
        ids = ids[: max(0, int(cache.free_capacity()) // 2)]
        if hasattr(getattr(cache, "policy", None), "set_predicted"):
            cache.set_predicted(_union(batch_predicted))
        if ids.size:
            self._step_route_ahead_bytes = int(ids.size) * int(cache.expert_nbytes)
            self._bytes[Band.ROUTE_AHEAD] += self._step_route_ahead_bytes
            cache.prefetch(ids, Band.ROUTE_AHEAD)

    def after_verify(
        self, routed: npt.NDArray[np.bool_], next_plan: npt.NDArray[np.bool_] | None
    ) -> None:
        self._planned = None
        if self.stream is not None:
            # NOTE: the next verify starts at layer 0 while the cache holds the
            # last layers' experts: plan it from this round's routed set of the
            # requests that go on (previous-round predictor) and start its
            # first layers' copies now, so they run while the next blocks are
            # drafted.
            self._timed("stream_plan", self.stream.end_forward, routed, next_plan)

    def byte_budget(self) -> int:
        """Missing expert bytes per step (``M``): the configured value, else
        half the expert cache (so a batch's copies never thrash the cache)."""
        if self.config.byte_budget is not None:
            return self.config.byte_budget
        if self.cache is None:
            return 0
        return int(self.cache.num_slots) * int(self.cache.expert_nbytes) // 2

    def background(self) -> None:
        if not self.background_enabled:
            return
        if self._cache_full():
            # no empty slot, no background copy (:meth:`_background`): the
            # common case once the cache is warm returns before the timing
            self._step_route_ahead_bytes = 0
            return
        self._timed("background_prefetch", self._background)

    def _cache_full(self) -> bool:
        """Whether the cache's per-slot table shows no empty slot (False
        where it cannot be read: :meth:`_background` decides)."""
        expert_of = getattr(self.cache, "expert_of", None)
        return (
            isinstance(expert_of, np.ndarray) and expert_of.size > 0 and bool(expert_of.min() >= 0)
        )

    def _background(self) -> None:
        """BACKGROUND copies of the most frequently routed missing experts,
        with the step's byte budget left after route-ahead.

        NOTE: only while the link is idle (nothing queued or in flight) and
        only into empty slots: in a link-bound run a background copy would
        delay the next verify's misses and evict experts it needs
        (frequency-prior copies into a full cache were mostly evicted unused).
        """
        cache = self.cache
        assert cache is not None
        used = self._step_route_ahead_bytes
        self._step_route_ahead_bytes = 0
        left = self.byte_budget() - used
        nbytes = int(cache.expert_nbytes)
        # the empty slots from the per-slot table (a full cache, the common
        # case, returns here without building the expert grid's mask)
        empty = int(np.count_nonzero(cache.expert_of < 0))
        n = min(left // nbytes if nbytes else 0, empty)
        if n <= 0 or not self._link_idle():
            return
        resident = np.asarray(cache.resident_mask(), dtype=np.bool_).reshape(-1)
        freq = self.route_freq.reshape(-1).copy()
        freq[resident] = 0.0
        order = np.argsort(-freq, kind="stable")
        pick = order[: int(n)]
        pick = pick[freq[pick] > 0]
        if pick.size:
            self._bytes[Band.BACKGROUND] += int(pick.size) * nbytes
            cache.prefetch(pick.astype(np.int64), Band.BACKGROUND)

    def _link_idle(self) -> bool:
        state = link_state_of(getattr(self.cache, "issuer", None))
        return state is None or state.idle

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "route_ahead_bytes_submitted": self._bytes[Band.ROUTE_AHEAD],
            "background_bytes_submitted": self._bytes[Band.BACKGROUND],
            "prefetch_failures": self.failures,
        }
        if self.built_stream is not None:
            out.update(self.built_stream.stats())
        return out


if TYPE_CHECKING:
    from pdflash.protocols import PrefetchPlanner

    # mypy: an ExpertPrefetcher is a PrefetchPlanner
    def _is_planner(planner: ExpertPrefetcher) -> PrefetchPlanner:
        return planner
