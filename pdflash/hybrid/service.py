"""Hybrid miss service: the hook the offloaded MoE block calls, and its books.

:class:`HostExpertService` joins a :class:`~pdflash.hybrid.planner.MissPlanner`
and a :class:`~pdflash.hybrid.executor.HostExpertExecutor`. The offloaded
block calls it at one point per layer, right after the layer's routing is on
the host (the block's one host sync):

* :meth:`HostExpertService.split` — which of the layer's routed experts the
  host computes: the planner sees the non-resident ones (an expert with a
  slot, its copy landed or in flight, is never HOST: its bytes are paid;
  with :attr:`HostExpertService.host_queued` also those whose copy is still
  queued, given back where hosted), their token counts, and the link's
  state (this layer's own in-flight copies, the run's link rate; with
  :attr:`HostExpertService.critical_path` also the forward's measured terms
  of :class:`ForwardClock`);
* :meth:`HostExpertService.start` — those experts' rows go to the host and
  the pool starts on them; the block then pins, copies and computes the
  other experts on the device;
* :meth:`HostExpertService.finish` — the block's last step before its
  weighted sum: the host's output, copied back on the compute stream; the
  job's measured compute goes to the planner's ``observe`` where it is an
  :class:`~pdflash.hybrid.planner.ObservingMissPlanner` (checked once, when
  the planner is set; :class:`~pdflash.hybrid.planner.CostModelPlanner`
  corrects its host cost from it). With the ``stream`` hand-off
  (:mod:`pdflash.hybrid.handoff`, :meth:`HostExpertService.set_handoff`)
  :meth:`HostExpertService.finish_on_stream` instead: the forward's thread
  enqueues a device wait for the job, the upload and the add, and goes on;
  the job's books are taken once it is done (at a later layer, or
  :meth:`HostExpertService.settle`, which the engine calls after each
  forward and which raises if a job failed).

Before a verify, :meth:`HostExpertService.plan_ahead` turns the route-ahead
prediction into the experts expected to be HOST; the engine then leaves them
out of the stream's ROUTE_AHEAD copies and tells the verify scheduler they
cost no link bytes (see :class:`pdflash.engine.Engine`).

Splitting the stream's copies (:attr:`HostExpertService.ahead_from`). A
layer's plan sees as misses only the routed experts that hold no slot: every
copy the streaming prefetcher already issued for the layer is sunk by then.
With ``predicted`` (the default) the ahead plan splits the route-ahead
prediction only, while the stream copies from its most precise source (often
the previous round's routed set) and, during the forward, the gate
lookahead's set for the next layer: most of the link's bytes where it binds
(``bench/results/cpu/hostshare-2026-12-02/README.md``) never reach a plan.
With ``stream`` the candidates of each layer are what the stream would copy:

* before the verify, the ahead plan's candidates are the prediction's
  experts and the stream's fetch set for the coming forward
  (:meth:`pdflash.engine.prefetch.StreamingPrefetcher.fetch_if`; an expert
  only in the fetch set expects the mean share of the layer's predicted
  experts, at least one token), split by the same makespan rule;
* during the forward, when layer ``l`` is released the gate lookahead's
  set for layer ``l + 1`` (its non-resident experts above the copy
  threshold, each expecting ``score x top_k`` tokens) is split again
  (:meth:`HostExpertService.plan_lookahead`, the planner's ahead rule over
  that one layer) and replaces that layer's HOST set;
* the stream copies only the COPY part (its ``skip``).

Only where the pre-verify plan runs (the engine plans ahead while forwards
wait for misses) and the streaming prefetcher is on; otherwise ``stream``
plans as ``predicted``.

Correct by construction either way: a HOST-planned expert is only not
copied ahead; the layer's own plan, at its routing, still decides every
routed expert with no slot (an expert planned HOST but not routed costs the
plan only; one routed but not planned is today's miss).

The books (:class:`HostBooks`): HOST-served experts cost CPU time, not link
bytes.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

from pdflash.hybrid.affinity import HostPlacement, PlacedThreads
from pdflash.hybrid.cost import HostCostModel
from pdflash.hybrid.executor import HostExpertExecutor, HostJob
from pdflash.hybrid.handoff import (
    DEFAULT_TIMEOUT_S,
    HANDOFF_CHOICES,
    HostHandoffError,
    StreamSignals,
    stream_unavailable,
)
from pdflash.hybrid.planner import (
    AccountingMissPlanner,
    AheadObservingMissPlanner,
    LinkState,
    MissPlanner,
    ObservingMissPlanner,
    ReportingMissPlanner,
)

IdArray = npt.NDArray[np.int64]


class HostWaitTimer(Protocol):
    """What the service needs of the engine's timer
    (:class:`~pdflash.engine.timing.ComputeTimer`): a context that times the
    forward's wait for the host's results."""

    def host_wait(self) -> AbstractContextManager[Any]: ...


def busy_union_s(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total = 0.0
    end = -np.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return float(total)


@dataclass
class _LayerMark:
    """The forward thread's marks of one layer with misses."""

    layer: int
    resumed_at: float  # the thread left the layer's routing read
    hosted: bool = False
    host_wait_s: float = 0.0
    overhead_s: float = 0.0
    first_sync: float | None = None  # the thread's next possible wait on the device


