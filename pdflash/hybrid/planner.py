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
* host CPU: ``roundtrip_s + sum(a + b * tokens_e)`` over the HOST experts,
  from the start-up calibration (:class:`HostCostModel`).

The two run at once, so the layer waits ``max(link, host)``. Experts are
moved to HOST cheapest (fewest tokens) first; for a fixed number of HOST
experts that is the best choice because every COPY costs the link the same.
A split is taken only when it beats all-COPY by ``margin`` (relative): the
model's error is largest near break-even, and a COPY leaves the expert
resident for later forwards while a HOST expert leaves nothing behind.

When HOST pays. With ``n`` misses, a copy time ``L``, a host time ``H = r L``
per expert and the round trip ``R``, the best split (both resources finish
together) hosts ``m* = (nL - R) / (L + H)`` experts and the layer waits

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
    name: str = "cost_model"
    decisions: dict[str, int] = field(
        default_factory=lambda: {"layers": 0, "split": 0, "probes": 0}
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

    def _split(
        self, tokens: npt.NDArray[np.float64], link: LinkState
    ) -> tuple[npt.NDArray[np.int64], float, float]:
        """(indices to serve on the host, all-COPY cost, chosen cost): a
        cost is what the layer's misses add to the forward's critical path
        (module doc, "The critical path")."""
        n = int(tokens.size)
        per_copy = self.expert_nbytes / link.bytes_per_s
        ahead = link.ahead_bytes / link.bytes_per_s
        copy_link = ahead + n * per_copy
        copy_only = max(0.0, copy_link - link.hidden_s)
        none = np.zeros(0, dtype=np.int64)
        if n == 0:
            return none, copy_only, copy_only
        order = np.argsort(tokens, kind="stable")
        host_each = np.asarray(self.model.expert_s(tokens[order]), dtype=np.float64)
        host_cum = np.cumsum(host_each)
        # host cost rises with tokens (and so does the token cap), so the
        # eligible experts are a prefix of `order`
        ok = host_each <= self.max_host_ratio * per_copy
        if self.max_host_tokens is not None:
            ok &= tokens[order] <= self.max_host_tokens
        eligible = int(ok.sum())
        m = np.arange(1, eligible + 1)
        if self.max_host_per_layer is not None:
            m = m[m <= self.max_host_per_layer]
        if m.size == 0:
            return none, copy_only, copy_only
        cost = self._cost(m, n, per_copy, ahead, host_cum, link)
        best = int(np.argmin(cost))
        # the saving must be worth `margin` of the layer's copy time
        if copy_only - cost[best] > self.margin * copy_link:
            return order[: int(m[best])].astype(np.int64), copy_only, float(cost[best])
        return none, copy_only, copy_only

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
        host_s = self.model.roundtrip_s + host_cum[m - 1]
        wait_host = np.maximum(0.0, host_s - link.host_lead_s)
        thread_s = link.hidden_s + link.host_overhead_s + wait_host
        cost: npt.NDArray[np.float64] = np.maximum(thread_s, link_s) - link.hidden_s
        return cost

    def plan(
        self, layer: int, missed: IdArray, tokens: npt.NDArray[np.int64], link: LinkState
    ) -> MissPlan:
        ids, tok = _check_aligned(missed, tokens)
        pick, copy_only, chosen = self._split(tok.astype(np.float64), link)
        self.decisions["layers"] += 1
        if pick.size:
            self.decisions["split"] += 1
            self._since_host = 0
        elif ids.size:
            self._since_host += 1
            probe = self._probe(tok.astype(np.float64), link)
            if probe is not None:
                pick = np.asarray([probe], dtype=np.int64)
                self.decisions["probes"] += 1
                self._since_host = 0
        host_mask = np.zeros(ids.size, dtype=np.bool_)
        host_mask[pick] = True
        return MissPlan(ids[~host_mask], ids[host_mask], copy_only, chosen)

    def _probe(self, tokens: npt.NDArray[np.float64], link: LinkState) -> int | None:
        """Index of the expert to serve on the host as a probe, if one is due
        (module doc)."""
        if not isinstance(self.model, OnlineHostCost) or self.probe_every is None:
            return None
        if self._since_host < self.probe_every or tokens.size < 2:
            return None
        if self.max_host_per_layer is not None and self.max_host_per_layer < 1:
            return None
        j = int(np.argmin(tokens))
        if self.max_host_tokens is not None and tokens[j] > self.max_host_tokens:
            return None
        exposed = (link.ahead_bytes + tokens.size * self.expert_nbytes) / link.bytes_per_s
        if exposed - link.hidden_s <= link.host_overhead_s:
            return None  # the copies hide behind the forward: no host could pay
        rest_s = (link.ahead_bytes + (tokens.size - 1) * self.expert_nbytes) / link.bytes_per_s
        host_s = self.model.roundtrip_s + float(self.model.expert_s(tokens[j]))
        return j if host_s <= self.probe_max_ratio * rest_s else None

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
        for layer in range(exp.shape[0]):
            cand = np.flatnonzero((exp[layer] > 0) & ~res[layer])
            if cand.size == 0:
                continue
            # NOTE: ahead of the verify no copy of this layer is queued yet;
            # fractional expectations are rounded up (an expert gets >= 1 token)
            tok = np.maximum(1.0, np.ceil(exp[layer, cand]))
            pick, _, _ = self._split(tok, dataclasses.replace(link, ahead_bytes=0))
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
    ) -> tuple[ObservingMissPlanner, ReportingMissPlanner, AccountingMissPlanner]:
        return p, p, p

    def _forced_parts(p: ForcedHostPlanner) -> ReportingMissPlanner:
        return p
