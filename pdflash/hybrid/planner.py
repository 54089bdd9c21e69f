"""Which missed experts the link copies and which the host CPU computes.

A *miss* is an expert a forward routes tokens to that holds no cache slot
(not resident, no copy in flight). Today every miss is copied ON_DEMAND. A
:class:`MissPlanner` splits a layer's misses into COPY (the copy path as
before) and HOST (the CPU computes the expert over its tokens from the
packed host weights, in parallel with the link).

:class:`CostModelPlanner` (the default) minimises the layer's miss-service
makespan under a two-resource model:

* link: ``(ahead_bytes + copies * expert_nbytes) / bytes_per_s`` — the
  bytes already ahead of this layer's copies (its own in-flight copies,
  promoted to ON_DEMAND when the layer pins them) plus the new copies;
* host CPU: ``roundtrip_s + job_s + sum(a + b * tokens_e)`` over the HOST
  experts, from the start-up calibration (:class:`HostCostModel`; ``job_s``
  what a HOST job costs the pool beyond its experts' own seconds).

The two run at once, so the layer waits ``max(link, host)``. Experts are
moved to HOST cheapest (fewest tokens) first; for a fixed number of HOST
experts that is the best choice because every COPY costs the link the same.
A split is taken only when it beats all-COPY by ``margin`` (relative): the
model's error is largest near break-even, and a COPY leaves the expert
resident for later forwards while a HOST expert leaves nothing behind.

When HOST pays. With ``n`` misses, a copy time ``L``, a host time ``H = r L``
per expert and the round trip ``R`` (with the job term ``job_s``), the
best split (both resources finish together) hosts
``m* = (nL - R) / (L + H)`` experts and the layer waits

    T* = (r + R / (nL)) / (1 + r) x nL

instead of ``nL`` (with bytes already ahead, ``nL`` is their time plus
``nL``): 1/2 of all-COPY at ``r = 1``, 0.6 at 1.5, 2/3 at 2. So
the per-expert break-even (``r <= 1``) is the wrong test: an expert the CPU
computes 1.3x slower than the link copies it still cuts a link-bound
layer's wait by ~43%. What the model does not see bounds ``r`` instead:

* the CPU and the DMA read the same host memory, so under a busy link the
  host runs slower than calibrated (the diagnostic's ``--link-load``
  measures it);
* a COPY leaves the expert resident, a HOST expert leaves nothing, and
  the experts a forward routes many tokens to are the ones routed again;
* the link's queue of a layer is partly hidden behind earlier layers'
  compute, the host's work is not (it starts at the layer's routing).

Hence two eligibility caps: ``max_host_ratio`` (default
:data:`DEFAULT_MAX_HOST_RATIO` = 1.5: the split must at least cut the
modeled wait to 60%, a margin those effects do not eat) and
``max_host_tokens`` (default :data:`DEFAULT_MAX_HOST_TOKENS` = 16, one
verify block: a cold expert of a few requests, not a popular one). A
bf16 expert on a CPU near its memory-bound floor costs ``bytes / DRAM
bandwidth`` (~1.2 ms for gpt-oss-20b's 49.8 MB at ~42 GB/s) vs ``bytes /
link bandwidth`` (0.96 ms at 52 GB/s): ``r`` ~ 1.25 whatever the token
count up to tens of tokens, so the ratio alone barely separates c = 1..4
(2-8 tokens per expert) from c = 16 (~32), while the token cap does.

The critical path. The makespan above is what the layer waits only if the
forward has nothing else to do meanwhile. In the eager offloaded forward
the thread that launches the kernels reads each layer's routing (a host
sync) and then goes on launching: a copy's wait is a *stream* wait, so the
copy is exposed only where it outlasts the thread's own work up to its next
sync (the next layer's routing), while the HOST part is paid by that thread
itself: its dispatch (gather the rows, submit, collect the result) and a
block on the host's result. So with the service's measurements in
:class:`LinkState` — ``hidden_s`` (the thread's own work after a layer's
plan), ``host_lead_s`` (its work between starting the host and needing the
result) and ``host_overhead_s`` (what a HOST part adds to it) — a split of
``m`` HOST experts costs the forward

    max(hidden + overhead + max(0, host(m) - lead), link(m)) - hidden

against ``max(0, link(0) - hidden)`` for all-COPY, and a HOST assignment
pays only where the copy it replaces would have been exposed by more than
the host part adds. Where the launching thread is the bottleneck (few
tokens per verify, eager layers) the copies of a few misses hide entirely
and the planner copies; where the link is (small cache, many misses per
layer) the makespan rule comes back. With nothing measured yet the three
terms are 0 and the cost is the makespan. A probe (below) is skipped where
no host could pay (the copies' exposure below the overhead).

The ahead plan. Before a verify the planner sees the route-ahead
prediction: per layer the predicted experts and an expected token count
each (``expected_tokens``, the requests' spread shares). ``certain`` (the
default) plans as if every predicted expert were routed: its tokens are
rounded up to at least one, and the layer's split is the makespan rule
above with the link idle (no copy of the layer is queued ahead of the
verify). ``weighted`` plans with the probability ``p`` that a predicted
expert the plan hosts is then routed, measured in the run
(:class:`RoutedFraction`: the ahead plans' HOST experts the forwards routed
over those their layers saw, from a prior of ``p = 1`` worth
``prior_weight`` experts, never below ``floor``). Per predicted expert:

* tokens if routed: ``t = max(1, ceil(expected / p))`` (the expected
  count given that the verify routes it);
* expected host time: ``p x host(t)`` (nothing is computed where it is not
  routed); the layer's round trip is charged in full;
* copy: a predicted expert the plan does not host is copied ahead whether
  the verify routes it or not, so the link side of the makespan counts
  every such copy in full; the copy's *value* (what it saves the layer) is
  ``p x copy time``, and the ``max_host_ratio`` cap compares the expected
  host time to it (``p host(t) <= max_host_ratio p copy``, i.e. the cap on
  ``host(t) / copy`` at the routed token count), as ``max_host_tokens``
  caps ``t``.

So a low ``p`` makes hosting a predicted expert cheaper in expectation and
the plan hosts more of the experts it would otherwise copy (and waste a
copy on where they are not routed). With ``p = 1`` the rule is exactly
``certain``. The caps read ``t``, which grows as ``p`` falls: with wide
verifies (many tokens per predicted expert) and a low ``p`` an expert
``certain`` would host can exceed ``max_host_tokens`` or ``max_host_ratio``
at its routed count, and ``weighted`` then hosts fewer. The link's queue
ahead of a layer's copies (earlier layers' route-ahead copies still in
flight when the forward reaches it) is not known to the planner before the
verify; both plan each layer with the link idle.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from pdflash.hybrid.cost import HostCostModel, OnlineHostCost

IdArray = npt.NDArray[np.int64]

#: default eligibility cap on host time / copy time (module doc)
DEFAULT_MAX_HOST_RATIO = 1.5
#: default eligibility cap on tokens per HOST expert (module doc)
DEFAULT_MAX_HOST_TOKENS = 16
#: default: probe the host after this many layers with misses and no HOST work
DEFAULT_PROBE_EVERY = 8
#: a probe's modeled host time may be at most this times the layer's other copies
DEFAULT_PROBE_MAX_RATIO = 4.0
#: how the ahead plan treats a predicted expert (module doc, "The ahead plan")
HOST_AHEAD_CHOICES = ("certain", "weighted")
#: which copies the ahead plan splits (pdflash.hybrid.service, "Splitting the
#: stream's copies"): the route-ahead prediction only, or also the streaming
#: prefetcher's own copies (its fetch set before a verify, its gate
#: lookahead's set for the next layer during the forward)
HOST_AHEAD_FROM_CHOICES = ("predicted", "stream")
#: why a plan chose what it chose (CostModelPlanner.decisions' keys)
PLAN_REASONS = ("split", "copy_ineligible", "copy_margin")
#: RoutedFraction's defaults: the prior (today's plan assumes every predicted
#: expert is routed), what it weighs in experts (about one verify's ahead
#: plan of a few layers), and the floor (at most doubles a token count)
DEFAULT_ROUTED_PRIOR = 1.0
DEFAULT_ROUTED_PRIOR_WEIGHT = 64.0
DEFAULT_ROUTED_FLOOR = 0.5


@dataclass
class RoutedFraction:
    """The measured probability that an expert the ahead plan hosts is then
    routed by the verify: ``(routed + prior x prior_weight) / (seen +
    prior_weight)``, at least ``floor`` (an early run, or one unlucky verify,
    does not swing the plan).

    Args:
        prior: the fraction before anything is measured, in ``[floor, 1]``.
        prior_weight: how many observed experts the prior counts as (>= 0;
            0: the raw fraction once anything is seen).
        floor: the estimate never goes below this, in ``(0, 1]``.
    """

    prior: float = DEFAULT_ROUTED_PRIOR
    prior_weight: float = DEFAULT_ROUTED_PRIOR_WEIGHT
    floor: float = DEFAULT_ROUTED_FLOOR
    seen: int = 0
    routed: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.floor, (int, float)) and 0.0 < self.floor <= 1.0):
            raise ValueError(f"floor must be in (0, 1], got {self.floor!r}")
        if not (isinstance(self.prior, (int, float)) and self.floor <= self.prior <= 1.0):
            raise ValueError(f"prior must be in [floor, 1], got {self.prior!r}")
        if not (
            isinstance(self.prior_weight, (int, float))
            and math.isfinite(self.prior_weight)
            and self.prior_weight >= 0
        ):
            raise ValueError(
                f"prior_weight must be a finite number >= 0, got {self.prior_weight!r}"
            )
        self._check_counts(self.seen, self.routed)

    @staticmethod
    def _check_counts(seen: int, routed: int) -> None:
        if seen < 0 or routed < 0 or routed > seen:
            raise ValueError(f"need 0 <= routed <= seen, got seen={seen}, routed={routed}")

    def observe(self, seen: int, routed: int) -> None:
        """``seen`` experts of an ahead plan's HOST set reached their layer,
        ``routed`` of them were routed there."""
        self._check_counts(int(seen), int(routed))
        self.seen += int(seen)
        self.routed += int(routed)

    @property
    def value(self) -> float:
        """The fraction the weighted ahead plan uses now."""
        total = self.seen + self.prior_weight
        if total <= 0:
            return float(self.prior)
        raw = (self.routed + self.prior * self.prior_weight) / total
        return float(min(1.0, max(self.floor, raw)))

    def to_json(self) -> dict[str, Any]:
        return {
            "value": self.value,
            "seen": self.seen,
            "routed": self.routed,
            "prior": self.prior,
            "prior_weight": self.prior_weight,
            "floor": self.floor,
        }


@dataclass(frozen=True)
class LinkState:
    """What the link owes before a new ON_DEMAND copy of this layer lands,
    and how much of that the forward hides (the critical-path terms).

    Attributes:
        bytes_per_s: the link's rate (measured in the run, or configured).
        ahead_bytes: bytes that complete before this layer's new copies
            (the layer's own copies already in flight).
        hidden_s: the forward thread's own work from this layer's plan to
            its next wait on the device (measured by the service): copies
            that land within it cost the forward nothing. 0: unknown (every
            copy second counts, the plain makespan).
        host_lead_s: the forward thread's work between starting the HOST
            job and blocking for its result (the device experts' dispatch):
            host time within it is hidden. 0: unknown.
        host_overhead_s: what a layer's HOST part adds to the forward
            thread (its own dispatch: the rows' gather, the submit and the
            result's collection, and the measured extra time of hosting
            layers): paid on the critical path by any split. 0: unknown.
    """

    bytes_per_s: float
    ahead_bytes: int = 0
    hidden_s: float = 0.0
    host_lead_s: float = 0.0
    host_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.bytes_per_s > 0:
            raise ValueError(f"bytes_per_s must be positive, got {self.bytes_per_s!r}")
        if self.ahead_bytes < 0:
            raise ValueError(f"ahead_bytes must be >= 0, got {self.ahead_bytes}")
        for name in ("hidden_s", "host_lead_s", "host_overhead_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")


@dataclass(frozen=True)
class MissPlan:
    """One layer's split of its missed experts (flat ids, disjoint)."""

    copy: IdArray
    host: IdArray
    #: what all-COPY adds to the forward's critical path (None: no model);
    #: with no critical-path terms known, the all-COPY makespan
    modeled_copy_only_s: float | None = None
    modeled_s: float | None = None  # the same for the chosen split
    #: the HOST part's modeled seconds on the pool (round trip and experts;
    #: None: no model, or nothing hosted)
    modeled_host_s: float | None = None


@runtime_checkable
class MissPlanner(Protocol):
    """Splits missed experts into COPY and HOST.

    ``plan`` runs per layer and per forward, once the layer's exact routing
    is known; ``plan_ahead`` runs before a verify from the route-ahead
    prediction (expected tokens per expert), so HOST-planned experts are
    neither copied ahead nor charged as missing bytes to the scheduler.
    """

    name: str

    def plan(
        self, layer: int, missed: IdArray, tokens: npt.NDArray[np.int64], link: LinkState
    ) -> MissPlan:
        """``missed``: flat ids of the layer's non-resident routed experts;
        ``tokens``: tokens routed to each (aligned)."""
        ...

    def plan_ahead(
        self,
        expected_tokens: npt.NDArray[np.float64],
        resident: npt.NDArray[np.bool_],
        link: LinkState,
    ) -> npt.NDArray[np.bool_]:
        """``(layers, experts)`` mask of the experts expected to be served on
        the host in the coming verify; ``expected_tokens`` is ``(layers,
        experts)`` (0: not predicted), ``resident`` the cache's residency."""
        ...


@runtime_checkable
class ObservingMissPlanner(MissPlanner, Protocol):
    """A :class:`MissPlanner` that corrects its host cost from the run's own
    HOST jobs (the service reports each finished job; a planner without
    ``observe`` is simply not told)."""

    def observe(self, tokens: Sequence[int], seconds: float) -> None:
        """A HOST job of experts with ``tokens`` rows each took ``seconds``
        of compute."""
        ...


@runtime_checkable
class AheadObservingMissPlanner(MissPlanner, Protocol):
    """A :class:`MissPlanner` told what became of its ahead plans (the
    service reports, per layer, how many of the plan's HOST experts the
    layer saw and how many of those the forward routed)."""

    def observe_ahead(self, seen: int, routed: int) -> None:
        """``seen`` planned HOST experts reached their layer, ``routed`` of
        them were routed."""
        ...

    def ahead_fraction(self) -> dict[str, Any] | None:
        """The routed fraction the ahead plan works with now (None: not
        estimated)."""
        ...


@runtime_checkable
class ReportingMissPlanner(MissPlanner, Protocol):
    """A :class:`MissPlanner` whose settings a result row records."""

    def params(self) -> dict[str, Any]:
        """The planner's name and settings (JSON-ready)."""
        ...


@runtime_checkable
class AccountingMissPlanner(MissPlanner, Protocol):
    """A :class:`MissPlanner` that counts its decisions and reports the host
    cost it ended with (rows record both)."""

    #: decisions by kind (e.g. layers planned, layers split, probes)
    decisions: dict[str, int]

    def online_cost(self) -> dict[str, Any] | None:
        """The host cost the planner plans with now (None: not corrected online)."""
        ...


def _check_aligned(missed: IdArray, tokens: npt.NDArray[np.int64]) -> tuple[IdArray, IdArray]:
    ids = np.asarray(missed, dtype=np.int64).reshape(-1)
    tok = np.asarray(tokens, dtype=np.int64).reshape(-1)
    if ids.shape != tok.shape:
        raise ValueError(f"missed ({ids.size}) and tokens ({tok.size}) are not aligned")
    if tok.size and tok.min() < 1:
        raise ValueError("every missed expert needs >= 1 routed token")
    return ids, tok


@dataclass
class CostModelPlanner:
    """The makespan planner of the module doc.

    Args:
        cost: the calibrated host cost (seconds per expert vs tokens).
        expert_nbytes: bytes of one expert copy.
        margin: take a split only if it is at least this much (relative)
            faster than all-COPY under the model.
        max_host_per_layer: at most this many HOST experts per layer
            (None: no cap).
        max_host_ratio: an expert is eligible for HOST only if its host time
            is at most this times its copy time (module doc).
        max_host_tokens: and only if at most this many tokens are routed to
            it (None: no cap).
        online: correct ``cost`` from the run's measured HOST jobs
            (:meth:`observe`; module doc); False: plan with ``cost`` as is.
        probe_every: with ``online``, probe the host after this many layers
            with misses and no HOST work (None: never probe).
        probe_max_ratio: a probe's modeled host time at most this times the
            copy time of the layer's other misses.
        ahead: how :meth:`plan_ahead` treats a predicted expert
            (:data:`HOST_AHEAD_CHOICES`; module doc, "The ahead plan"):
            ``certain`` (default) as routed, ``weighted`` routed with the
            measured probability ``routed_fraction.value``.
        routed_fraction: the measured fraction (:meth:`observe_ahead`);
            kept under either rule, used by ``weighted`` only.
    """

    cost: HostCostModel
    expert_nbytes: int
    margin: float = 0.1
    max_host_per_layer: int | None = None
    max_host_ratio: float = DEFAULT_MAX_HOST_RATIO
    max_host_tokens: int | None = DEFAULT_MAX_HOST_TOKENS
    online: bool = True
    probe_every: int | None = DEFAULT_PROBE_EVERY
    probe_max_ratio: float = DEFAULT_PROBE_MAX_RATIO
    ahead: str = "certain"
    routed_fraction: RoutedFraction = field(default_factory=RoutedFraction)
    name: str = "cost_model"
    decisions: dict[str, int] = field(
        default_factory=lambda: {
            "layers": 0,
            "probes": 0,
            **dict.fromkeys(PLAN_REASONS, 0),
            "ahead_layers": 0,
            **{f"ahead_{r}": 0 for r in PLAN_REASONS},
        }
    )

    def __post_init__(self) -> None:
        if self.expert_nbytes < 1:
            raise ValueError(f"expert_nbytes must be >= 1, got {self.expert_nbytes}")
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"margin must be in [0, 1), got {self.margin}")
        if not self.max_host_ratio > 0:
            raise ValueError(f"max_host_ratio must be positive, got {self.max_host_ratio}")
        if self.max_host_tokens is not None and self.max_host_tokens < 1:
            raise ValueError(f"max_host_tokens must be >= 1, got {self.max_host_tokens}")
        if self.max_host_per_layer is not None and self.max_host_per_layer < 0:
            raise ValueError(f"max_host_per_layer must be >= 0, got {self.max_host_per_layer}")
        if self.probe_every is not None and self.probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {self.probe_every}")
        if not self.probe_max_ratio > 0:
            raise ValueError(f"probe_max_ratio must be positive, got {self.probe_max_ratio}")
        if self.ahead not in HOST_AHEAD_CHOICES:
            raise ValueError(f"ahead must be one of {HOST_AHEAD_CHOICES}, got {self.ahead!r}")
        #: the host cost the plans use: the calibration, corrected online
        self.model: HostCostModel | OnlineHostCost = (
            OnlineHostCost(self.cost) if self.online else self.cost
        )
        self._since_host = 0  # layers with misses since the last HOST work

    def observe(self, tokens: Sequence[int], seconds: float) -> None:
        """A HOST job of experts with ``tokens`` rows each took ``seconds``
        of compute (the service reports every finished job)."""
        if isinstance(self.model, OnlineHostCost):
            self.model.observe(tokens, seconds)

    def observe_ahead(self, seen: int, routed: int) -> None:
        """``seen`` HOST experts of an ahead plan reached their layer,
        ``routed`` of them were routed (the service reports each layer)."""
        self.routed_fraction.observe(seen, routed)

    def ahead_fraction(self) -> dict[str, Any] | None:
        """The measured routed fraction and its prior (rows record it under
        either rule; ``weighted`` plans with ``value``)."""
        return self.routed_fraction.to_json()

    def _split(
        self,
        tokens: npt.NDArray[np.float64],
        link: LinkState,
        routed_p: float = 1.0,
    ) -> tuple[npt.NDArray[np.int64], float, float, str, float | None]:
        """(indices to serve on the host, all-COPY cost, chosen cost, the
        reason (:data:`PLAN_REASONS`), the HOST part's modeled pool
        seconds): a cost is what the layer's misses add to the forward's
        critical path (module doc, "The critical path"). ``routed_p``: the
        probability that each expert is routed at all (``tokens`` then count
        its tokens if it is): its host time is weighted by it, as is its
        copy's value in the ``max_host_ratio`` cap (module doc, "The ahead
        plan"); 1 at the layer's own plan."""
        n = int(tokens.size)
        per_copy = self.expert_nbytes / link.bytes_per_s
        ahead = link.ahead_bytes / link.bytes_per_s
        copy_link = ahead + n * per_copy
        copy_only = max(0.0, copy_link - link.hidden_s)
        none = np.zeros(0, dtype=np.int64)
        if n == 0:
            return none, copy_only, copy_only, "copy_ineligible", None
        order = np.argsort(tokens, kind="stable")
        host_if_routed = np.asarray(self.model.expert_s(tokens[order]), dtype=np.float64)
        host_each = routed_p * host_if_routed
        host_cum = np.cumsum(host_each)
        # host cost rises with tokens (and so does the token cap), so the
        # eligible experts are a prefix of `order`
        ok = host_each <= self.max_host_ratio * (routed_p * per_copy)
        if self.max_host_tokens is not None:
            ok &= tokens[order] <= self.max_host_tokens
        eligible = int(ok.sum())
        m = np.arange(1, eligible + 1)
        if self.max_host_per_layer is not None:
            m = m[m <= self.max_host_per_layer]
        if m.size == 0:
            return none, copy_only, copy_only, "copy_ineligible", None
        cost = self._cost(m, n, per_copy, ahead, host_cum, link)
        best = int(np.argmin(cost))
        # the saving must be worth `margin` of the layer's copy time
        if copy_only - cost[best] > self.margin * copy_link:
            k = int(m[best])
            host_s = self._host_fixed_s() + float(host_cum[k - 1])
            return order[:k].astype(np.int64), copy_only, float(cost[best]), "split", host_s
        return none, copy_only, copy_only, "copy_margin", None

    def _host_fixed_s(self) -> float:
        """What a layer's HOST part costs before its experts' own seconds:
        the round trip and the pool's job term."""
        return self.model.roundtrip_s + self.model.job_s

    def _cost(
        self,
        m: npt.NDArray[np.int64],
        n: int,
        per_copy: float,
        ahead: float,
        host_cum: npt.NDArray[np.float64],
        link: LinkState,
    ) -> npt.NDArray[np.float64]:
        """What hosting the first ``m`` experts adds to the critical path:
        the forward thread does its own work (``hidden_s``), the HOST part's
        dispatch (``host_overhead_s``) and waits for the host beyond its
        lead; the layer's next wait on the device ends once the copies have
        landed (module doc)."""
        link_s = ahead + (n - m) * per_copy
        host_s = self._host_fixed_s() + host_cum[m - 1]
        wait_host = np.maximum(0.0, host_s - link.host_lead_s)
        thread_s = link.hidden_s + link.host_overhead_s + wait_host
        cost: npt.NDArray[np.float64] = np.maximum(thread_s, link_s) - link.hidden_s
        return cost

    def plan(
        self, layer: int, missed: IdArray, tokens: npt.NDArray[np.int64], link: LinkState
    ) -> MissPlan:
        ids, tok = _check_aligned(missed, tokens)
        pick, copy_only, chosen, reason, host_s = self._split(tok.astype(np.float64), link)
        self.decisions["layers"] += 1
        if ids.size:
            self.decisions[reason] += 1
        if pick.size:
            self._since_host = 0
        elif ids.size:
            self._since_host += 1
            probe = self._probe(tok.astype(np.float64), link)
            if probe is not None:
                j, host_s = probe
                pick = np.asarray([j], dtype=np.int64)
                self.decisions["probes"] += 1
                self._since_host = 0
        host_mask = np.zeros(ids.size, dtype=np.bool_)
        host_mask[pick] = True
        return MissPlan(ids[~host_mask], ids[host_mask], copy_only, chosen, host_s)

    def _link_s(self, link: LinkState, copies: int) -> float:
        """Seconds until ``copies`` new copies land behind the bytes ahead."""
        return (link.ahead_bytes + copies * self.expert_nbytes) / link.bytes_per_s

    def _probe(self, tokens: npt.NDArray[np.float64], link: LinkState) -> tuple[int, float] | None:
        """Index of the expert to serve on the host as a probe, if one is due
        (module doc), and its modeled pool seconds (round trip and expert)."""
        if not isinstance(self.model, OnlineHostCost) or self.probe_every is None:
            return None
        if self._since_host < self.probe_every or tokens.size < 2:
            return None
        if self.max_host_per_layer is not None and self.max_host_per_layer < 1:
            return None
        j = int(np.argmin(tokens))
        if self.max_host_tokens is not None and tokens[j] > self.max_host_tokens:
            return None
        exposed = self._link_s(link, tokens.size)
        if exposed - link.hidden_s <= link.host_overhead_s:
            return None  # the copies hide behind the forward: no host could pay
        rest_s = self._link_s(link, tokens.size - 1)
        host_s = self._host_fixed_s() + float(self.model.expert_s(tokens[j]))
        return (j, host_s) if host_s <= self.probe_max_ratio * rest_s else None

    def plan_ahead(
        self,
        expected_tokens: npt.NDArray[np.float64],
        resident: npt.NDArray[np.bool_],
        link: LinkState,
    ) -> npt.NDArray[np.bool_]:
        exp = np.asarray(expected_tokens, dtype=np.float64)
        res = np.asarray(resident, dtype=np.bool_)
        if exp.shape != res.shape or exp.ndim != 2:
            raise ValueError(
                f"expected_tokens {exp.shape} and resident {res.shape} must be (layers, experts)"
            )
        out = np.zeros(exp.shape, dtype=np.bool_)
        # certain: every predicted expert routed (p = 1); weighted: with the
        # measured probability (module doc, "The ahead plan")
        p = self.routed_fraction.value if self.ahead == "weighted" else 1.0
        # NOTE: each layer is planned with the link idle (no copy of this
        # layer is queued ahead of the verify yet)
        idle = dataclasses.replace(link, ahead_bytes=0)
        for layer in range(exp.shape[0]):
            cand = np.flatnonzero((exp[layer] > 0) & ~res[layer])
            if cand.size == 0:
                continue
            # fractional expectations are rounded up (an expert gets >= 1 token)
            tok = np.maximum(1.0, np.ceil(exp[layer, cand] / p))
            pick, _, _, reason, _ = self._split(tok, idle, p)
            self.decisions["ahead_layers"] += 1
            self.decisions[f"ahead_{reason}"] += 1
            out[layer, cand[pick]] = True
        return out

    def params(self) -> dict[str, Any]:
        return {
            "planner": self.name,
            "margin": self.margin,
            "max_host_per_layer": self.max_host_per_layer,
            "max_host_ratio": self.max_host_ratio,
            "max_host_tokens": self.max_host_tokens,
            "online": self.online,
            "probe_every": self.probe_every if self.online else None,
            "probe_max_ratio": self.probe_max_ratio if self.online else None,
            "ahead": self.ahead,
        }

    def online_cost(self) -> dict[str, Any] | None:
        """The measured host model at this point (None: not online)."""
        return self.model.to_json() if isinstance(self.model, OnlineHostCost) else None


@dataclass
class ForcedHostPlanner:
    """Serves a fixed choice of missed experts on the host, whatever it costs:
    for tests and for labelled "forced" ablation rows.

    Args:
        every: HOST every ``every``-th missed expert of a layer (by position
            in ``missed``, starting with the first); 1 = all of them.
        ids: or exactly these flat ids whenever they miss.
    """

    every: int | None = 2
    ids: Sequence[int] | None = None
    name: str = "forced"

    def __post_init__(self) -> None:
        if (self.every is None) == (self.ids is None):
            raise ValueError("give exactly one of every= or ids=")
        if self.every is not None and self.every < 1:
            raise ValueError(f"every must be >= 1, got {self.every}")

    def _mask(self, ids: IdArray) -> npt.NDArray[np.bool_]:
        if self.ids is not None:
            return np.isin(ids, np.asarray(list(self.ids), dtype=np.int64))
        assert self.every is not None
        result: npt.NDArray[np.bool_] = (np.arange(ids.size) % self.every) == 0
        return result

    def plan(
        self, layer: int, missed: IdArray, tokens: npt.NDArray[np.int64], link: LinkState
    ) -> MissPlan:
        ids, _ = _check_aligned(missed, tokens)
        mask = self._mask(ids)
        return MissPlan(ids[~mask], ids[mask])

    def plan_ahead(
        self,
        expected_tokens: npt.NDArray[np.float64],
        resident: npt.NDArray[np.bool_],
        link: LinkState,
    ) -> npt.NDArray[np.bool_]:
        # NOTE: forced plans are decided per layer at routing time only
        return np.zeros(np.asarray(resident).shape, dtype=np.bool_)

    def params(self) -> dict[str, Any]:
        return {
            "planner": self.name,
            "every": self.every,
            "ids": None if self.ids is None else list(self.ids),
        }


if TYPE_CHECKING:
    # the type checker holds the planners to the optional parts they claim

    def _cost_model_parts(
        p: CostModelPlanner,
    ) -> tuple[
        ObservingMissPlanner,
        ReportingMissPlanner,
        AccountingMissPlanner,
        AheadObservingMissPlanner,
    ]:
        return p, p, p, p

    def _forced_parts(p: ForcedHostPlanner) -> ReportingMissPlanner:
        return p