@dataclass
class ForwardClock:
    """The forward thread's per-layer times, measured, for the planner's
    critical-path terms (:class:`~pdflash.hybrid.planner.LinkState`).

    Per layer with misses the service gets the end of its routing read (a
    host sync: the thread waited for the device there). From then until the
    thread's next point that may wait on the device (:meth:`sync`: the
    verify loop marks its next-layer lookahead and the next layer's routing
    read; without marks, the next routing read itself), less what the
    layer's HOST part took on the thread (its own dispatch and its wait for
    the host), is the layer's *dispatch*: the time its copies run hidden.
    Kept over the last ``window`` layers of a forward (a gap across forwards
    is not a dispatch), as medians (one slow layer moves nothing):

    * ``hidden_s``: the median dispatch after layers without a HOST part
      (all layers while fewer than ``min_samples`` of those);
    * ``host_overhead_s``: the median of a HOST part's own forward-thread
      time (the rows' gather, the submit, the result's collection), plus the
      median dispatch after a HOST part less that after none, where positive
      (what hosting slows the rest of the thread's work: the masked device
      calls, the cores it shares with the pool), once each side has
      ``min_samples``;
    * ``host_lead_s``: the median time from a HOST job's start to the
      thread asking for its result.

    Each is 0 until it has ``min_samples`` samples (the planner's cost is
    then the plain makespan). Where every layer hosts, no dispatch without a
    HOST part would be measured: :meth:`wants_copy_sample` asks the service
    to copy one layer in ``sample_every`` until the window holds
    ``min_samples`` of them.
    """

    window: int = 64
    min_samples: int = 4
    sample_every: int = 4
    _dispatch: deque[tuple[float, bool]] = field(default_factory=deque, repr=False)
    _overhead: deque[float] = field(default_factory=deque, repr=False)
    _lead: deque[float] = field(default_factory=deque, repr=False)
    _last: _LayerMark | None = field(default=None, repr=False)
    _since_sample: int = field(default=0, repr=False)
    #: the terms as last computed, until a sample changes (a planner reads
    #: them on every layer with misses; they change at most once a layer)
    _terms: tuple[float, float, float] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.window < 1 or self.min_samples < 1 or self.sample_every < 1:
            raise ValueError(
                "need window, min_samples and sample_every >= 1, got "
                f"{self.window}, {self.min_samples}, {self.sample_every}"
            )
        self._dispatch = deque(maxlen=self.window)
        self._overhead = deque(maxlen=self.window)
        self._lead = deque(maxlen=self.window)

    def sync(self, at: float) -> None:
        """The forward thread may wait on the device from ``at`` on (the
        first such point after a layer's routing read ends its dispatch)."""
        last = self._last
        if last is not None and last.first_sync is None and at >= last.resumed_at:
            last.first_sync = at

    def routed(self, layer: int, started: float, ended: float) -> None:
        """Layer ``layer``'s routing read ran from ``started`` to ``ended``
        (perf_counter seconds)."""
        self.sync(started)
        last = self._last
        if last is not None and layer > last.layer and last.first_sync is not None:
            own = last.first_sync - last.resumed_at - last.host_wait_s - last.overhead_s
            self._dispatch.append((max(0.0, own), last.hosted))
            self._terms = None
        self._last = _LayerMark(layer, ended)

    def hosted(self, overhead_s: float) -> None:
        """The current layer ran a HOST part whose own dispatch took ``overhead_s``."""
        if self._last is not None:
            self._last.hosted = True
            self._last.overhead_s += max(0.0, overhead_s)
        self._overhead.append(max(0.0, overhead_s))
        self._terms = None

    def collected(self, lead_s: float, wait_s: float, overhead_s: float) -> None:
        """The current layer's HOST result was asked for ``lead_s`` after
        its start, blocked ``wait_s`` and took ``overhead_s`` besides."""
        self._lead.append(max(0.0, lead_s))
        self._terms = None
        if self._last is not None:
            self._last.host_wait_s += max(0.0, wait_s)
            self._last.overhead_s += max(0.0, overhead_s)
        if self._overhead:
            self._overhead[-1] += max(0.0, overhead_s)

    def wants_copy_sample(self) -> bool:
        """Should a layer the planner would host be copied instead, to
        measure the dispatch without a HOST part (class doc)? Counts the
        calls: True at most once in ``sample_every``."""
        if sum(1 for _, h in self._dispatch if not h) >= self.min_samples:
            return False
        self._since_sample += 1
        if self._since_sample < self.sample_every:
            return False
        self._since_sample = 0
        return True

    def _median(self, values: Sequence[float]) -> float:
        return float(statistics.median(values)) if len(values) >= self.min_samples else 0.0

    def terms(self) -> tuple[float, float, float]:
        """``(hidden_s, host_lead_s, host_overhead_s)``, computed once per
        change of the samples (:meth:`_compute_terms`)."""
        if self._terms is None:
            self._terms = self._compute_terms()
        return self._terms

    def _compute_terms(self) -> tuple[float, float, float]:
        after_copy = [d for d, h in self._dispatch if not h]
        after_host = [d for d, h in self._dispatch if h]
        if len(after_copy) >= self.min_samples:
            hidden = self._median(after_copy)
        else:
            hidden = self._median([d for d, _ in self._dispatch])
        lead = self._median(self._lead)
        overhead = self._median(self._overhead)
        if len(after_host) >= self.min_samples and len(after_copy) >= self.min_samples:
            overhead += max(0.0, self._median(after_host) - self._median(after_copy))
        return hidden, lead, overhead

    @property
    def hidden_s(self) -> float:
        return self.terms()[0]

    @property
    def host_lead_s(self) -> float:
        return self.terms()[1]

    @property
    def host_overhead_s(self) -> float:
        return self.terms()[2]

    def to_json(self) -> dict[str, Any]:
        """The terms as the planner sees them now, and their sample counts."""
        return {
            "hidden_s": self.hidden_s,
            "host_lead_s": self.host_lead_s,
            "host_overhead_s": self.host_overhead_s,
            "dispatch_samples": len(self._dispatch),
            "dispatch_after_host_samples": sum(1 for _, h in self._dispatch if h),
            "overhead_samples": len(self._overhead),
            "lead_samples": len(self._lead),
            "window": self.window,
            "min_samples": self.min_samples,
        }


@dataclass
class HostBooks:
    """What the host served (since the last :meth:`reset`).

    ``experts``: HOST expert computations (one per expert per layer per
    forward); ``tokens``: rows they computed; ``layers``: layer forwards that
    used the host; ``compute_s``: summed worker compute time; ``busy_s``: time
    at least one worker computed (the CPU as a resource); ``wait_s``: time the
    forward's thread blocked for host results; ``bytes_saved``: link bytes
    the HOST experts did not move (``experts x expert_nbytes``);
    ``planned_ahead``: experts the ahead plan kept out of route-ahead copies;
    ``planned_layers``: layer forwards the planner saw misses in (or, with
    :attr:`HostExpertService.host_queued`, copies still queued);
    ``queued_hosted``: HOST experts whose copy was still queued and was
    given back (:attr:`HostExpertService.host_queued`);
    ``copy_sampled``: layers the planner split that were copied to measure
    the forward's dispatch without a HOST part (:class:`ForwardClock`);
    ``ahead_seen``: experts of the ahead plans' HOST sets whose layer then
    ran, ``ahead_routed``: those the forward routed to, ``ahead_hosted``:
    those the layer's own plan hosted (the rest of the routed ones were
    copied on demand).
    """

    experts: int = 0
    tokens: int = 0
    layers: int = 0
    compute_s: float = 0.0
    busy_s: float = 0.0
    wait_s: float = 0.0
    bytes_saved: int = 0
    planned_ahead: int = 0
    planned_layers: int = 0
    copy_sampled: int = 0
    queued_hosted: int = 0
    ahead_seen: int = 0
    ahead_routed: int = 0
    ahead_hosted: int = 0

    def reset(self) -> None:
        for name, value in asdict(HostBooks()).items():
            setattr(self, name, value)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class HostExpertService:
    """The offloaded block's HOST path (see the module doc).

    Args:
        executor: computes experts from the store's host views.
        planner: splits each layer's misses.
        num_experts: experts per layer (flat id = layer * num_experts + e).
        expert_nbytes: bytes of one expert copy.
        link_bytes_per_s: the link rate the planner assumes (measured in
            the run).
        cost: the calibration the planner uses (recorded in rows).
    """

    def __init__(
        self,
        executor: HostExpertExecutor,
        planner: MissPlanner,
        *,
        num_experts: int,
        expert_nbytes: int,
        link_bytes_per_s: float,
        cost: HostCostModel | None = None,
    ) -> None:
        if num_experts < 1 or expert_nbytes < 1:
            raise ValueError(
                f"num_experts and expert_nbytes must be >= 1, got {num_experts}, {expert_nbytes}"
            )
        if not link_bytes_per_s > 0:
            raise ValueError(f"link_bytes_per_s must be positive, got {link_bytes_per_s!r}")
        self.executor = executor
        self.planner = planner
        self.num_experts = int(num_experts)
        self.expert_nbytes = int(expert_nbytes)
        self.link_bytes_per_s = float(link_bytes_per_s)
        self.cost = cost
        self.books = HostBooks()
        #: the planner's decision counts at the last :meth:`reset_stats`
        #: (None: never reset; the run's measured part is then the whole run)
        self._decisions_at_reset: dict[str, int] | None = None
        #: the engine's ComputeTimer (``host_wait()`` context), when attached
        self.timer: HostWaitTimer | None = None
        #: the host weight format and its prepared copy (HostWeights.describe())
        self.host_weights: dict[str, Any] | None = None
        #: seconds building it took, by phase (build_host_service fills it)
        self.setup_s: dict[str, float] = {}
        #: the kernel's own account (which kernel, and for the native one the
        #: ISA its last batch ran), read when a row is written
        self.kernel_detail: Callable[[], dict[str, Any]] | None = None
        #: torch's intra-op thread count before this service set its own
        #: (process-wide): given back by :meth:`close`; None: nothing to give back
        self.intra_op_threads_before: int | None = None
        #: the forward thread's measured times (the planner's critical-path
        #: terms); measured and reported always, given to the planner only
        #: where :attr:`critical_path` is set
        self.clock = ForwardClock()
        #: False (default): the planner sees the plain link makespan (the
        #: clock's terms are 0 in its LinkState) and no hosting layer is
        #: copied to sample the clock (why off: the H200 ablation in
        #: bench/results/h200/session9-2026-12-02/README.md)
        self.critical_path = False
        #: True: a layer's routed experts whose copy is in flight but not
        #: started (a route-ahead or stream copy queued behind others) are
        #: offered to the planner with the misses; one it hosts has its copy
        #: cancelled and its slot given back (ExpertCache.give_back_unstarted;
        #: a copy that started meanwhile stays a COPY). False (default): not
        #: measured on a GPU yet
        self.host_queued = False
        #: whether the calibration measured a fixed cost per HOST job
        #: (build_host_service's host_job_term); recorded in the stats
        self.host_job_term = False
        #: False: every miss is copied and nothing is planned ahead; a
        #: layer's split returns before reading the cache or asking the
        #: planner (the PD controller switches the service: the engine's
        #: starts it off until the forwards wait for copies, and off it
        #: plans nothing; what building it set, torch's intra-op thread
        #: count and the threads' placement, stays until :meth:`close`)
        self.enabled = True
        #: the hand-off that runs ("thread" or "stream", see
        #: pdflash.hybrid.handoff), the one asked for, and why they differ
        self.handoff = "thread"
        self.handoff_requested = "thread"
        self.handoff_reason: str | None = None
        self._signals: StreamSignals | None = None
        #: stream hand-off jobs whose books are not yet taken, oldest first
        self._pending: deque[HostJob] = deque()
        #: where its threads were placed (build_host_service sets it; None:
        #: no placement, as ``off``); :meth:`close` gives the masks back
        self.placement: PlacedThreads | None = None
        #: the last ahead plan's HOST experts no layer has seen yet (a
        #: layer's row is cleared once that layer splits; HostBooks.ahead_*)
        self._ahead: npt.NDArray[np.bool_] | None = None
        #: which copies the ahead plans split (:data:`HOST_AHEAD_FROM_CHOICES`;
        #: module doc, "Splitting the stream's copies"); the engine reads it
        self.ahead_from = "predicted"
        #: lookahead layers :meth:`plan_lookahead` split, and the experts it
        #: planned HOST
        self.lookahead_layers = 0
        self.lookahead_planned = 0
        #: the last plan's modeled HOST seconds, for the job start() makes of it
        self._planned_host_s: float | None = None

    @property
    def planner(self) -> MissPlanner:
        """The planner; setting it checks its optional parts once (typed
        references, not looked up per call)."""
        return self._planner

    @planner.setter
    def planner(self, planner: MissPlanner) -> None:
        if not isinstance(planner, MissPlanner):
            raise TypeError(f"not a MissPlanner (needs name, plan, plan_ahead): {planner!r}")
        self._planner = planner
        self._observer = planner if isinstance(planner, ObservingMissPlanner) else None
        self._reporter = planner if isinstance(planner, ReportingMissPlanner) else None
        self._accounting = planner if isinstance(planner, AccountingMissPlanner) else None
        self._ahead_observer = planner if isinstance(planner, AheadObservingMissPlanner) else None

    # -- per layer -------------------------------------------------------------

    def link_state(self, ahead_bytes: int = 0) -> LinkState:
        """The link and, with :attr:`critical_path`, the forward's measured
        terms as the planner sees them."""
        if not self.critical_path:
            return LinkState(self.link_bytes_per_s, ahead_bytes)
        hidden, lead, overhead = self.clock.terms()
        return LinkState(
            self.link_bytes_per_s,
            ahead_bytes,
            hidden_s=hidden,
            host_lead_s=lead,
            host_overhead_s=overhead,
        )

    def split(
        self,
        layer: int,
        flat_ids: IdArray,
        tokens: npt.NDArray[np.int64],
        cache: Any,
        *,
        routed: tuple[float, float] | None = None,
    ) -> npt.NDArray[np.bool_]:
        """Mask over ``flat_ids`` (a layer's distinct routed experts, with
        ``tokens`` routed to each) of the ones to compute on the host.
        ``routed``: the ``(start, end)`` perf_counter seconds of the layer's
        routing read on the forward thread (for :class:`ForwardClock`)."""
        if routed is not None:
            self.clock.routed(layer, *routed)
        if not self.enabled and self._ahead is None:
            # switched off: every miss copied, nothing to count (no arrays
            # read, no planner)
            return np.zeros(np.size(flat_ids), dtype=np.bool_)
        ids = np.asarray(flat_ids, dtype=np.int64).reshape(-1)
        tok = np.asarray(tokens, dtype=np.int64).reshape(-1)
        out = np.zeros(ids.size, dtype=np.bool_)
        planned = self._take_ahead(layer, ids)
        if ids.size and self.enabled:
            out = self._split(layer, ids, tok, cache)
        if planned is not None:
            self.books.ahead_hosted += int((planned & out).sum())
        return out

    def _take_ahead(self, layer: int, ids: IdArray) -> npt.NDArray[np.bool_] | None:
        """Mask over ``ids`` of the ahead plan's HOST experts of ``layer``
        (None: none planned), counting them as seen and routed (in the
        books, and for an :class:`AheadObservingMissPlanner`, in its
        routed fraction)."""
        ahead = self._ahead
        if ahead is None or not 0 <= layer < ahead.shape[0] or not ahead[layer].any():
            return None
        row = ahead[layer].copy()
        ahead[layer] = False  # seen: a later forward's layer is not this verify's
        self.books.ahead_seen += int(row.sum())
        local = ids - layer * self.num_experts
        inside = (local >= 0) & (local < row.size)
        planned = np.zeros(ids.size, dtype=np.bool_)
        planned[inside] = row[local[inside]]
        self.books.ahead_routed += int(planned.sum())
        if self._ahead_observer is not None:
            self._ahead_observer.observe_ahead(int(row.sum()), int(planned.sum()))
        return planned

    def _split(
        self, layer: int, ids: IdArray, tok: npt.NDArray[np.int64], cache: Any
    ) -> npt.NDArray[np.bool_]:
        out = np.zeros(ids.size, dtype=np.bool_)
        slots = np.asarray(cache.slot_of)[ids]
        held = slots >= 0
        missed = ~held
        queued = self._queued(cache, ids) if self.host_queued else None
        offered = missed if queued is None else missed | queued
        if not offered.any():
            return out
        self.books.planned_layers += 1
        inflight = int((np.asarray(cache.ticket)[slots[held]] >= 0).sum())
        if queued is not None:
            # a queued copy offered to the planner is one of its copies, not
            # bytes ahead of them
            inflight -= int(queued.sum())
        link = self.link_state(inflight * self.expert_nbytes)
        plan = self.planner.plan(layer, ids[offered], tok[offered], link)
        # the HOST job's modeled time (the job records it)
        self._planned_host_s = plan.modeled_host_s
        if plan.host.size and self.critical_path and self.clock.wants_copy_sample():
            self.books.copy_sampled += 1  # copied to measure the dispatch without a HOST part
            return out
        if plan.host.size:
            host = self._members(layer, ids, plan.host)
            if queued is not None and (host & queued).any():
                take = np.flatnonzero(host & queued)
                given = np.asarray(cache.give_back_unstarted(ids[take]), dtype=np.bool_)
                host[take[~given]] = False  # started meanwhile: it stays a copy
                self.books.queued_hosted += int(given.sum())
                held = np.asarray(cache.slot_of)[ids] >= 0
            if (host & held).any():
                raise RuntimeError(
                    f"planner {self.planner.name!r} chose a resident expert for the host"
                )
            out = host
        return out

    @staticmethod
    def _queued(cache: Any, ids: IdArray) -> npt.NDArray[np.bool_] | None:
        """Mask over the layer's experts ``ids`` whose copy the cache could
        give back (:meth:`pdflash.cache.ExpertCache.unstarted_copies`); None
        where the cache cannot tell."""
        query = getattr(cache, "unstarted_copies", None)
        return None if query is None else np.asarray(query(ids), dtype=np.bool_)

    def _members(self, layer: int, ids: IdArray, chosen: IdArray) -> npt.NDArray[np.bool_]:
        """``np.isin(ids, chosen)``: through a table over the layer's experts
        where both are the layer's flat ids (they are: :meth:`split`'s
        contract), else ``np.isin`` itself."""
        base = layer * self.num_experts
        local, pick = ids - base, np.asarray(chosen, dtype=np.int64).reshape(-1) - base
        n = self.num_experts
        if local.min() < 0 or local.max() >= n or pick.min() < 0 or pick.max() >= n:
            return np.isin(ids, chosen)
        table = np.zeros(n, dtype=np.bool_)
        table[pick] = True
        return table[local]

    def start(self, ids: IdArray, x_rows: torch.Tensor, counts: list[int]) -> HostJob:
        """Start the host on ``ids`` over ``x_rows`` (rows sorted by expert,
        ``counts`` rows each, on the compute device)."""
        job = self.executor.submit(ids, x_rows, counts, device=x_rows.device)
        job.started_at = time.perf_counter()
        job.modeled_s, self._planned_host_s = self._planned_host_s, None
        n = int(np.asarray(ids).size)
        self.books.experts += n
        self.books.tokens += int(x_rows.shape[0])
        self.books.layers += 1
        self.books.bytes_saved += n * self.expert_nbytes
        return job

    def finish(self, job: HostJob) -> torch.Tensor:
        """The job's output on its device (the forward blocks for the host
        here; on CUDA the copy back is ordered on the compute stream)."""
        asked = time.perf_counter()
        with self._host_wait():
            out = job.result()
        self._book(job)
        if job.started_at is not None:
            own = time.perf_counter() - asked - job.wait_s
            self.clock.collected(asked - job.started_at, job.wait_s, own)
        return out

    # -- the stream hand-off -------------------------------------------------------

    def set_handoff(
        self,
        mode: str,
        device: torch.device | str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        signals: StreamSignals | None = None,
    ) -> None:
        """Run the ``mode`` hand-off (:data:`~pdflash.hybrid.handoff.HANDOFF_CHOICES`)
        on ``device``. ``stream`` where it cannot run (no CUDA build or
        device) runs ``thread``, the reason in :attr:`handoff_reason`.
        ``signals``: the device waits to use with ``stream`` (tests: a ring
        whose waits run on the host), instead of a mapped ring on ``device``."""
        if mode not in HANDOFF_CHOICES:
            raise ValueError(f"host handoff must be one of {HANDOFF_CHOICES}, got {mode!r}")
        if signals is not None and mode != "stream":
            raise ValueError("signals are for the stream hand-off only")
        dev = torch.device(device)
        reason: str | None = None
        if mode == "stream" and signals is None:
            reason = stream_unavailable(dev)
            if reason is None:
                try:
                    signals = StreamSignals(dev, timeout_s=timeout_s)
                except RuntimeError as exc:
                    reason = f"the device wait could not be set up: {exc}"
        self.settle()
        if self._signals is not None:
            self._signals.close()
        self._signals = signals
        self.handoff_requested = mode
        self.handoff = "stream" if signals is not None else "thread"
        self.handoff_reason = reason

    def finish_on_stream(self, job: HostJob) -> torch.Tensor:
        """The job's output on its device, the forward's thread not waiting:
        the current stream waits for the job on the device, then uploads the
        output (``stream`` hand-off; the books follow once the job is done)."""
        signals = self._signals
        if signals is None:
            raise RuntimeError("the stream hand-off is not set (set_handoff)")
        asked = time.perf_counter()
        self._take_done()
        signals.arm(job, signals.current_stream())
        out = job.output()
        self._pending.append(job)
        if job.started_at is not None:
            self.clock.collected(asked - job.started_at, 0.0, time.perf_counter() - asked)
        return out

    def _take_done(self) -> None:
        """The books of the finished stream hand-off jobs, oldest first (no
        waiting); raises :class:`HostHandoffError` for a failed one."""
        while self._pending and self._pending[0].done():
            self._collect(self._pending.popleft())

    def _collect(self, job: HostJob) -> None:
        try:
            job.collect()
        except Exception as exc:
            raise HostHandoffError(f"a HOST job failed: {type(exc).__name__}: {exc}") from exc
        self._book(job)

    def settle(self) -> None:
        """Wait for every stream hand-off job still running, take their books
        and raise :class:`HostHandoffError` if one failed or a device wait
        saw a failure or timed out. After an error the device is synchronized
        and the flag ring replaced, so the next forward starts clean. The
        engine calls this after each forward (its outputs read); a no-op for
        the ``thread`` hand-off."""
        error: BaseException | None = None
        while self._pending:
            job = self._pending.popleft()
            try:
                job.wait()
                self._collect(job)
            except Exception as exc:
                error = error or exc
        signals = self._signals
        if signals is None:
            if error is not None:
                raise error
            return
        try:
            signals.check()
        except HostHandoffError as exc:
            error = error or exc
        if error is not None:
            signals.renew()  # synchronizes first: no wait still reads the old ring
            raise error

    def _book(self, job: HostJob) -> None:
        """A finished job's books and the planner's observation."""
        self.books.wait_s += job.wait_s
        self.books.compute_s += sum(b - a for a, b in job.intervals)
        self.books.busy_s += busy_union_s(job.intervals)
        observer = self._observer
        tokens = [t for run in job.run_tokens for t in run] if observer is not None else []
        if observer is not None and tokens and job.intervals:
            # the planner corrects its host cost from what the host measured:
            # the job's compute span, as the calibration timed its batches
            span = max(b for _, b in job.intervals) - min(a for a, _ in job.intervals)
            observer.observe(tokens, span)

    @contextlib.contextmanager
    def _host_wait(self) -> Iterator[None]:
        if self.timer is None:
            yield
            return
        with self.timer.host_wait():
            yield

    # -- before a verify -----------------------------------------------------------

    def plan_ahead(
        self, expected_tokens: npt.NDArray[np.float64], resident: npt.NDArray[np.bool_]
    ) -> npt.NDArray[np.bool_]:
        """``(layers, experts)`` experts expected to be HOST in the coming
        verify (see :meth:`MissPlanner.plan_ahead`)."""
        if not self.enabled:
            self._ahead = None
            return np.zeros(np.asarray(resident).shape, dtype=np.bool_)
        mask = np.asarray(
            self.planner.plan_ahead(expected_tokens, resident, self.link_state()), dtype=np.bool_
        )
        self._ahead = mask.copy() if mask.ndim == 2 and mask.any() else None
        return mask

    def plan_lookahead(
        self, layer: int, local_ids: IdArray, expected_tokens: npt.NDArray[np.float64]
    ) -> npt.NDArray[np.bool_]:
        """Mask over ``local_ids`` (experts of ``layer`` with no slot that the
        gate lookahead would copy, expecting ``expected_tokens`` each) of the
        ones the host is expected to compute: the planner's ahead rule over
        this one layer (module doc, "Splitting the stream's copies"). The
        result replaces the layer's row of the current ahead plan (its
        books: what the layer then sees and routes of it)."""
        ids = np.asarray(local_ids, dtype=np.int64).reshape(-1)
        exp = np.asarray(expected_tokens, dtype=np.float64).reshape(-1)
        if ids.shape != exp.shape:
            raise ValueError(f"local_ids ({ids.size}) and expected_tokens ({exp.size}) differ")
        if not self.enabled or ids.size == 0:
            return np.zeros(ids.size, dtype=np.bool_)
        row = np.zeros((1, self.num_experts), dtype=np.float64)
        row[0, ids] = np.maximum(exp, 1e-9)  # every candidate counts, 0 expected included
        held = np.zeros(row.shape, dtype=np.bool_)
        mask = np.asarray(self.planner.plan_ahead(row, held, self.link_state()), dtype=np.bool_)
        host: npt.NDArray[np.bool_] = mask[0, ids]
        self.lookahead_layers += 1
        self.lookahead_planned += int(host.sum())
        ahead = self._ahead
        if ahead is None or ahead.shape[0] <= layer:
            # no ahead plan hosted anything (or not this far): rows up to this layer
            grown = np.zeros((int(layer) + 1, self.num_experts), dtype=np.bool_)
            if ahead is not None:
                grown[: ahead.shape[0]] = ahead
            ahead = self._ahead = grown
        ahead[layer] = False
        ahead[layer, ids[host]] = True
        return host

    def reset_stats(self) -> None:
        """Start the measured part: empty the books and mark the planner's
        decision counts, so a row can count the decisions of the measured
        part (``planner_decisions_measured``) beside the whole run's
        (``planner_decisions``, warm-up included)."""
        self.books.reset()
        accounting = self._accounting
        self._decisions_at_reset = None if accounting is None else dict(accounting.decisions)

    def _measured_decisions(self) -> dict[str, int] | None:
        accounting = self._accounting
        if accounting is None:
            return None
        start = self._decisions_at_reset or {}
        return {k: int(v) - int(start.get(k, 0)) for k, v in accounting.decisions.items()}

    def describe(self) -> dict[str, Any]:
        """What a result row records about the service."""
        reporter, accounting = self._reporter, self._accounting
        return {
            "planner": (
                reporter.params() if reporter is not None else {"planner": self.planner.name}
            ),
            # the whole run's decisions (warm-up included), and the measured
            # part's: the part whose experts host_served_experts counts
            "planner_decisions": None if accounting is None else dict(accounting.decisions),
            "planner_decisions_measured": self._measured_decisions(),
            "calibration": None if self.cost is None else self.cost.to_json(),
            # the host cost the planner ended the run with (None: not online)
            "online_cost": None if accounting is None else accounting.online_cost(),
            "host_weights": self._host_weights(),
            "workers": self.executor.workers,
            "intra_op_threads": self.executor.intra_op_threads,
            "link_bytes_per_s": self.link_bytes_per_s,
            # the forward's measured terms the planner ended the run with
            "critical_path": self.clock.to_json(),
            # whether the planner was given those terms (else the makespan)
            "critical_path_planned": self.critical_path,
            # queued copies offered to the planner, and how many it hosted
            "host_queued": self.host_queued,
            "queued_hosted": self.books.queued_hosted,
            "host_job_term": self.host_job_term,
            # layers the planner split that were copied to sample the dispatch
            "copy_sampled_layers": self.books.copy_sampled,
            "enabled_at_end": self.enabled,
            # how HOST outputs reached the stream (pdflash.hybrid.handoff)
            "host_handoff": {
                "requested": self.handoff_requested,
                "mode": self.handoff,
                "reason": self.handoff_reason,
                "device_waits": None if self._signals is None else self._signals.waits,
                "timeout_s": None if self._signals is None else self._signals.timeout_s,
                # rings replaced after a failed or timed-out job
                "renewed": None if self._signals is None else self._signals.renewed,
            },
            # the ahead plans' HOST experts: how many the layers saw, how many
            # of those the forward routed, and how many of those the layer's
            # own plan then hosted (the rest were copied on demand)
            "ahead_outcome": {
                "seen": self.books.ahead_seen,
                "routed": self.books.ahead_routed,
                "hosted": self.books.ahead_hosted,
            },
            # the planner's routed fraction of its ahead plans' HOST experts
            # over the whole run (the weighted ahead plan's p; None: the
            # planner keeps none)
            "ahead_fraction": (
                None if self._ahead_observer is None else self._ahead_observer.ahead_fraction()
            ),
            # which copies the ahead plans split, and the lookahead layers
            # split during the forwards (module doc, "Splitting the stream's
            # copies")
            "ahead_from": self.ahead_from,
            "lookahead_split": {
                "layers": self.lookahead_layers,
                "planned": self.lookahead_planned,
            },
            # the host-affinity setting and the threads it placed
            "affinity": (self.placement or PlacedThreads(HostPlacement("off"))).describe(
                len(self.executor.thread_ids)
            ),
        }

    def _host_weights(self) -> dict[str, Any] | None:
        if self.host_weights is None or self.kernel_detail is None:
            return self.host_weights
        return {**self.host_weights, "host_kernel": self.kernel_detail()}

    def close(self) -> None:
        """Stop the executor's pool, give the threads it placed their CPU
        masks back and torch the intra-op thread count it had before the
        service (idempotent). Stream hand-off jobs still pending are settled
        first (their errors raised after everything is closed)."""
        try:
            self.settle()
        finally:
            signals, self._signals = self._signals, None
            if signals is not None:
                signals.close()
            self.executor.close()
            if self.placement is not None:
                self.placement.restore()
            before, self.intra_op_threads_before = self.intra_op_threads_before, None
            if before is not None:
                torch.set_num_threads(before)
