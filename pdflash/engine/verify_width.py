"""How many of a request's drafts each verify checks (the verify width).

A verify that checks only the first ``k`` of a request's ``n`` drafts is
lossless: acceptance stops at the first mismatch anyway, and the target's
token at the first unverified position is the bonus token, as it is after a
rejection. Each verified row costs compute, and on an offloaded MoE it routes
to experts the other rows did not touch, whose bytes must cross the link. Rows
deep in the block are rarely accepted, so past some depth a row costs more
link time than the tokens it is expected to add are worth.

Policies (:class:`VerifyWidthPolicy`; ``EngineConfig.verify_width``):

* ``full``: every draft (the engine does not consult a policy at all); the
  default of B0-B3, of a hand-made configuration and of the
  ``PD-full-width`` ablation arm.
* ``fixed:K``: the first ``K`` drafts (fewer when fewer were drafted).
* ``adaptive`` (:class:`AdaptiveWidth`; PD's and PD+host's default,
  ``docs/design.md`` says why; where the expert cache holds every expert the
  engine verifies every draft instead): the widths ``k_i`` (drafts per
  request ``i`` of the ``c`` waiting) that maximize the expected committed
  tokens (accepted drafts + the bonus) per second of the step,

  ``max_k  Σ_i (1 + Σ_{j<=k_i} S_i(j)) / T(R)``, with ``R = Σ_i k_i`` and
  ``T(R) = t_fixed + t_row · (c + R) + β · ℓ(c + R)`` (the whole step),

  with ``k_min <= k_i <= n_i``. For one request this is the per-request
  ``argmax_k (1 + Σ_{j≤k} S(j)) / (t_0 + Σ_{j≤k} Δt_j)`` with
  ``t_0 = T(0)`` and ``Δt_j = T(j) - T(j - 1)`` (:func:`best_width`). Because ``T`` depends
  only on the total ``R`` and each ``S_i`` falls with ``j``, the optimum
  takes, for some ``R``, the ``R`` largest ``S_i(j)`` (each request's a
  prefix): :func:`best_batch_widths` scans every ``R`` (ties: the smaller).

  - ``S_i(j) = P(the first j drafts are all accepted)``, request ``i``'s
    survival function (:class:`SurvivalEstimator`): a product of
    per-position continuation probabilities ``c_j = P(A >= j | A >= j - 1)``,
    each estimated from the request's own verify outcomes shrunk toward the
    global (all requests') estimate, which is itself shrunk toward a prior
    (``prior_accept`` for position 1; for deeper positions the global
    estimate of the position before, so a position no verify has reached
    yet inherits the deepest measured rate). Counts are censored: a round
    that verified ``v`` drafts and accepted ``A`` puts position ``j`` at
    risk for ``j <= min(A + 1, v)`` and counts it as passed for ``j <= A``;
    a round that accepted all ``v`` says only ``A >= v``.
    ``adaptive:z=Z`` chooses the widths by the lower bounds
    ``max(0, c_j - Z·se(c_j))`` instead (``se``: the request's own rounds'
    binomial noise and the global estimate's, in the shares the shrinkage
    gives them), and ``adaptive:shrink=W`` sets the shrinkage's
    pseudo-rounds: the argmax widens where an estimate made from a few
    rounds came out high (the winner's curse,
    ``bench/results/cpu/width-diagnosis-2026-12-03``), and both options
    discount such estimates. A lower bound also discounts estimates that
    are not selected, so it is pessimistic where acceptance is uniform.
  - ``adaptive:cal=1`` scales every ``S_i(j)`` past the first draft
    (``j >= 2``) by the acceptance calibration ``κ`` before choosing:
    the accepted drafts past the first over the drafts past the first the
    uncalibrated estimates expected, in the rounds that verified two or more
    drafts (each round weighted :attr:`AdaptiveWidth.CALIBRATION_MEMORY`
    per later round, with :attr:`AdaptiveWidth.CALIBRATION_PRIOR` expected
    drafts of a calibrated prior), clipped to ``[CALIBRATION_MIN, 1]``. The
    first draft is always verified (``k_min``), so its estimate is never
    selected by the argmax; deeper positions are, and where per-request
    estimates come out high by chance the chosen drafts are accepted less
    often than expected. ``κ`` measures that shortfall directly (on a
    learned closed loop the drafts adaptive added were accepted at about
    half the rate it expected). ``κ`` is computed and reported
    (``estimates.acceptance_calibration``) under every adaptive setting;
    only ``cal=1`` applies it.
  - ``adaptive:beta=marginal`` charges a further modeled link second at
    least the slope of the steps' exposed fetch on their modeled link time
    (:meth:`AdaptiveWidth.exposed_share`), not only the average share: at
    c=1 an added draft's exposed copies cost about twice what the average
    share charged.
  - ``adaptive:beta=one`` charges every further modeled link second in
    full: at c=1 the exposed fetch rose by the whole link time of the
    experts further drafts added, while the average share and the
    within-run slope (``marginal``, a slope on a noisy regressor, pulled
    toward 0) both read below 1. Where copies hide behind compute it
    charges them anyway.
  - ``adaptive:beta=hinge`` (the default: ``adaptive`` alone) charges a
    further modeled link second in full once the steps show their copies
    exposed (an average exposed share of at least
    :attr:`AdaptiveWidth.HINGE_SHARE`), and the average share below that.
    Why: the compute waits for ``max(0, ℓ - H)`` of the link time ``ℓ``,
    ``H`` what hides behind it, so once any wait shows the step is past
    the hinge and a further copy lengthens it by all of its time, while a
    step whose copies all hide is charged (nearly) nothing for them.
  - ``adaptive:row=wall`` charges a verified row at least the lower
    confidence bound of the slope of the steps' wall time less their
    charged link time (``β · ℓ``) on their rows
    (:meth:`AdaptiveWidth.wall_row_fit`), not only the slope of the
    verify's compute: whatever a further row lengthens the step by beyond
    its charged copies: at c=1 a further verified draft lengthened the
    step by about twice what the model charged.
  - ``adaptive:union=hyperbolic`` fits the union with
    :class:`UnionGrowth`'s hyperbolic form instead of the geometric one:
    on learned routing the geometric curve, fitted to narrow verifies,
    levels off too early and charges rows 10-16 0.08-0.47x of the experts
    they add (the hyperbolic one 0.60-0.83x), so deep drafts look cheap
    (:class:`UnionGrowth`; on i.i.d. routing the hyperbolic form is the
    one that undercharges).
  - ``ℓ(N) = m · L · U(N) · bytes_per_expert / link_Bps``: the link time of
    a batch of ``N`` verified rows, with ``U(N) = S - (S - top_k)(1 - a)^(N - 1)``
    the batch's routed experts per MoE layer (:class:`UnionGrowth`; the
    novelty rate ``a`` and the saturation ``S <= E`` fitted online to the
    routed unions of the verifies: rows of one request and of different
    requests alike; i.i.d. routing is ``a = top_k / E``, ``S = E``; skewed
    routing levels off below ``E``), ``m`` the bytes the cache actually
    copied per routed expert of the batch (residency, eviction within the forward and
    prefetching included), ``L`` the MoE layers; a row's link time is the
    experts it adds to the batch's union, so requests that route alike share
    their copies.
  - ``β``: the share of a further modeled link second the step waits for:
    1 where the link is the bottleneck (the steps' modeled ``ℓ`` at least
    their time outside the waits on copies); otherwise the share of ``ℓ``
    the compute actually waited for (the steps' measured exposed fetch over
    their modeled ``ℓ``, at most 1): copies hidden behind compute or by
    prefetching cost nothing, so a compute-bound step keeps every draft its
    acceptance pays for.
  - ``t_row`` (compute per verified row, anchors included): the lower
    confidence bound ``max(0, b - 2·se(b))`` of the slope ``b`` of the
    verify forward's compute time (its time less its waits on copies) on
    its rows ``c + R``, so the drafter's cost, which does not depend on the
    width, is not charged to the rows. The fit weights a step by
    ``0.9`` per later step (:attr:`AdaptiveWidth.FIT_MEMORY`: it follows
    the current cost and forgets the warm-up). Why a bound, not the
    estimate: a step's timing is noisy (a few ms on a GPU, more on a shared
    host) and the first steps verify every draft while they are also the
    slowest (warm-up), so where rows cost nothing the raw slope is
    positive by chance or by that confound, and charged as a row cost it
    cuts drafts that are free; a row is charged only the compute the steps
    show it costs. An unproven slope is 0, the width widens, the row counts
    spread and the bound tightens toward a real cost where there is one.
    0 until three steps are measured and their row counts differ.
    ``t_fixed`` (drafting, the forward's fixed cost, host work): the
    (weighted) mean of ``wall - t_row · (c + R) - β · ℓ(c + R)`` over the
    steps (wall after the prefill), floored at a tenth of the mean step.
    Where the engine does not time the verify or the waits, ``β = 1`` and
    ``t_row`` is the same bound on the slope of ``wall - ℓ(c + R)`` on the
    rows.

  The objective counts committed tokens (accepted drafts + the bonus), so
  a narrower verify is chosen only where the time it saves is worth more
  than the accepted drafts it gives up.
  Before any step is measured, every draft is verified (the estimators learn
  from uncensored rounds first). ``k_min = 1`` where a draft exists, so the
  first position's acceptance keeps being measured.

  Exploration: a position past the chosen width is never at risk, so an
  estimate that came out low early (a short run of rejections, or the
  inherited rate of the position before) would never be corrected, and the
  width it justified would stay (the exploration trap). Every 17th decision
  (``explore_every``; the decisions counted from the first measured step)
  therefore verifies that request past the width it would otherwise get,
  ``w``: to ``min(n, max(w + 2, 2w))`` drafts (:func:`explore_widths`; the
  other requests of that step are chosen again with it, so they widen where
  its rows make theirs cheaper). The positions just past the width are what
  decides whether widening pays (``S`` falls with depth, so a row deeper
  than one not worth verifying is rarely worth it); measured there, an
  estimate that was low is corrected, the width grows, and the next
  exploration reaches past the new width: the width climbs to where the
  acceptance pays for it, doubling at most per exploration. Positions
  further out inherit the deepest measured rate. Not the whole block (the
  rule before): on a link-bound step every explored row routes to experts
  that must be copied, and on the H200's replayed proxy trace (τ ~1.5,
  cache 0.2, c=4) the whole-block rounds were up to a quarter of the
  verified drafts and a fifth of their modeled link time, for ~0.37
  expected tokens each at ~8x the run's seconds per token
  (``bench/results/cpu/explore-2026-12-03``). Where rows are cheap the
  width already verifies them, so exploring is needed, and bounded, only
  where rows cost. A fixed schedule rather than an optimistic estimate: it
  is deterministic, its cost is bounded whatever the estimates, and it
  measures the positions past the width without censoring them at the
  width. 17, a prime, so that with a steady batch of ``c`` requests the
  exploring steps do not fall into a fixed step pattern (the PD
  controller's paired probes alternate AB, BA: a period of 16 decisions
  would put every exploring step of a 4-request batch in the same arm).
  ``adaptive:explore=N`` sets the period (0: never explore: the ablation
  that prices exploration) and ``adaptive:reach=R`` the drafts an
  exploring decision verifies past the width at least (2 by default; at
  width 1, ``reach=1`` explores position 2 only, the position that decides
  whether width 2 pays, at half the rows).

  Value of information (``adaptive:voi=1``, the default): a due
  exploration runs only where what it could find could change the width
  (:func:`optimistic_width`). Each position it would verify past the
  width is given the upper bound of its continuation estimate (the
  estimate plus :attr:`AdaptiveWidth.EXPLORE_Z` standard errors, at most
  1); where the batch's best widths, by the step time the widths are
  chosen by, give the request no more drafts with those positions at their
  upper bounds than with their estimates, the exploration could not change
  the width and is skipped. After :attr:`AdaptiveWidth.EXPLORE_SKIP_LIMIT`
  skipped in a row the next due one runs whatever the bounds say, so a
  model wrong about the rows' cost, or an acceptance that changed, is still
  caught, at a quarter of the schedule's rate. ``voi=0`` runs every due
  exploration (the schedule alone).

  Where rows are dear (a link-bound step) and the drafter weak, an
  exploration costs a step a further row's copies for a fraction of a
  token (on the CPU emulation of the H100 proxy trace at c=1, three a run
  cost PD about 3%: ``bench/results/cpu/explore-voi-2026-12-05``); once
  the positions past the width are measured well below what would pay,
  the rule skips them. Its bounds are wide until a position has a few
  dozen observations, so in a short run it skips few (one in three there).
  Where rows are cheap or the acceptance high, the bounds let the
  explorations run. The rule judges by the model's own link charge, since
  an exploration changes the width only through that model: where the
  model overcharges a row (``hinge`` charges its whole link time; on a
  synthetic plant where 30% of it was exposed, one request) the
  explorations were also what widened the width, and ``voi`` reads 1-3%
  below ``voi=0`` there. Charged at the measured average share instead, it
  would skip nothing on the H100 rows at c=1 (average 0.45, against the
  whole link time by which the exposed fetch grew across runs: the
  evidence for ``hinge``).

Its own host time (``adaptive:cost=1``, the default): choosing widths and
fitting the step model take host time each step (a few tenths of a
millisecond), which a host-bound step pays in full. Where the steps'
modeled saving (per decided step: the seconds the chosen widths' expected
tokens would take at the every-draft rate, less the chosen step's) is
below that host time over :attr:`AdaptiveWidth.COST_WINDOW` decided steps
(or under a quarter of it, :attr:`AdaptiveWidth.COST_CLEAR_RATIO`, over the
first :attr:`AdaptiveWidth.COST_CLEAR_STEPS`: a clear reading, where the
full window's steps would only pay the width's host time for a verdict
already plain), the width stands down: every draft is verified, no width
is chosen and only the acceptance estimates observe the steps, but for the
:attr:`AdaptiveWidth.COST_REFRESH_STEPS` before each probe, whose cost
refreshes the step model. The :attr:`AdaptiveWidth.COST_PROBE_EVERY` th
step while standing down decides once more (a probe); where the probe's
modeled saving exceeds the decided steps' mean host time the width comes
back, else the steps to the next probe double, up to
:attr:`AdaptiveWidth.COST_PROBE_MAX_EVERY` (a workload where the width
cannot pay pays for its probes and their refresh steps less and less
often: at a fixed 16 they were 5 steps in 16). A step between probes
reads nothing but the acceptance outcomes (kept, and learned in one batch
at the width's next reading: :meth:`AdaptiveWidth.observe_outcomes`): no
step model, no routing union, no cost marks at its start
(:attr:`AdaptiveWidth.next_step_may_read_cost`). On the tiny default (a
host-bound step whose expert copies cost microseconds) the chosen widths
were the whole block in most steps: on the CPU the width's host time was
0.3-0.6 ms a decided step against a modeled saving of 0-0.3 ms, 0.1-0.2 ms
a step standing down (``bench/results/cpu/width-cost-2026-12-06``).
``cost=0`` never stands down. The host time is what the
engine side measures (:attr:`WidthStep.policy_host_s`); without it (a
policy driven without the engine) the width never stands down.

The policy is deterministic given its observations (no clock of its own);
the engine measures (:class:`WidthHook`), the policy decides. Its
observations are timings, so a sampled request with a seed of its own is
not given to a timing-dependent policy: it keeps every draft, and the same
seed gives the same tokens whatever the load (:class:`WidthHook`).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from pdflash.engine.fixed_step import StepTimeFit
from pdflash.protocols import link_state_of

if TYPE_CHECKING:
    from pdflash.engine.engine import Engine, StepReport
    from pdflash.engine.requests import Request
    from pdflash.engine.verify import VerifyResult

#: :class:`UnionGrowth`'s curve forms
UNION_FORMS = ("geometric", "hyperbolic")
#: how the adaptive width charges a further modeled link second (``beta=``)
BETA_MODES = ("average", "marginal", "one", "hinge")
#: what the adaptive width charges a verified row beyond its modeled link
#: time (``row=``)
ROW_MODES = ("compute", "wall")
#: the ``adaptive:`` options, in the order :class:`WidthSetting` writes them
ADAPTIVE_OPTION_KEYS = (
    "shrink",
    "z",
    "cal",
    "union",
    "beta",
    "row",
    "explore",
    "reach",
    "voi",
    "cost",
)
WIDTH_KINDS = (
    "full",
    "fixed:K",
    "adaptive[:shrink=W][:z=Z][:cal=0|1][:union=FORM][:beta=average|marginal|one|hinge]"
    "[:row=compute|wall][:explore=N][:reach=R][:voi=0|1][:cost=0|1]",
)


@dataclass(frozen=True)
class WidthSetting:
    """A parsed ``verify_width`` setting: ``kind`` is ``full``, ``fixed``
    or ``adaptive``; ``drafts`` is ``K`` of ``fixed:K``; ``shrink_weight``,
    ``survival_z``, ``calibrate``, ``union_form``, ``beta_mode``,
    ``row_mode``, ``explore_every``, ``explore_reach``, ``explore_voi`` and
    ``cost_gate`` override
    :class:`AdaptiveWidth`'s (None: its defaults), so a benchmark can measure
    the estimator's settings side by side under their own names."""

    kind: str
    drafts: int | None = None
    shrink_weight: float | None = None
    survival_z: float | None = None
    calibrate: bool | None = None
    union_form: str | None = None
    beta_mode: str | None = None
    row_mode: str | None = None
    explore_every: int | None = None
    explore_reach: int | None = None
    explore_voi: bool | None = None
    cost_gate: bool | None = None

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{self.drafts}"
        if self.kind != "adaptive":
            return self.kind
        values = (
            self.shrink_weight,
            self.survival_z,
            self.calibrate,
            self.union_form,
            self.beta_mode,
            self.row_mode,
            self.explore_every,
            self.explore_reach,
            self.explore_voi,
            self.cost_gate,
        )
        parts = ["adaptive"] + [
            f"{key}={_option_text(value)}"
            for key, value in zip(ADAPTIVE_OPTION_KEYS, values, strict=True)
            if value is not None
        ]
        return ":".join(parts)


def _option_text(value: float | str | bool) -> str:
    """An ``adaptive:`` option's value as the parser reads it (flags 0/1)."""
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def is_adaptive(setting: str) -> bool:
    """Whether a ``verify_width`` setting is ``adaptive`` (with or without
    options)."""
    return setting == "adaptive" or setting.startswith("adaptive:")


def _adaptive_options(text: str, tail: str) -> WidthSetting:
    """``adaptive:`` options: ``shrink=W`` (W > 0), ``z=Z`` (Z >= 0),
    ``cal=0|1``, ``union=geometric|hyperbolic``,
    ``beta=average|marginal|one|hinge``, ``row=compute|wall``, ``explore=N`` (an
    integer >= 0; 0: never explore), ``reach=R`` (an integer >= 1),
    ``voi=0|1`` (0: every due exploration runs) and ``cost=0|1`` (0: the
    width never stands down for its host time), each at most once,
    ``:``-separated (a benchmark's width list is ``,``-separated)."""
    values: dict[str, str] = {}
    for part in tail.split(":"):
        key, eq, value = part.partition("=")
        if not eq or key not in ADAPTIVE_OPTION_KEYS or key in values:
            raise ValueError(
                f"verify_width {text!r}: adaptive takes :shrink=W, :z=Z, :cal=0|1, "
                f":union={'|'.join(UNION_FORMS)}, :beta={'|'.join(BETA_MODES)}, "
                f":row={'|'.join(ROW_MODES)}, :explore=N, :reach=R, :voi=0|1 and :cost=0|1, "
                "each once"
            )
        values[key] = value
    numbers: dict[str, float] = {}
    for key in ("shrink", "z"):
        if key not in values:
            continue
        try:
            v = float(values[key])
        except ValueError:
            raise ValueError(f"verify_width {text!r}: {key} must be a number") from None
        if not math.isfinite(v) or (v <= 0.0 if key == "shrink" else v < 0.0):
            raise ValueError(
                f"verify_width {text!r}: shrink must be > 0 and z >= 0, got {key}={values[key]}"
            )
        numbers[key] = v
    flags: dict[str, bool] = {}
    for key in ("cal", "voi", "cost"):
        if key in values:
            if values[key] not in ("0", "1"):
                raise ValueError(
                    f"verify_width {text!r}: {key} must be 0 or 1, got {values[key]!r}"
                )
            flags[key] = values[key] == "1"
    union = values.get("union")
    if union is not None and union not in UNION_FORMS:
        raise ValueError(
            f"verify_width {text!r}: union must be one of {UNION_FORMS}, got {union!r}"
        )
    beta = values.get("beta")
    if beta is not None and beta not in BETA_MODES:
        raise ValueError(f"verify_width {text!r}: beta must be one of {BETA_MODES}, got {beta!r}")
    row = values.get("row")
    if row is not None and row not in ROW_MODES:
        raise ValueError(f"verify_width {text!r}: row must be one of {ROW_MODES}, got {row!r}")
    counts: dict[str, int] = {}
    for key, least in (("explore", 0), ("reach", 1)):
        if key in values:
            if not values[key].isdigit() or int(values[key]) < least:
                raise ValueError(
                    f"verify_width {text!r}: {key} must be an integer >= {least}, "
                    f"got {values[key]!r}"
                )
            counts[key] = int(values[key])
    return WidthSetting(
        "adaptive",
        shrink_weight=numbers.get("shrink"),
        survival_z=numbers.get("z"),
        calibrate=flags.get("cal"),
        union_form=union,
        beta_mode=beta,
        row_mode=row,
        explore_every=counts.get("explore"),
        explore_reach=counts.get("reach"),
        explore_voi=flags.get("voi"),
        cost_gate=flags.get("cost"),
    )


def parse_width(text: object, block_size: int | None = None) -> WidthSetting:
    """Parse ``full`` | ``fixed:K`` |
    ``adaptive[:shrink=W][:z=Z][:cal=0|1][:union=FORM][:beta=MODE][:row=MODE]
    [:explore=N][:reach=R][:voi=0|1][:cost=0|1]``; ``K``
    is an integer in ``[0, block_size - 1]`` (the drafts a block holds).
    Raises ``ValueError`` with the accepted forms on anything else."""
    if not isinstance(text, str):
        raise ValueError(f"verify_width must be a string ({' | '.join(WIDTH_KINDS)}), got {text!r}")
    s = text.strip()
    if s in ("full", "adaptive"):
        return WidthSetting(s)
    if s.startswith("adaptive:"):
        return _adaptive_options(text, s[len("adaptive:") :])
    if s.startswith("fixed:"):
        tail = s[len("fixed:") :]
        if not tail.isdigit():
            raise ValueError(
                f"verify_width {text!r}: K of fixed:K must be an integer >= 0 (drafts verified)"
            )
        k = int(tail)
        if block_size is not None and k > block_size - 1:
            raise ValueError(
                f"verify_width {text!r}: K={k} exceeds the {block_size - 1} drafts of a "
                f"block of {block_size}"
            )
        return WidthSetting("fixed", k)
    raise ValueError(f"verify_width must be one of {' | '.join(WIDTH_KINDS)}, got {text!r}")


@dataclass(frozen=True)
class WidthRequest:
    """A request about to be verified: ``available`` drafts were drafted."""

    request_id: int
    available: int


@dataclass(frozen=True)
class WidthOutcome:
    """One request's verify: ``verified`` drafts were checked (after the
    batcher's trim), ``accepted`` of them accepted."""

    request_id: int
    verified: int
    accepted: int


@dataclass(frozen=True)
class WidthStep:
    """What one step's verify cost, for the time model.

    Attributes:
        outcomes: every verified request's outcome.
        wall_s: the step's wall time after its prefill (None: not measured).
        union_experts: (layer, expert) pairs any row of the verify routed to.
        copied_bytes: expert bytes the cache copied in during the step (None:
            no offloaded cache; every expert resident).
        link_bytes_per_s: the link's measured rate (None: not measured).
        verify_compute_s: the verify forward's seconds less its waits on
            expert copies (None: not measured).
        exposed_fetch_s: seconds the step's forwards waited on expert copies
            (None: not measured).
        policy_host_s: host seconds the width's own work took since the last
            observation (the engine side's marks, the policy's decision and
            its previous observation; None: not measured).
    """

    outcomes: tuple[WidthOutcome, ...]
    wall_s: float | None = None
    union_experts: int | None = None
    copied_bytes: int | None = None
    link_bytes_per_s: float | None = None
    verify_compute_s: float | None = None
    exposed_fetch_s: float | None = None
    policy_host_s: float | None = None


@runtime_checkable
class VerifyWidthPolicy(Protocol):
    """Decides how many drafts of each request the coming verify checks."""

    @property
    def name(self) -> str: ...

    def widths(self, requests: Sequence[WidthRequest]) -> list[int]:
        """Drafts to verify per request, each in ``[0, available]``."""
        ...

    def observe(self, step: WidthStep) -> None:
        """Record one verify step's outcomes and cost."""
        ...

    def forget(self, request_id: int) -> None:
        """The request left; drop its history."""
        ...

    def stats(self) -> dict[str, Any]:
        """JSON-ready: what it decided (mean width, expected vs realized
        accepted drafts) and its current estimates."""
        ...

    def reset_stats(self) -> None:
        """Start the books over; what was learned stays."""
        ...


class _Books:
    """Decisions and outcomes, common to every policy."""

    def __init__(self, block_drafts: int) -> None:
        self.block_drafts = block_drafts
        self.reset()

    def reset(self) -> None:
        self.decisions = 0
        self.chosen = 0
        self.available = 0
        self.hist = [0] * (self.block_drafts + 1)
        self.rounds = 0
        self.verified = 0
        self.accepted = 0
        self.expected = 0.0
        self.expected_rounds = 0

    def decided(self, available: int, k: int) -> None:
        self.decisions += 1
        self.chosen += k
        self.available += available
        self.hist[min(k, self.block_drafts)] += 1

    def summary(self, name: str) -> dict[str, Any]:
        def mean(num: float, den: int) -> float | None:
            return num / den if den else None

        return {
            "policy": name,
            "decisions": self.decisions,
            "mean_width_drafts": mean(self.chosen, self.decisions),
            "mean_available_drafts": mean(self.available, self.decisions),
            "width_histogram": list(self.hist),
            "rounds": self.rounds,
            "mean_verified_drafts": mean(self.verified, self.rounds),
            "mean_accepted_drafts": mean(self.accepted, self.rounds),
            # the policy's expectation of the accepted drafts at the widths it
            # chose, over the rounds it had an expectation for (adaptive only)
            "expected_accepted_drafts": mean(self.expected, self.expected_rounds),
        }


class _CostBooks:
    """The cost gate's books (``adaptive:cost=1``) over a measured run."""

    #: switches listed (the count goes on)
    LISTED = 16

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.decided_steps = 0
        self.host_s = 0.0
        self.saving_s = 0.0
        self.stood_down_steps = 0
        self.stood_down_host_s = 0.0
        self.probes = 0
        self.switch_count = 0
        self.switches: list[dict[str, Any]] = []

    def switch(self, *, on: bool, why: str) -> None:
        self.switch_count += 1
        if len(self.switches) < self.LISTED:
            self.switches.append({"decided_step": self.decided_steps, "on": on, "why": why})

    def summary(self, enabled: bool, standing_down: bool) -> dict[str, Any]:
        def per_step_ms(total: float) -> float | None:
            return 1e3 * total / self.decided_steps if self.decided_steps else None

        return {
            "enabled": enabled,
            "standing_down": standing_down,
            "decided_steps": self.decided_steps,
            "host_ms_per_decided_step": per_step_ms(self.host_s),
            "modeled_saving_ms_per_decided_step": per_step_ms(self.saving_s),
            "stood_down_steps": self.stood_down_steps,
            "host_ms_per_stood_down_step": (
                1e3 * self.stood_down_host_s / self.stood_down_steps
                if self.stood_down_steps
                else None
            ),
            "probes": self.probes,
            "switch_count": self.switch_count,
            "switches": list(self.switches),
        }


def modeled_saving_s(chosen: tuple[float, float], every: tuple[float, float]) -> float:
    """Seconds a decision's widths save by the width's own model: the time
    the chosen widths' expected committed tokens would take at the
    every-draft rate, less the chosen step's time (at least 0: an exploring
    decision may be wider than the best). ``chosen`` and ``every`` are
    ``(expected committed tokens, step s)``."""
    (tokens, step_s), (every_tokens, every_s) = chosen, every
    if every_tokens <= 0.0 or every_s <= 0.0:
        return 0.0
    return max(0.0, tokens * every_s / every_tokens - step_s)


class FixedWidth:
    """``fixed:K`` (and, with ``drafts=None``, ``full``): the first ``K``
    drafts, or every draft."""

    def __init__(self, drafts: int | None, block_size: int) -> None:
        if drafts is not None and drafts < 0:
            raise ValueError(f"drafts must be >= 0, got {drafts}")
        self.drafts = drafts
        self._books = _Books(max(0, block_size - 1))

    @property
    def name(self) -> str:
        return "full" if self.drafts is None else f"fixed:{self.drafts}"

    def widths(self, requests: Sequence[WidthRequest]) -> list[int]:
        out = [
            r.available if self.drafts is None else min(self.drafts, r.available) for r in requests
        ]
        for r, k in zip(requests, out, strict=True):
            self._books.decided(r.available, k)
        return out

    def observe(self, step: WidthStep) -> None:
        for o in step.outcomes:
            self._books.rounds += 1
            self._books.verified += o.verified
            self._books.accepted += o.accepted

    def forget(self, request_id: int) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return self._books.summary(self.name)

    def reset_stats(self) -> None:
        self._books.reset()


class SurvivalEstimator:
    """``S(j) = P(A >= j)`` per request, from censored verify outcomes (the
    module docstring gives the counts and the shrinkage).

    Args:
        max_drafts: deepest position tracked (``block_size - 1``).
        prior_accept: the prior continuation probability of position 1.
        prior_weight: pseudo-rounds of the prior in the global estimate.
        shrink_weight: pseudo-rounds of the global estimate in a request's.
    """

    def __init__(
        self,
        max_drafts: int,
        *,
        prior_accept: float = 0.5,
        prior_weight: float = 2.0,
        shrink_weight: float = 4.0,
    ) -> None:
        if max_drafts < 0:
            raise ValueError(f"max_drafts must be >= 0, got {max_drafts}")
        if not 0.0 < prior_accept < 1.0:
            raise ValueError(f"prior_accept must be in (0, 1), got {prior_accept}")
        for nm, w in (("prior_weight", prior_weight), ("shrink_weight", shrink_weight)):
            if not w > 0.0:
                raise ValueError(f"{nm} must be > 0, got {w}")
        self.max_drafts = max_drafts
        self.prior_accept = prior_accept
        self.prior_weight = prior_weight
        self.shrink_weight = shrink_weight
        # index j-1 counts position j (1..max_drafts)
        self.at_risk = np.zeros(max_drafts, dtype=np.int64)
        self.passed = np.zeros(max_drafts, dtype=np.int64)
        self._req: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        # global_continuation() as of the last observe (read once or more per
        # request per step; None: recompute)
        self._global: np.ndarray | None = None

    def observe(self, request_id: int, verified: int, accepted: int) -> None:
        """One round that verified ``verified`` drafts and accepted ``accepted``."""
        if not 0 <= accepted <= verified:
            raise ValueError(f"need 0 <= accepted <= verified, got {accepted}, {verified}")
        v = min(verified, self.max_drafts)
        a = min(accepted, v)
        risk = min(a + 1, v)  # positions whose acceptance this round observed
        req = self._req.get(request_id)
        if req is None:
            req = (np.zeros(self.max_drafts, np.int64), np.zeros(self.max_drafts, np.int64))
            self._req[request_id] = req
        for at_risk, passed in ((self.at_risk, self.passed), req):
            at_risk[:risk] += 1
            passed[:a] += 1
        self._global = None

    def observe_many(self, outcomes: Sequence[tuple[int, int, int]]) -> None:
        """:meth:`observe` of every ``(request id, verified, accepted)`` round
        in ``outcomes`` (in order; the counts are sums, so the state is the
        same as one call each), counted per position by histogram: a few
        array operations per request instead of four per round. Raises
        ValueError, the state unchanged, where any round is invalid."""
        if not outcomes:
            return
        table = np.asarray(outcomes, dtype=np.int64).reshape(-1, 3)
        verified, accepted = table[:, 1], table[:, 2]
        bad = np.flatnonzero((accepted < 0) | (accepted > verified))
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"need 0 <= accepted <= verified, got {int(accepted[i])}, {int(verified[i])}"
            )
        d = self.max_drafts
        v = np.minimum(verified, d)
        a = np.minimum(accepted, v)
        risk = np.minimum(a + 1, v)

        def reached(counts: np.ndarray) -> np.ndarray:
            # position j (index j - 1) is reached by every round whose count >= j
            hist = np.bincount(counts, minlength=d + 1)
            return np.cumsum(hist[::-1])[::-1][1:]

        self.at_risk += reached(risk)
        self.passed += reached(a)
        rids = table[:, 0]
        for rid in dict.fromkeys(rids.tolist()):
            mine = rids == rid
            req = self._req.get(rid)
            if req is None:
                req = (np.zeros(d, np.int64), np.zeros(d, np.int64))
                self._req[rid] = req
            req[0][:] += reached(risk[mine])
            req[1][:] += reached(a[mine])
        self._global = None

    def forget(self, request_id: int) -> None:
        self._req.pop(request_id, None)

    def request_ids(self) -> list[int]:
        """The requests with estimates of their own."""
        return list(self._req)

    def global_continuation(self) -> np.ndarray:
        """``c_j`` of all requests pooled, ``j = 1..max_drafts`` (read-only:
        computed once per observation, shared until the next)."""
        if self._global is None:
            out = np.empty(self.max_drafts, dtype=np.float64)
            prior, w = self.prior_accept, self.prior_weight
            for j, (passed, at_risk) in enumerate(
                zip(self.passed.tolist(), self.at_risk.tolist(), strict=True)
            ):
                prior = (passed + w * prior) / (at_risk + w)  # an unmeasured position inherits
                out[j] = prior
            out.flags.writeable = False
            self._global = out
        return self._global

    def continuation(self, request_id: int) -> np.ndarray:
        """``c_j`` of one request, shrunk toward the global estimate."""
        g = self.global_continuation()
        req = self._req.get(request_id)
        if req is None:
            return g
        at_risk, passed = req
        w = self.shrink_weight
        return (passed + w * g) / (at_risk + w)

    def survival(self, request_id: int) -> np.ndarray:
        """``[S(1), ..., S(max_drafts)]`` of one request."""
        return np.cumprod(self.continuation(request_id))

    def global_variance(self) -> np.ndarray:
        """The sampling variance of each global ``c_j``: ``c(1 - c) / (n +
        prior_weight + 1)``, ``n`` its rounds at risk (a position no round
        reached has only the prior's pseudo-rounds)."""
        g = self.global_continuation()
        return g * (1.0 - g) / (self.at_risk + self.prior_weight + 1.0)

    def continuation_error(self, request_id: int) -> np.ndarray:
        """The standard error of one request's ``c_j``: its own ``n`` rounds'
        binomial noise and the global estimate's, in the shares the
        shrinkage gives them, ``sqrt(n c(1 - c) + w² var(g)) / (n + w)``."""
        var_g = self.global_variance()
        req = self._req.get(request_id)
        if req is None:
            return np.asarray(np.sqrt(var_g), dtype=np.float64)
        at_risk = req[0].astype(np.float64)
        c = self.continuation(request_id)
        w = self.shrink_weight
        se = np.sqrt(at_risk * c * (1.0 - c) + w * w * var_g) / (at_risk + w)
        return np.asarray(se, dtype=np.float64)

    def survival_lower(self, request_id: int, z: float) -> np.ndarray:
        """``S(j)`` from the lower bounds ``max(0, c_j - z se(c_j))`` of the
        continuations (``z = 0``: :meth:`survival`)."""
        if z < 0.0:
            raise ValueError(f"z must be >= 0, got {z}")
        c = self.continuation(request_id)
        if z > 0.0:
            c = np.clip(c - z * self.continuation_error(request_id), 0.0, 1.0)
        return np.cumprod(c)


def union_keep(rows_after_first: float, novelty: float, form: str = "geometric") -> float:
    """The share of ``S - top_k`` a union of ``1 + rows_after_first`` rows
    has not reached: ``(1 - a)^n`` (``geometric``) or ``1 / (1 + a n)``
    (``hyperbolic``)."""
    if form == "geometric":
        return float((1.0 - novelty) ** rows_after_first)
    if form == "hyperbolic":
        return 1.0 / (1.0 + novelty * rows_after_first)
    raise ValueError(f"union form must be one of {UNION_FORMS}, got {form!r}")


def union_curve(
    rows: int, novelty: float, saturation: float, top_k: int, form: str = "geometric"
) -> float:
    """``U(rows) = S - (S - top_k) keep(rows - 1)`` (0 for no rows): the
    expected routed experts per layer of ``rows`` rows under
    :class:`UnionGrowth`'s ``form`` (:func:`union_keep`), for a novelty rate
    ``a`` and saturation ``S``."""
    if rows <= 0:
        return 0.0
    return saturation - (saturation - top_k) * union_keep(rows - 1, novelty, form)


#: :meth:`UnionGrowth._grid`'s grids: (form, grid size, smallest and largest
#: rate, coarse index or None) -> (rates, log(1 - rates))
_UNION_GRIDS: dict[tuple[str, int, float, float, int | None], tuple[np.ndarray, np.ndarray]] = {}


class UnionGrowth:
    """The per-layer routed union of a verify's ``r`` rows,
    ``U(r) = S - (S - top_k)(1 - a)^(r - 1)``: the first row routes to
    ``top_k`` experts, each further row to a share ``a`` (the novelty rate)
    of the experts of the layer's reachable set ``S`` (the saturation,
    ``top_k <= S <= E``) it has not yet routed to.

    Both parameters are fitted to the observed unions, so the curve follows
    a union that rises fast and then levels off below ``E`` (skewed routing:
    some experts are rarely or never routed). With ``S`` fixed at ``E``,
    one rate cannot: fitted to such unions it comes out small, and the curve
    still climbs where the measured union has stopped, charging rows for
    experts they do not add.

    ``form="hyperbolic"`` replaces ``(1 - a)^(r - 1)`` by ``1 / (1 + a(r -
    1))`` (:func:`union_keep`): each further row adds experts at a rate that
    falls like ``1 / r^2`` rather than geometrically, so the curve keeps
    climbing past the rows observed. On the H200 proxies' learned routing
    (four committed traces' whole 16-row verify blocks), fitted to rows 2-4
    of a block (what a width of 1-3 drafts observes), the geometric curve
    put 0.08-0.47x the experts rows 10-16 actually add, the hyperbolic one
    0.60-0.83x; on i.i.d. routing, where the geometric form is exact, the
    hyperbolic one (``S <= E``) puts 0.70x
    (``bench/results/cpu/union-fit-2026-12-04``). Under the geometric form
    a verify width fitted to narrow verifies finds deep rows cheaper than
    they are on learned routing, and widens where they do not pay.

    The fit: weighted least squares of the mean per-layer union ``u`` on
    the rows ``r`` over every observation (``r >= 2``), pooled per row count
    (exact up to :attr:`EXACT_ROWS` rows, beyond in geometric classes of
    ``2^(1/8)``, each at its observations' mean row count: the fit's cost
    stays bounded whatever the batch), with ``prior_weight``
    pseudo-observations of i.i.d. routing's second row
    (``U(2) = top_k + (E - top_k) top_k / E``), which pins the early slope
    until rows are observed near it. For each novelty rate of a geometric
    grid (:attr:`GRID` rates from :attr:`MIN_NOVELTY` to 1, then
    :attr:`GRID` more between the best one's neighbours) the best ``S`` is
    closed-form (clipped to ``[top_k, E]``); the least squared error wins
    (ties, up to rounding: the smaller ``a``). Unions observed at one row
    count only (a width of one draft sees two rows, and the prior sits
    there too) fit every rate from the least that reaches them up to 1;
    the least is kept, so the curve keeps climbing toward ``E`` past them
    rather than charging further rows nothing. Deterministic given the
    observations. Past
    the largest observed row count the curve extrapolates its own form (it
    keeps levelling off toward ``S``); a later observation there corrects
    it (the adaptive width's exploration rounds verify past the width, up
    to twice it, so the row counts observed climb with the width).
    """

    #: novelty rates per stage of the fit's grid search
    GRID = 32
    MIN_NOVELTY = 1e-3
    #: the largest novelty rate of each form's grid (a hyperbolic rate may
    #: exceed 1: a union that levels off within a few rows)
    MAX_NOVELTY: ClassVar[dict[str, float]] = {"geometric": 1.0, "hyperbolic": 100.0}
    #: row counts pooled exactly; larger ones in geometric classes
    EXACT_ROWS = 32
    #: squared errors within this share of the data's weighted sum of
    #: squares are equal (a tie goes to the smaller rate)
    TIE_TOLERANCE = 1e-9

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        *,
        prior_weight: float = 1.0,
        form: str = "geometric",
    ) -> None:
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"need 1 <= top_k <= num_experts, got {top_k}, {num_experts}")
        if not prior_weight > 0.0:
            raise ValueError(f"prior_weight must be > 0, got {prior_weight}")
        if form not in UNION_FORMS:
            raise ValueError(f"union form must be one of {UNION_FORMS}, got {form!r}")
        self.form = form
        self.num_experts = num_experts
        self.top_k = top_k
        self.prior_weight = prior_weight
        self.observations = 0
        # row class -> [observations, sum of their rows, sum of their mean
        # per-layer unions]
        self._bins: dict[int, list[float]] = {}
        self._fit: tuple[float, float] | None = None  # (a, S), None: refit

    def observe(self, rows: int, mean_union: float) -> None:
        """A verify of ``rows`` rows routed to ``mean_union`` experts per
        layer (a single row says nothing about growth)."""
        if rows < 2 or self.top_k >= self.num_experts:
            return
        u = min(max(float(mean_union), float(self.top_k)), float(self.num_experts))
        key = rows if rows <= self.EXACT_ROWS else -round(8.0 * math.log2(rows))
        b = self._bins.setdefault(key, [0.0, 0.0, 0.0])
        b[0] += 1.0
        b[1] += rows
        b[2] += u
        self.observations += 1
        self._fit = None

    def fitted(self) -> tuple[float, float]:
        """``(a, S)``: the novelty rate and the saturation."""
        if self._fit is None:
            self._fit = self._refit()
        return self._fit

    def _refit(self) -> tuple[float, float]:
        e, k = float(self.num_experts), float(self.top_k)
        if k >= e:
            return 1.0, e
        if not self._bins:
            return k / e, e  # nothing observed: i.i.d. routing
        bins = list(self._bins.values())
        w = np.asarray([self.prior_weight] + [b[0] for b in bins])
        n = np.asarray([1.0] + [b[1] / b[0] - 1.0 for b in bins])  # rows - 1
        u = np.asarray([k + (e - k) * k / e] + [b[2] / b[0] for b in bins])
        tie = self.TIE_TOLERANCE * float((w * u * u).sum())

        def best(rates: np.ndarray, log_keep: np.ndarray) -> tuple[int, float]:
            if self.form == "geometric":
                keep = np.exp(log_keep[:, None] * n[None, :])  # (1 - a)^(r - 1)
            else:
                keep = 1.0 / (1.0 + rates[:, None] * n[None, :])  # 1 / (1 + a(r - 1))
            grown = 1.0 - keep
            # U = S·grown + k·keep: the least-squares S of each rate, clipped
            den = (w * grown * grown).sum(axis=1)
            num = (w * (u - k * keep) * grown).sum(axis=1)
            sat = np.clip(num / np.maximum(den, 1e-300), k, e)
            err = (w * (sat[:, None] * grown + k * keep - u) ** 2).sum(axis=1)
            # the first (smallest a) of equal errors, equal up to rounding:
            # unions seen at one row count fit every rate from the least that
            # reaches them up to 1 exactly, and rounding alone must not pick
            # a = 1 (no growth past the rows seen)
            i = int(np.flatnonzero(err <= err.min() + tie)[0])
            return i, float(sat[i])

        i, _ = best(*self._grid(None))
        fine, log_keep = self._grid(i)
        j, sat = best(fine, log_keep)
        return float(fine[j]), sat

    def _grid(self, coarse_best: int | None) -> tuple[np.ndarray, np.ndarray]:
        """The fit's rates and their ``log(1 - a)``: the coarse grid (None),
        or the fine grid between coarse rate ``coarse_best``'s neighbours.
        The same few grids serve every refit, so they are built once per
        (form, grid) and shared (read-only) by every instance."""
        top = self.MAX_NOVELTY[self.form]
        key = (self.form, self.GRID, self.MIN_NOVELTY, top, coarse_best)
        grid = _UNION_GRIDS.get(key)
        if grid is None:
            coarse = np.geomspace(self.MIN_NOVELTY, top, self.GRID)
            rates = coarse
            if coarse_best is not None:
                lo, hi = max(coarse_best - 1, 0), min(coarse_best + 1, self.GRID - 1)
                rates = np.geomspace(coarse[lo], coarse[hi], self.GRID)
            log_keep = np.log1p(-np.minimum(rates, 1.0 - 1e-12))
            for a in (rates, log_keep):
                a.flags.writeable = False
            grid = _UNION_GRIDS[key] = (rates, log_keep)
        return grid

    @property
    def novelty(self) -> float:
        """``a``: the share of the not-yet-routed experts of ``S`` a further
        row routes to."""
        return self.fitted()[0]

    @property
    def saturation(self) -> float:
        """``S``: the experts per layer a batch's union levels off at."""
        return self.fitted()[1]

    def union(self, rows: int) -> float:
        """``U(rows)``: expected routed experts per layer of ``rows`` rows."""
        a, sat = self.fitted()
        return union_curve(rows, a, sat, self.top_k, self.form)

    def added(self, row: int) -> float:
        """``g(row)``: experts per layer row ``row`` (2 = first draft) adds."""
        if row < 2:
            return float(self.top_k)
        if self.form == "hyperbolic":
            return self.union(row) - self.union(row - 1)
        a, sat = self.fitted()
        return (sat - self.top_k) * a * (1.0 - a) ** (row - 2)


def best_width(
    survival: Sequence[float], row_cost: Sequence[float], t0: float, k_min: int = 0
) -> int:
    """``argmax_k (1 + Σ_{j<=k} S(j)) / (t0 + Σ_{j<=k} Δt_j)`` over
    ``k_min <= k <= len(survival)`` (ties: the smallest ``k``);
    ``survival[j-1] = S(j)``, ``row_cost[j-1] = Δt_j``."""
    n = len(survival)
    if len(row_cost) != n:
        raise ValueError(f"survival ({n}) and row_cost ({len(row_cost)}) differ in length")
    if not t0 > 0.0:
        raise ValueError(f"t0 must be > 0, got {t0}")
    k_min = min(max(0, k_min), n)
    gain = 1.0 + float(sum(survival[:k_min]))
    cost = t0 + float(sum(row_cost[:k_min]))
    best_k, best = k_min, gain / cost
    for j in range(k_min, n):
        gain += float(survival[j])
        cost += float(row_cost[j])
        value = gain / cost
        if value > best * (1.0 + 1e-12):
            best_k, best = j + 1, value
    return best_k


def best_batch_widths(
    survivals: Sequence[Sequence[float]],
    step_time: Callable[[int], float],
    k_min: int | Sequence[int] = 1,
) -> list[int]:
    """The widths ``k_i`` maximizing ``Σ_i (1 + Σ_{j<=k_i} S_i(j)) / T(Σ_i k_i)``
    with ``min(k_min_i, n_i) <= k_i <= n_i = len(survivals[i])`` (``k_min``
    one bound for every request, or one per request);
    ``survivals[i][j-1] = S_i(j)`` (nonincreasing in ``j``), ``step_time(R)``
    the step's time with ``R`` drafted rows in all (> 0). Exact for a
    ``T`` that depends on ``R`` only: for each ``R`` the ``R`` largest
    ``S_i(j)`` win (ties: lower request index, then position), and every
    ``R`` is scanned (ties: the smaller ``R``)."""
    mins = [k_min] * len(survivals) if isinstance(k_min, int) else list(k_min)
    if len(mins) != len(survivals):
        raise ValueError(f"k_min has {len(mins)} bounds for {len(survivals)} requests")
    base = [min(max(0, m), len(s)) for s, m in zip(survivals, mins, strict=True)]
    gain = float(len(survivals)) + sum(
        float(sum(s[:b])) for s, b in zip(survivals, base, strict=True)
    )
    rows = sum(base)
    cands = sorted(
        (-float(s[j]), i, j)
        for i, (s, b) in enumerate(zip(survivals, base, strict=True))
        for j in range(b, len(s))
    )
    t = step_time(rows)
    if not t > 0.0:
        raise ValueError(f"step_time({rows}) must be > 0, got {t}")
    best_n, best = 0, gain / t
    for n, (neg, _, _) in enumerate(cands, start=1):
        gain -= neg
        value = gain / step_time(rows + n)
        if value > best * (1.0 + 1e-12):
            best_n, best = n, value
    out = list(base)
    for _, i, _ in cands[:best_n]:
        out[i] += 1
    return out


def explored_width(width: int, available: int, reach: int = 2) -> int:
    """The drafts an exploring decision verifies: ``min(available,
    max(width + reach, 2 width))`` (past the width the request would
    otherwise get, doubling it at most; module docstring)."""
    return min(available, max(width + reach, 2 * width))


def optimistic_width(
    survivals: Sequence[Sequence[float]],
    widths: Sequence[int],
    i: int,
    upper: Sequence[float],
    step_time: Callable[[int], float],
    reach: int = 2,
) -> int:
    """The drafts :func:`best_batch_widths` (``k_min`` 1) gives request
    ``i`` with the continuation of each position its exploration would
    verify (past ``widths[i]``, up to :func:`explored_width`) at its upper
    bound ``upper[j-1]`` (position ``j``): more than ``widths[i]`` where the
    exploration could change its width; ``widths[i]`` where nothing is left
    to explore."""
    s, w = survivals[i], widths[i]
    top = explored_width(w, len(s), reach)
    if w < 1 or top <= w:
        return w
    if len(upper) < top:
        raise ValueError(f"upper has {len(upper)} positions, exploring needs {top}")
    optimistic = [float(x) for x in s[:w]]
    last = optimistic[-1]
    for j in range(w, top):
        last *= min(1.0, max(0.0, float(upper[j])))
        optimistic.append(last)
    lists = [list(x) for x in survivals]
    lists[i] = optimistic
    return best_batch_widths(lists, step_time, k_min=1)[i]


def explore_widths(
    survivals: Sequence[Sequence[float]],
    step_time: Callable[[int], float],
    exploring: Sequence[bool],
    reach: int = 2,
) -> tuple[list[int], list[int]]:
    """``(chosen, unexplored)``: the widths of :func:`best_batch_widths`
    (``k_min`` 1) without exploration, and with every ``exploring`` request
    verifying exactly :func:`explored_width` of its unexplored width (the
    others chosen again with those rows in the step)."""
    if len(exploring) != len(survivals):
        raise ValueError(f"exploring has {len(exploring)} flags for {len(survivals)} requests")
    base = best_batch_widths(survivals, step_time, k_min=1)
    if not any(exploring):
        return base, base
    cut, mins = [], []
    for s, k, e in zip(survivals, base, exploring, strict=True):
        if e:
            k = explored_width(k, len(s), reach)
            cut.append(s[:k])
            mins.append(k)
        else:
            cut.append(s)
            mins.append(1)
    return best_batch_widths(cut, step_time, k_min=mins), base


def _expected_value(
    survs: Sequence[np.ndarray], widths: Sequence[int], step_s: Callable[[int], float]
) -> tuple[float, float]:
    """``(expected committed tokens, step time)`` of one step at ``widths``."""
    tokens = len(survs) + sum(float(s[:k].sum()) for s, k in zip(survs, widths, strict=True))
    return tokens, step_s(sum(widths))


@dataclass(frozen=True)
class _Decision:
    """A decision's numbers, formatted only when asked for (``stats()``)."""

    widths: tuple[int, ...]
    available: tuple[int, ...]
    chosen: tuple[float, float]  # (expected committed tokens, step s)
    every: tuple[float, float]  # the same at every draft
    t_fixed: float
    t_row: float
    link_s_per_expert: float
    beta: float
    calibration: float | None  # applied (``cal=1``), else None

    def __str__(self) -> str:
        (ct, cs), (ft, fs) = self.chosen, self.every
        return (
            f"widths {list(self.widths)} of {list(self.available)}: expected committed tokens "
            f"{ct:.3g} in {cs:.3g} s = {ct / cs:.4g}/s vs every draft "
            f"{ft:.3g} in {fs:.3g} s = {ft / fs:.4g}/s (t_fixed {self.t_fixed:.3g} s, "
            f"t_row {self.t_row:.3g} s, link s/expert {self.link_s_per_expert:.3g} x exposed "
            f"share {self.beta:.3g}"
            + (
                ")"
                if self.calibration is None
                else f", calibration {self.calibration:.3g} applied)"
            )
        )


def calibrated_survival(survival: np.ndarray, kappa: float) -> np.ndarray:
    """``survival`` with every position past the first scaled by ``kappa``
    (``0 < kappa <= 1``: still nonincreasing)."""
    if not 0.0 < kappa <= 1.0:
        raise ValueError(f"kappa must be in (0, 1], got {kappa}")
    out = np.array(survival, dtype=np.float64, copy=True)
    out[1:] *= kappa
    return out


class AdaptiveWidth:
    """Acceptance- and expert-byte-aware width (module docstring).

    Args:
        block_size: the verify block ``B`` (``B - 1`` drafts at most).
        num_layers, num_experts, top_k: the MoE shape (``L``, ``E``).
        expert_bytes: bytes of one expert copy (0: nothing is copied).
        prior_accept, prior_weight, shrink_weight: see :class:`SurvivalEstimator`.
        survival_z: standard errors taken off each continuation estimate in
            the survival the widths are chosen by (module docstring; 0: the
            estimates).
        calibrate: choose the widths by the survival scaled by the
            acceptance calibration past the first draft (module docstring,
            ``cal=1``); the calibration is measured either way.
        union_form: :class:`UnionGrowth`'s curve (``union=FORM``).
        beta_mode: ``hinge`` (the default: 1 once the steps' average
            exposed share reaches :attr:`HINGE_SHARE`, else that share),
            ``average`` (the measured exposed share), ``marginal`` (never
            below the slope of the steps' exposed fetch on their modeled
            link time) or ``one`` (1); :meth:`exposed_share`.
        row_mode: ``compute`` (a row is charged the verify compute the steps
            show it costs) or ``wall`` (at least what the steps' wall time
            shows it costs beyond its charged link time;
            :meth:`wall_row_fit`).
        ema: weight of the newest step in the miss-rate and link-rate averages.
        explore_every: every this many decisions (requests' rounds, counted
            from the first measured step) verifies the request past its
            width, to :func:`explored_width` (0: never; ``explore=N``).
        explore_reach: an exploring decision verifies at least this many
            drafts past the width (``reach=R``; :func:`explored_width`).
        explore_voi: a due exploration runs only where its positions'
            upper bounds could widen the width, or after
            :attr:`EXPLORE_SKIP_LIMIT` due ones in a row were skipped
            (``voi=0|1``; module docstring).
        cost_gate: stand down (verify every draft) where the decided steps'
            modeled saving is below the width's own host time
            (``cost=0|1``; module docstring).
    """

    name = "adaptive"

    #: ``t_fixed`` is at least this share of the mean measured step
    FIXED_FLOOR = 0.1
    #: standard errors taken off the fitted per-row compute (its lower
    #: confidence bound is what a row is charged)
    ROW_COST_Z = 2.0
    #: weight a step keeps in the charged fit per later step (half-life
    #: about 7 steps: the fit follows the current cost, warm-up forgotten)
    FIT_MEMORY = 0.9
    #: the defaults of ``explore_every`` and ``explore_reach``: every 17th
    #: decision explores, at least 2 drafts past its width
    EXPLORE_EVERY = 17
    EXPLORE_REACH = 2
    #: the default of ``explore_voi``, the standard errors above each
    #: continuation estimate its upper bound takes, and the due explorations
    #: in a row it may skip (the next one runs whatever the bounds say)
    EXPLORE_VOI = True
    EXPLORE_Z = 2.0
    EXPLORE_SKIP_LIMIT = 3
    #: the default of ``cost_gate``; the decided steps whose modeled saving
    #: and host time it compares; the steps between probes while standing down
    COST_GATE = True
    COST_WINDOW = 8
    #: a clear reading: after this many decided steps the width stands down
    #: at once where their modeled saving is under 1/COST_CLEAR_RATIO of
    #: their host time (the full window is for the close calls)
    COST_CLEAR_STEPS = 3
    COST_CLEAR_RATIO = 4.0
    COST_PROBE_EVERY = 16
    #: each probe that keeps the width standing down doubles the steps to
    #: the next one, up to this many (a probe that brings it back, or a new
    #: stand-down, starts again from :attr:`COST_PROBE_EVERY`)
    COST_PROBE_MAX_EVERY = 256
    #: the steps before each probe whose cost is measured and fitted while
    #: standing down (the probe then decides with a fresh step model)
    COST_REFRESH_STEPS = 4
    #: the defaults of ``shrink_weight`` and ``survival_z`` (``adaptive``
    #: with no options)
    SHRINK_WEIGHT = 4.0
    SURVIVAL_Z = 0.0
    #: the defaults of ``calibrate`` and ``union_form`` (``adaptive`` with
    #: no options)
    CALIBRATE = False
    UNION_FORM = "geometric"
    BETA_MODE = "hinge"
    #: ``beta_mode="hinge"``: the average exposed share from which a step is
    #: read as past the hinge (below it, waits are read as timer jitter)
    HINGE_SHARE = 0.1
    ROW_MODE = "compute"
    #: weight a round keeps in the acceptance calibration per later round
    CALIBRATION_MEMORY = 0.98
    #: expected drafts of a calibrated prior (``κ = 1``) in the calibration
    CALIBRATION_PRIOR = 4.0
    #: the calibration's floor
    CALIBRATION_MIN = 0.1

    def __init__(
        self,
        *,
        block_size: int,
        num_layers: int,
        num_experts: int,
        top_k: int,
        expert_bytes: int,
        prior_accept: float = 0.5,
        prior_weight: float = 2.0,
        shrink_weight: float = SHRINK_WEIGHT,
        survival_z: float = SURVIVAL_Z,
        calibrate: bool = CALIBRATE,
        union_form: str = UNION_FORM,
        beta_mode: str = BETA_MODE,
        row_mode: str = ROW_MODE,
        ema: float = 0.2,
        explore_every: int = EXPLORE_EVERY,
        explore_reach: int = EXPLORE_REACH,
        explore_voi: bool = EXPLORE_VOI,
        cost_gate: bool = COST_GATE,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        if expert_bytes < 0:
            raise ValueError(f"expert_bytes must be >= 0, got {expert_bytes}")
        if not 0.0 < ema <= 1.0:
            raise ValueError(f"ema must be in (0, 1], got {ema}")
        if explore_every < 0:
            raise ValueError(f"explore_every must be >= 0, got {explore_every}")
        if explore_reach < 1:
            raise ValueError(f"explore_reach must be >= 1, got {explore_reach}")
        if not survival_z >= 0.0:
            raise ValueError(f"survival_z must be >= 0, got {survival_z}")
        if beta_mode not in BETA_MODES:
            raise ValueError(f"beta_mode must be one of {BETA_MODES}, got {beta_mode!r}")
        if row_mode not in ROW_MODES:
            raise ValueError(f"row_mode must be one of {ROW_MODES}, got {row_mode!r}")
        self.survival_z = survival_z
        self.beta_mode = beta_mode
        self.row_mode = row_mode
        self.calibrate = calibrate
        # the calibration's decayed sums over rounds that verified >= 2
        # drafts: drafts past the first accepted, and expected
        self._cal_accepted = 0.0
        self._cal_expected = 0.0
        self.explore_every = explore_every
        self.explore_reach = explore_reach
        self.explore_voi = bool(explore_voi)
        self._explore_skips_in_a_row = 0  # due explorations skipped since one ran
        self._explore_skipped = 0  # of the due ones, skipped (books: reset_stats)
        self._explore_forced = 0  # run after EXPLORE_SKIP_LIMIT skips in a row
        self._decision_count = 0  # decisions since the first measured step
        self._explored = 0  # of them, exploration rounds (books: reset_stats)
        self._explored_drafts = 0  # drafts the exploring decisions verified
        self._explore_added = 0  # drafts the exploring steps added, all their requests
        self.cost_gate = bool(cost_gate)
        self._standing_down = False
        self._steps_since_probe = 0
        self._probe_every = self.COST_PROBE_EVERY  # steps between probes now
        # the latest decided steps' (host s, modeled saving s) while deciding
        self._cost_window: deque[tuple[float, float]] = deque(maxlen=self.COST_WINDOW)
        # the pending decision's modeled saving (None: the step decided nothing)
        self._pending_saving: float | None = None
        self._decided = False  # whether the latest widths() chose by the model
        self._refreshing = False  # a stood-down step before a probe: its cost is fitted
        self._cost_books = _CostBooks()
        self.block_drafts = block_size - 1
        self.num_layers = num_layers
        self.expert_bytes = expert_bytes
        self.ema = ema
        self._survival = SurvivalEstimator(
            self.block_drafts,
            prior_accept=prior_accept,
            prior_weight=prior_weight,
            shrink_weight=shrink_weight,
        )
        # outcomes of steps between probes not yet learned (observe_outcomes):
        # learned in one batch at the width's next reading
        self._unlearned: list[Sequence[tuple[int, int, int]]] = []
        self.union = UnionGrowth(num_experts, top_k, form=union_form)
        self.miss_rate: float | None = None  # copied bytes per routed batch expert's bytes
        self.link_bytes_per_s: float | None = None
        # least squares of y = wall - modeled link s of the rows on x = verified rows
        self._n = 0
        self._sx = self._sy = self._sxx = self._sxy = self._syy = 0.0
        self._wall = 0.0
        # the measured fit (steps that timed the verify's compute and the
        # exposed fetch): verify compute on verified rows, and the sums of
        # wall, exposed fetch and modeled link time
        self._m = 0
        self._vx = self._vy = self._vxx = self._vxy = self._vyy = 0.0
        self._m_wall = self._m_exposed = self._m_link = 0.0
        # the exposed fetch on the modeled link time, per timed step: sums of
        # x, y, x², xy, y² (the marginal exposed share's slope)
        self._e = [0.0] * 5
        # the fit the width charges: recent steps' weighted sums of 1, the
        # squared weights, x, y, x², xy, y², wall and modeled link s (the
        # measured fit's where steps are timed, else the wall fit's)
        self._recent = [0.0] * 9
        # the wall fit (every step with a wall time, weighted as _recent):
        # sums of 1, the squared weights, x, wall W, modeled link L, x², xW,
        # xL, W², WL, L² (row=wall: the slope of W - beta L on x, any beta)
        self._wall_recent = [0.0] * 11
        # request -> its survival when its width was chosen (the expectation's basis)
        self._expected: dict[int, np.ndarray] = {}
        self._why: _Decision | None = None  # the last decision's numbers
        self._books = _Books(self.block_drafts)

    # ------------------------------------------------------------ the model
    def link_s_per_expert(self) -> float:
        """``m · bytes_per_expert / link_Bps`` (0 until measured, or with
        nothing copied)."""
        if not self.miss_rate or not self.link_bytes_per_s or self.expert_bytes == 0:
            return 0.0
        return self.miss_rate * self.expert_bytes / self.link_bytes_per_s

    def link_s(self, rows: int) -> float:
        """``ℓ(rows)``: modeled link time of a verify of ``rows`` rows (all
        of it, exposed or hidden behind compute)."""
        per_expert = self.link_s_per_expert()
        if per_expert == 0.0:
            return 0.0  # nothing copied: no union fit needed
        return per_expert * self.num_layers * self.union.union(rows)

    def exposed_share(self) -> float:
        """``β``: the share of a further modeled link second the step waits
        for. 1 where the link is the bottleneck (the steps' modeled link
        time at least their time outside the waits: every further copy
        lengthens the step) and until measured; otherwise the share of the
        modeled link time the compute waited for (measured exposed fetch
        over modeled link time of the same steps, at most 1).

        ``beta_mode="marginal"``: at least the least-squares slope of the
        steps' exposed fetch on their modeled link time, where three steps
        are timed and their link times differ, capped at ``1 / m`` (``m``
        the miss rate: a further expert costs at most its whole copy). An
        average share understates a further second where the first copies
        of a step hide behind its compute and the rest do not, and where the
        experts a further row adds are colder than the step's average (the
        model charges them the average miss rate).

        ``beta_mode="one"``: 1 always: every further modeled link second is
        charged in full (``t_fixed``, the mean of ``wall - t_row · rows -
        ℓ(rows)``, keeps the step's level): at c=1 the exposed fetch rose by
        the whole modeled link time of the experts further drafts added,
        across runs, where the average share and the within-run slope read
        below 1.

        ``beta_mode="hinge"``: 1 where the average share is at least
        :attr:`HINGE_SHARE` (the step is past the hinge of
        ``max(0, ℓ - H)``), else the average share."""
        if self.beta_mode == "one":
            return 1.0
        average = self._average_exposed_share()
        if self.beta_mode == "average":
            return average
        if self.beta_mode == "hinge":
            return 1.0 if average >= self.HINGE_SHARE else average
        fit = self.exposed_slope()
        if fit is None:
            return average
        cap = max(1.0, 1.0 / self.miss_rate) if self.miss_rate else 1.0
        return min(cap, max(average, fit[0]))

    def exposed_slope(self) -> tuple[float, float] | None:
        """``(b, se(b))``: the least-squares slope of the timed steps'
        exposed fetch on their modeled link time; None until three steps are
        timed and their link times differ."""
        n = float(self._m)
        if n < 3:
            return None
        e = self._e
        mx = e[0] / n
        if e[2] / n - mx * mx <= 1e-12:
            return None
        return _slope_and_error(n, mx, e[1] / n, e[2] / n, e[3] / n, e[4] / n)

    def _average_exposed_share(self) -> float:
        if self._m == 0:
            return 1.0
        if self._m_link <= 0.0:
            return 0.0  # nothing modeled: any wait stays in the fixed time
        if self._m_link >= self._m_wall - self._m_exposed:
            return 1.0
        return min(1.0, self._m_exposed / self._m_link)

    def draft_link_s(self, anchors: int, drafted: int) -> float:
        """``ℓ(c + R) - ℓ(c)``: link time of ``drafted`` rows added to a batch
        of ``anchors`` anchor rows."""
        per_expert = self.link_s_per_expert()
        if drafted <= 0 or anchors <= 0 or per_expert == 0.0:
            return 0.0
        grown = self.union.union(anchors + drafted) - self.union.union(anchors)
        return per_expert * self.num_layers * grown

    def time_fit(self) -> tuple[float, float] | None:
        """``(t_fixed, t_row)`` the width is chosen with (None before any
        measured step).

        ``t_row`` is the lower confidence bound ``max(0, b - z·se(b))`` of
        the slope ``b`` of :meth:`row_cost_fit` (``z =``
        :attr:`ROW_COST_Z`): a row is charged only the compute the steps
        show it costs. ``t_fixed`` is the mean of
        ``wall - t_row · rows - β · ℓ(rows)`` (``β`` the measured
        :meth:`exposed_share`; 1 where the engine timed neither the verify
        nor the waits), floored at :attr:`FIXED_FLOOR` of the mean step."""
        fit = self.step_time_fit()
        if fit is None:
            return None
        slope, se = self.row_cost_fit()
        t_row = max(0.0, slope - self.ROW_COST_Z * se)
        if self.row_mode == "wall":
            wall_slope, wall_se = self.wall_row_fit()
            t_row = max(t_row, wall_slope - self.ROW_COST_Z * wall_se)
        r = self._recent
        # (the wall fit: beta 1, and its y is wall less the modeled link)
        beta = self.exposed_share() if self._m > 0 else 1.0
        t_fixed = (r[7] - t_row * r[2] - beta * r[8]) / r[0]
        return max(t_fixed, self.FIXED_FLOOR * fit.mean_step_s, 1e-9), t_row

    def row_cost_fit(self) -> tuple[float, float]:
        """``(b, se(b))``: the weighted least-squares slope of the verify's
        compute (where the engine times it, else of ``wall - ℓ(rows)``) on
        the verified rows, each step weighted :attr:`FIT_MEMORY` per later
        step, and its standard error (from the residuals, with the weights'
        effective number of steps); ``(0, 0)`` until three steps are
        measured and their row counts differ."""
        r = self._recent
        if r[0] <= 0.0 or (self._m if self._m > 0 else self._n) < 3:
            return 0.0, 0.0
        w = r[0]
        return _slope_and_error(w * w / r[1], *(v / w for v in r[2:7]))

    def wall_row_fit(self) -> tuple[float, float]:
        """``(b, se(b))``: the weighted least-squares slope of the steps'
        wall time less their charged link time (``β · ℓ(rows)``, ``β`` the
        current :meth:`exposed_share`; 1 where no step timed its waits) on
        their verified rows, weighted as :meth:`row_cost_fit`; ``(0, 0)``
        until three steps are measured and their row counts differ.

        ``row=wall`` charges a row at least this slope's lower confidence
        bound: what a further row lengthens the step by beyond the link
        time the model charges it, whatever the cause (compute the verify's
        timer splits off as waits, host work that grows with the experts a
        row routes to, copies exposed beyond ``β``): at c=1 a further
        verified draft lengthened the step by about twice what ``t_row`` and
        ``β · ℓ`` charged it."""
        w = self._wall_recent
        if w[0] <= 0.0 or self._n < 3:
            return 0.0, 0.0
        beta = self.exposed_share() if self._m > 0 else 1.0
        n = w[0]
        mx, mw, ml, mxx, mxw, mxl, mww, mwl, mll = (v / n for v in w[2:])
        my = mw - beta * ml
        mxy = mxw - beta * mxl
        myy = mww - 2.0 * beta * mwl + beta * beta * mll
        return _slope_and_error(n * n / w[1], mx, my, mxx, mxy, myy)

    def step_time_fit(self) -> StepTimeFit | None:
        """The least-squares fit of the step time on its rows (slope not
        lowered to its confidence bound, intercept not floored), the steps
        it is made of and whether their row counts differ (for
        :class:`pdflash.engine.fixed_step.FixedStepFeed`). Where steps timed
        the verify's compute and the exposed fetch
        (:attr:`WidthStep.verify_compute_s`), the slope is that of the
        verify's compute on its rows (the drafter's cost does not depend on
        the width, so it does not leak into it) and the intercept the mean
        of ``wall - t_row · rows - β · ℓ(rows)``; otherwise the slope and
        intercept of ``wall - ℓ(rows)`` on the rows."""
        if self._m > 0:
            m = self._m
            mx, my = self._vx / m, self._vy / m
            var = self._vxx / m - mx * mx
            t_row = max(0.0, (self._vxy / m - mx * my) / var) if var > 1e-9 else 0.0
            beta = self.exposed_share()
            t_fixed = (self._m_wall - t_row * self._vx - beta * self._m_link) / m
            return StepTimeFit(t_fixed, t_row, m, var > 1e-9, self._m_wall / m)
        if self._n == 0:
            return None
        mx, my = self._sx / self._n, self._sy / self._n
        var = self._sxx / self._n - mx * mx
        t_row = 0.0
        if var > 1e-9:
            t_row = max(0.0, (self._sxy / self._n - mx * my) / var)
        t_fixed = my - t_row * mx
        return StepTimeFit(t_fixed, t_row, self._n, var > 1e-9, self._wall / self._n)

    def step_time(self, anchors: int, drafted: int) -> float:
        """``T(R)`` of a step with ``anchors`` requests and ``drafted`` rows."""
        fit = self.time_fit()
        if fit is None:
            raise ValueError("no step measured yet")
        link = self.link_s(anchors + drafted)
        return fit[0] + fit[1] * (anchors + drafted) + self.exposed_share() * link

    @property
    def standing_down(self) -> bool:
        """Whether the width stands down for its own host time (``cost=1``)."""
        return self._standing_down

    @property
    def decided(self) -> bool:
        """Whether the latest :meth:`widths` chose by the model (False before
        any step was measured and on a step standing down between probes)."""
        return self._decided

    @property
    def wants_step_cost(self) -> bool:
        """Whether :meth:`observe` reads the step :meth:`widths` was last
        asked about beyond its outcomes (False on the steps standing down
        between probes, but for the :attr:`COST_REFRESH_STEPS` before each)."""
        return not self._standing_down or self._decided or self._refreshing

    @property
    def next_step_may_read_cost(self) -> bool:
        """Whether :attr:`wants_step_cost` can be true after the next
        :meth:`widths` (False only for a step standing down between probes
        outside the refresh steps: its cost marks need not be taken)."""
        between, refreshing = self._next_between_probes()
        return not between or refreshing

    def _next_between_probes(self) -> tuple[bool, bool]:
        """Whether the next :meth:`widths` stands down between probes, and
        whether it is one of the refresh steps before a probe."""
        k = self._steps_since_probe + 1
        between = self._standing_down and k < self._probe_every
        return between, between and self._probe_every - k <= self.COST_REFRESH_STEPS

    @property
    def survival(self) -> SurvivalEstimator:
        """The acceptance estimates, every outcome observed so far learned."""
        self._learn_unlearned()
        return self._survival

    def _learn_unlearned(self) -> None:
        """Learn the outcomes kept by :meth:`observe_outcomes`, in their
        order: one batch of counts (:meth:`SurvivalEstimator.observe_many`)
        and the books' sums, or one by one where a request among them has
        an estimate kept for the books' expectation (the same state either
        way)."""
        if not self._unlearned:
            return
        batches, self._unlearned = self._unlearned, []
        outcomes = [o for batch in batches for o in batch]
        if any(rid in self._expected for rid, _, _ in outcomes):
            self._learn_outcomes(outcomes)
            return
        self._survival.observe_many(outcomes)
        books = self._books
        books.rounds += len(outcomes)
        books.verified += sum(v for _, v, _ in outcomes)
        books.accepted += sum(a for _, _, a in outcomes)

    # ------------------------------------------------------------ protocol
    def widths(self, requests: Sequence[WidthRequest]) -> list[int]:
        if self.between_probes_widths([(r.request_id, r.available) for r in requests]):
            return [r.available for r in requests]  # between probes: nothing read or fitted
        self._learn_unlearned()
        self._decided = self._refreshing = False
        self._pending_saving = None
        fit = self.time_fit()
        if fit is None:
            return self._every_draft(requests)  # nothing measured yet
        if self._standing_down:
            self._steps_since_probe = 0
            self._cost_books.probes += 1
        c = len(requests)
        survs = [
            self._survival.survival(r.request_id)[: min(r.available, self.block_drafts)]
            for r in requests
        ]
        # chosen by the lower bounds; the books' expectation keeps the estimates
        chosen_by = [
            self._survival.survival_lower(r.request_id, self.survival_z)[: len(s)]
            if self.survival_z > 0.0
            else s
            for r, s in zip(requests, survs, strict=True)
        ]
        if self.calibrate:
            kappa = self.calibration()
            chosen_by = [calibrated_survival(s, kappa) for s in chosen_by]
        exploring = []
        for r in requests:
            self._decision_count += 1
            due = self.explore_every > 0 and self._decision_count % self.explore_every == 0
            exploring.append(due and r.available > 1)
        t_fixed, t_row = fit
        beta = self.exposed_share()

        times: dict[int, float] = {}

        def step_s(drafted: int) -> float:  # step_time(c, drafted), the fit read once
            t = times.get(drafted)
            if t is None:  # the batch search asks for most row counts more than once
                t = t_fixed + t_row * (c + drafted) + beta * self.link_s(c + drafted)
                times[drafted] = t
            return t

        lists = [s.tolist() for s in chosen_by]
        if self.explore_voi and any(exploring):
            exploring = self._worth_exploring(requests, lists, exploring, step_s)
        out, base = explore_widths(lists, step_s, exploring, self.explore_reach)
        for e, k, b in zip(exploring, out, base, strict=True):
            if e and k > b:  # a request already at its every draft has nothing to explore
                self._explored += 1
                self._explored_drafts += k
        if any(exploring):
            self._explore_added += sum(out) - sum(base)
        for r, s, k in zip(requests, survs, out, strict=True):
            self._expected[r.request_id] = s
            self._books.decided(r.available, k)
        # explained by the survival the widths were chosen by where it is the
        # calibrated one (the lower bounds keep their explanation by the estimates)
        explained = chosen_by if self.calibrate else survs
        lens = [len(s) for s in explained]
        self._why = _Decision(
            widths=tuple(out),
            available=tuple(lens),
            chosen=_expected_value(explained, out, step_s),
            every=_expected_value(explained, lens, step_s),
            t_fixed=t_fixed,
            t_row=t_row,
            link_s_per_expert=self.link_s_per_expert(),
            beta=beta,
            calibration=self.calibration() if self.calibrate else None,
        )
        self._decided = True
        if self.cost_gate:
            self._pending_saving = modeled_saving_s(self._why.chosen, self._why.every)
        return out

    def between_probes_widths(self, available: Sequence[tuple[int, int]]) -> bool:
        """:meth:`widths` on a step standing down between probes, for
        ``(request id, available drafts)`` pairs, without request objects:
        returns True where it answered (every draft, as :meth:`widths`
        would), False where the step is not between probes (ask
        :meth:`widths`)."""
        between, refreshing = self._next_between_probes()
        if not between:
            return False
        self._decided = False
        self._refreshing = refreshing
        self._pending_saving = None
        self._steps_since_probe += 1
        self._cost_books.stood_down_steps += 1
        self._book_every_draft(available)
        return True

    def observe_outcomes(
        self, outcomes: Sequence[tuple[int, int, int]], policy_host_s: float | None
    ) -> None:
        """:meth:`observe` of a step measured for nothing but its
        ``(request id, verified, accepted)`` outcomes and the width's host
        time (a :class:`WidthStep` with no other field: a step standing down
        between probes), without step objects. The outcomes are kept and
        learned at the width's next reading (its next :meth:`widths` that
        decides, :meth:`observe`, :meth:`forget`, :meth:`stats`,
        :meth:`reset_stats`, :attr:`survival`): between probes nothing reads
        them, and one batch costs less host time than a call each. The
        caller must not change ``outcomes`` after the call. ``None`` books
        no host time (a step at the PD controller's rest: the width was not
        consulted)."""
        if outcomes:
            self._unlearned.append(outcomes)
        self._book_host(policy_host_s)

    def _every_draft(self, requests: Sequence[WidthRequest]) -> list[int]:
        """Every draft, nothing decided (nothing measured yet)."""
        self._book_every_draft([(r.request_id, r.available) for r in requests])
        return [r.available for r in requests]

    def _book_every_draft(self, available: Sequence[tuple[int, int]]) -> None:
        """Every draft kept for ``(request id, available drafts)``: no
        estimate kept for an expectation, the books' decisions counted."""
        expected, books = self._expected, self._books
        for rid, n in available:
            expected.pop(rid, None)
            books.decided(n, n)

    def _judge_cost(self, host_s: float, saving_s: float) -> None:
        """The cost gate on one decided step (module docstring)."""
        books = self._cost_books
        books.decided_steps += 1
        books.host_s += host_s
        books.saving_s += saving_s
        if self._standing_down:  # a probe
            hosts = [h for h, _ in self._cost_window]
            bar = sum(hosts) / len(hosts) if hosts else host_s
            if saving_s > bar:
                self._standing_down = False
                self._probe_every = self.COST_PROBE_EVERY
                self._cost_window.clear()
                books.switch(
                    on=True,
                    why=f"back: a probe's modeled saving {1e3 * saving_s:.3g} ms exceeds the "
                    f"width's host time {1e3 * bar:.3g} ms a decided step",
                )
            else:
                self._probe_every = min(2 * self._probe_every, self.COST_PROBE_MAX_EVERY)
            return
        self._cost_window.append((host_s, saving_s))
        n = len(self._cost_window)
        host = sum(h for h, _ in self._cost_window)
        saved = sum(v for _, v in self._cost_window)
        # a clear reading needs no full window (module docstring)
        clear = n >= self.COST_CLEAR_STEPS and saved * self.COST_CLEAR_RATIO < host
        if n < self.COST_WINDOW and not clear:
            return
        if saved < host:
            self._standing_down = True
            self._steps_since_probe = 0
            self._probe_every = self.COST_PROBE_EVERY
            books.switch(
                on=False,
                why=f"stood down: the latest {n} decided steps' modeled saving "
                f"{1e3 * saved:.3g} ms is below the width's host time {1e3 * host:.3g} ms"
                + (f" (under 1/{self.COST_CLEAR_RATIO:g} of it: a clear reading)" if clear else "")
                + "; "
                f"every draft verified, a probe after {self.COST_PROBE_EVERY} steps, then "
                f"twice as many after each probe that keeps it down "
                f"(at most {self.COST_PROBE_MAX_EVERY})",
            )

    def _worth_exploring(
        self,
        requests: Sequence[WidthRequest],
        lists: Sequence[Sequence[float]],
        due: Sequence[bool],
        step_s: Callable[[int], float],
    ) -> list[bool]:
        """The due explorations that run (``voi``, module docstring)."""
        base = best_batch_widths(lists, step_s, k_min=1)
        out: list[bool] = []
        for i, (r, d) in enumerate(zip(requests, due, strict=True)):
            if not d or base[i] >= len(lists[i]):
                out.append(d)  # not due, or nothing past the width to explore
                continue
            c = self._survival.continuation(r.request_id)
            se = self._survival.continuation_error(r.request_id)
            upper = np.minimum(1.0, c + self.EXPLORE_Z * se)[: len(lists[i])]
            best = optimistic_width(lists, base, i, upper.tolist(), step_s, self.explore_reach)
            if best > base[i]:
                self._explore_skips_in_a_row = 0
                out.append(True)
            elif self._explore_skips_in_a_row >= self.EXPLORE_SKIP_LIMIT:
                self._explore_skips_in_a_row = 0
                self._explore_forced += 1
                out.append(True)
            else:
                self._explore_skips_in_a_row += 1
                self._explore_skipped += 1
                out.append(False)
        return out

    def _learn_outcomes(self, outcomes: Iterable[tuple[int, int, int]]) -> None:
        """The acceptance estimates and the books learn ``(request id,
        verified, accepted)`` outcomes."""
        books = self._books
        for rid, verified, accepted in outcomes:
            surv = self._expected.pop(rid, None)
            if surv is not None:
                # expected accepted drafts at the width the batcher granted,
                # from the estimate the choice was made with
                books.expected += float(surv[:verified].sum())
                books.expected_rounds += 1
                if verified >= 2:
                    mem = self.CALIBRATION_MEMORY
                    self._cal_expected = mem * self._cal_expected + float(surv[1:verified].sum())
                    self._cal_accepted = mem * self._cal_accepted + max(
                        0, min(accepted, verified) - 1
                    )
            self._survival.observe(rid, verified, accepted)
            books.rounds += 1
            books.verified += verified
            books.accepted += accepted

    def _book_host(self, policy_host_s: float | None) -> None:
        decided, self._pending_saving = self._pending_saving, None
        if policy_host_s is not None:
            if decided is not None:
                self._judge_cost(policy_host_s, decided)
            elif self._standing_down:
                self._cost_books.stood_down_host_s += policy_host_s

    def observe(self, step: WidthStep) -> None:
        self._learn_unlearned()
        self._learn_outcomes((o.request_id, o.verified, o.accepted) for o in step.outcomes)
        self._book_host(step.policy_host_s)
        if not step.outcomes or not self.wants_step_cost:
            return  # standing down: only the acceptance estimates observe the step
        anchors = len(step.outcomes)
        drafted = sum(o.verified for o in step.outcomes)
        if step.union_experts is not None:
            self.union.observe(anchors + drafted, step.union_experts / self.num_layers)
        if step.copied_bytes is not None and step.union_experts and self.expert_bytes > 0:
            m = step.copied_bytes / (step.union_experts * self.expert_bytes)
            self.miss_rate = m if self.miss_rate is None else _mix(self.miss_rate, m, self.ema)
        if step.link_bytes_per_s is not None and step.link_bytes_per_s > 0:
            lr = float(step.link_bytes_per_s)
            self.link_bytes_per_s = (
                lr if self.link_bytes_per_s is None else _mix(self.link_bytes_per_s, lr, self.ema)
            )
        x = float(anchors + drafted)
        # the modeled link time of the step's rows, from the estimates just updated
        link = self.link_s(anchors + drafted)
        timed = step.verify_compute_s is not None and step.exposed_fetch_s is not None
        if (
            step.wall_s is not None
            and step.verify_compute_s is not None
            and step.exposed_fetch_s is not None
        ):
            y = max(0.0, step.verify_compute_s)
            self._m += 1
            self._vx += x
            self._vy += y
            self._vxx += x * x
            self._vxy += x * y
            self._vyy += y * y
            exposed = max(0.0, step.exposed_fetch_s)
            self._m_wall += step.wall_s
            self._m_exposed += exposed
            self._m_link += link
            for i, v in enumerate((link, exposed, link * link, link * exposed, exposed * exposed)):
                self._e[i] += v
        if step.wall_s is not None:
            if timed or self._m == 0:
                y = max(0.0, step.verify_compute_s or 0.0) if timed else step.wall_s - link
                if timed and self._m == 1:
                    self._recent = [0.0] * 9  # the measured fit replaces the wall one
                _add_weighted(
                    self._recent,
                    (x, y, x * x, x * y, y * y, step.wall_s, link),
                    self.FIT_MEMORY,
                )
            wall = step.wall_s
            squares = (x * x, x * wall, x * link, wall * wall, wall * link, link * link)
            _add_weighted(self._wall_recent, (x, wall, link, *squares), self.FIT_MEMORY)
            y = step.wall_s - link
            self._n += 1
            self._wall += step.wall_s
            self._sx += x
            self._sy += y
            self._sxx += x * x
            self._sxy += x * y
            self._syy += y * y

    def calibration(self) -> float:
        """``κ``: the acceptance calibration past the first draft (module
        docstring, ``cal=1``); 1 until rounds past the first draft are seen."""
        self._learn_unlearned()
        prior = self.CALIBRATION_PRIOR
        kappa = (self._cal_accepted + prior) / (self._cal_expected + prior)
        return min(1.0, max(self.CALIBRATION_MIN, kappa))

    def forget(self, request_id: int) -> None:
        self._learn_unlearned()  # the request's kept outcomes first
        self._survival.forget(request_id)
        self._expected.pop(request_id, None)

    def stats(self) -> dict[str, Any]:
        self._learn_unlearned()
        out = self._books.summary(self.name)
        # decisions that verified past their width to measure the positions
        # there, the drafts they verified, and the drafts their steps verified
        # beyond the unexplored widths (every request of those steps)
        out["exploration_decisions"] = self._explored
        out["exploration_drafts"] = self._explored_drafts
        out["exploration_added_drafts"] = self._explore_added
        # due explorations the upper bounds showed could not widen (voi), and
        # those run only because EXPLORE_SKIP_LIMIT were skipped in a row
        out["exploration_skipped"] = self._explore_skipped
        out["exploration_forced"] = self._explore_forced
        fit = self.time_fit()
        slope, se = self.row_cost_fit()
        wall_slope, wall_se = self.wall_row_fit()
        slope_fit = self.exposed_slope()
        surv = np.cumprod(self._survival.global_continuation())
        out["estimates"] = {
            "survival_global": [round(float(s), 4) for s in surv[:8]],
            "shrink_weight": self._survival.shrink_weight,
            "survival_z": self.survival_z,
            "calibrate": self.calibrate,
            # measured under every setting, applied only with calibrate
            "acceptance_calibration": self.calibration(),
            "union_form": self.union.form,
            "union_novelty": self.union.novelty,
            "union_saturation": self.union.saturation,
            "union_observations": self.union.observations,
            "miss_rate": self.miss_rate,
            "link_bytes_per_s": self.link_bytes_per_s,
            "t_fixed_s": None if fit is None else fit[0],
            "t_row_s": None if fit is None else fit[1],
            # the recent steps' slope and its standard error (t_row_s is
            # max(0, slope - ROW_COST_Z se))
            "t_row_fit_s": None if fit is None else slope,
            "t_row_se_s": None if fit is None else se,
            "row_mode": self.row_mode,
            "explore_every": self.explore_every,
            "explore_reach": self.explore_reach,
            "explore_voi": self.explore_voi,
            "cost_gate": self.cost_gate,
            # measured under either mode, charged (its lower bound) with row=wall
            "t_row_wall_fit_s": None if fit is None else wall_slope,
            "t_row_wall_se_s": None if fit is None else wall_se,
            # "measured": t_row from the verify's compute, link time scaled by
            # the measured exposed share; "wall": from the step's wall time
            "time_fit": "measured" if self._m else "wall" if self._n else None,
            "link_exposed_share": self.exposed_share() if self._m else None,
            "beta_mode": self.beta_mode,
            # measured under either mode: the average share and the slope
            "link_exposed_share_average": self._average_exposed_share() if self._m else None,
            "link_exposed_slope": None if slope_fit is None else slope_fit[0],
            # modeled link s of drafted rows 1..8 of a lone request
            "row_link_s": [
                round(self.draft_link_s(1, j) - self.draft_link_s(1, j - 1), 6)
                for j in range(1, min(8, self.block_drafts) + 1)
            ],
            "measured_steps": self._n,
        }
        out["last_decision_why"] = None if self._why is None else str(self._why)
        out["cost_gate"] = {
            **self._cost_books.summary(self.cost_gate, self._standing_down),
            "probe_every_steps": self._probe_every if self._standing_down else None,
        }
        return out

    def reset_stats(self) -> None:
        self._learn_unlearned()  # into the books being closed, as one by one
        self._books.reset()
        self._explored = 0
        self._explored_drafts = 0
        self._explore_added = 0
        self._explore_skipped = 0
        self._explore_forced = 0
        self._cost_books.reset()


def _slope_and_error(
    n: float, mx: float, my: float, mxx: float, mxy: float, myy: float
) -> tuple[float, float]:
    """The least-squares slope of ``n`` (effective, > 2) points from their
    (weighted) means of ``x, y, x², xy, y²`` and its standard error;
    ``(0, 0)`` where the slope is not identified (one ``x``)."""
    var_x = mxx - mx * mx
    if n <= 2.0 or var_x <= 1e-9:
        return 0.0, 0.0
    cov = mxy - mx * my
    slope = cov / var_x
    residual = max(0.0, (myy - my * my) - slope * cov)  # per point
    return slope, math.sqrt(residual / (n - 2.0) / var_x)


def _add_weighted(sums: list[float], values: Sequence[float], memory: float) -> None:
    """One step into decayed weighted sums ``[Σw, Σw², Σw·v_0, ...]``: every
    earlier step's weight times ``memory`` (its squared weight times
    ``memory²``), then this step's at weight 1."""
    sums[0] = sums[0] * memory + 1.0
    sums[1] = sums[1] * memory**2 + 1.0
    for i, v in enumerate(values, start=2):
        sums[i] = sums[i] * memory + v


def _mix(old: float, new: float, w: float) -> float:
    return (1.0 - w) * old + w * new


def build_policy(
    setting: str,
    *,
    block_size: int,
    num_layers: int,
    num_experts: int,
    top_k: int,
    expert_bytes: int,
) -> VerifyWidthPolicy | None:
    """The policy of a ``verify_width`` setting; None for ``full`` (the
    engine then leaves every draft in place, exactly as without a policy)."""
    w = parse_width(setting, block_size)
    if w.kind == "full":
        return None
    if w.kind == "fixed":
        return FixedWidth(w.drafts, block_size)
    return AdaptiveWidth(
        block_size=block_size,
        num_layers=num_layers,
        num_experts=num_experts,
        top_k=top_k,
        expert_bytes=expert_bytes,
        shrink_weight=(AdaptiveWidth.SHRINK_WEIGHT if w.shrink_weight is None else w.shrink_weight),
        survival_z=AdaptiveWidth.SURVIVAL_Z if w.survival_z is None else w.survival_z,
        calibrate=AdaptiveWidth.CALIBRATE if w.calibrate is None else w.calibrate,
        union_form=AdaptiveWidth.UNION_FORM if w.union_form is None else w.union_form,
        beta_mode=AdaptiveWidth.BETA_MODE if w.beta_mode is None else w.beta_mode,
        row_mode=AdaptiveWidth.ROW_MODE if w.row_mode is None else w.row_mode,
        explore_every=AdaptiveWidth.EXPLORE_EVERY if w.explore_every is None else w.explore_every,
        explore_reach=AdaptiveWidth.EXPLORE_REACH if w.explore_reach is None else w.explore_reach,
        explore_voi=AdaptiveWidth.EXPLORE_VOI if w.explore_voi is None else w.explore_voi,
        cost_gate=AdaptiveWidth.COST_GATE if w.cost_gate is None else w.cost_gate,
    )


# ---------------------------------------------------------------- engine side
def follows_setting_alone(policy: VerifyWidthPolicy) -> bool:
    """Whether ``policy``'s widths depend on nothing but its setting and the
    drafts available (``full``/``fixed:K``), not on measured timing. Any
    other policy (``adaptive``, one passed to the engine) counts as timing
    dependent."""
    return isinstance(policy, FixedWidth)


class WidthHook:
    """The engine's side: trims each request's drafts to its width before
    route-ahead and scheduling, and feeds each verify's outcomes and cost
    back to the policy.

    A sampled request with a seed of its own (``Request.seeded``) keeps every
    draft unless the policy follows its setting alone
    (:func:`follows_setting_alone`): under speculative sampling the committed
    tokens depend on which drafts were verified (the acceptance draws and the
    bonus token's row follow the width), so a width that follows measured
    timing would make the same seed give different tokens from run to run.
    The policy is not asked about such a request, but it observes its
    outcomes (uncensored rounds) and its rows in the step's cost.
    ``seeded_full_width`` counts those requests' verify rounds.

    **At the PD controller's rest** (:mod:`pdflash.engine.pd_controller`,
    "Rest") an adaptive width standing down between its probes is not
    consulted: every draft is verified, no mark is taken, and the step's
    outcomes alone are handed over (:meth:`AdaptiveWidth.observe_outcomes`,
    so its acceptance estimates stay current). Such a step does not count
    toward the width's next probe: its probes (and the refresh steps before
    each) run in the controller's rounds. ``rest_steps`` counts them;
    :attr:`QUIET_AT_REST` cleared consults the policy at rest too.
    """

    #: at the controller's rest, a width between its probes is not consulted
    QUIET_AT_REST = True

    def __init__(self, engine: Engine, policy: VerifyWidthPolicy) -> None:
        self.engine = engine
        self.policy = policy
        self.timing_independent = follows_setting_alone(policy)
        self.seeded_full_width = 0
        #: steps at the controller's rest the policy was not consulted in
        self.rest_steps = 0
        # this step is one of them (begin_step)
        self._quiet = False
        self._t0: float | None = None
        self._bytes0: int | None = None
        self._verify0 = 0.0
        self._stall0 = 0.0
        self._outcomes: tuple[WidthOutcome, ...] = ()
        self._union: int | None = None
        # this step's cost marks were taken (begin_step): a step without them
        # hands the policy its outcomes alone, whatever the policy wants
        self._marked = False
        # host seconds of the width's own work since the last observation
        # (the previous observation's included: it is the step's cost too)
        self._host_s = 0.0
        # this step's outcomes are read from its report (record kept none:
        # a step standing down between probes)
        self._from_report = False

    def reset_stats(self) -> None:
        """Start the books over (the policy's and the hook's count)."""
        self.policy.reset_stats()
        self.seeded_full_width = 0
        self.rest_steps = 0

    def begin_step(self) -> None:
        policy = self.policy
        parts = self.engine.parts
        self._quiet = (
            self.QUIET_AT_REST
            and parts is not None
            and parts.resting
            and isinstance(policy, AdaptiveWidth)
            and not policy.next_step_may_read_cost
        )
        if self._quiet:  # at the controller's rest, between probes: not consulted
            self.rest_steps += 1
            self._from_report = False
            self._outcomes = ()
            return
        start = time.perf_counter()
        self._from_report = False
        self._marked = not (
            isinstance(policy, AdaptiveWidth) and not policy.next_step_may_read_cost
        )
        if not self._marked:
            # between a stood-down width's probes: no cost read, no marks
            self._outcomes = ()
            self._host_s += time.perf_counter() - start
            return
        self._t0 = self.engine.clock()
        self._bytes0 = _copied(self.engine.expert_cache)
        # NOTE: the ready spans, never a device synchronize (it would wait for
        # the prefetch copies in flight); on CUDA a span still running on the
        # device counts in a later step
        self._verify0 = self.engine.timer.kind_s_ready("verify")
        self._stall0 = self.engine.timer.stall_s_ready()
        self._outcomes = ()
        self._host_s += time.perf_counter() - start

    def trim(self, reqs: Sequence[Request]) -> None:
        """Cut each request's drafts to the policy's width (the drafter's
        own outputs for the kept positions are untouched)."""
        if self._quiet:
            return  # every draft kept (class docstring, "At the PD controller's rest")
        start = time.perf_counter()
        try:
            self._trim(reqs)
        finally:
            self._host_s += time.perf_counter() - start

    def _trim(self, reqs: Sequence[Request]) -> None:
        # one pass: the requests asked about and their available drafts
        keep_seeded = not self.timing_independent
        todo: list[Request] = []
        available: list[tuple[int, int]] = []
        for r in reqs:
            drafts = r.drafts
            n = 0 if drafts is None else int(drafts.numel())
            if n == 0:
                continue
            if keep_seeded and r.seeded and not r.params.greedy:
                self.seeded_full_width += 1
                continue
            todo.append(r)
            available.append((r.request_id, n))
        if not todo:
            return
        policy = self.policy
        if isinstance(policy, AdaptiveWidth) and policy.between_probes_widths(available):
            return  # standing down between probes: every draft kept
        asks = [WidthRequest(rid, n) for rid, n in available]
        ks = self.policy.widths(asks)
        for req, ask, k in zip(todo, asks, ks, strict=True):
            if not 0 <= k <= ask.available:
                raise ValueError(
                    f"width policy {self.policy.name!r} chose {k} drafts for request "
                    f"{req.request_id}, outside [0, {ask.available}]"
                )
            if k == ask.available:
                continue
            assert req.drafts is not None
            req.drafts = req.drafts[:k]
            if req.draft_probs is not None:
                req.draft_probs = req.draft_probs[:k]
            if req.draft_hidden is not None:
                req.draft_hidden = req.draft_hidden[: k + 1]  # anchor row + kept drafts

    def record(self, batch: Sequence[tuple[Request, int]], result: VerifyResult) -> None:
        """A verify's outcomes (before they are committed). On an adaptive
        width's step standing down between probes nothing is kept: the step's
        report carries the same outcomes to :meth:`end_step`."""
        if self._quiet:
            return
        start = time.perf_counter()
        if isinstance(self.policy, AdaptiveWidth) and not self._wants_cost():
            self._from_report = True
            self._host_s += time.perf_counter() - start
            return
        self._outcomes = tuple(
            WidthOutcome(req.request_id, grant - 1, int(o.accepted))
            for (req, grant), o in zip(batch, result.outcomes, strict=True)
            if o.error is None
        )
        # the routing's union only for a step whose cost the policy reads
        self._union = int(np.count_nonzero(result.routed_union)) if self._wants_cost() else None
        self._host_s += time.perf_counter() - start

    def end_step(self, report: StepReport) -> None:
        if self._quiet:
            self._quiet = False
            if report.verify_outcomes:
                policy = self.policy
                assert isinstance(policy, AdaptiveWidth)
                policy.observe_outcomes(report.verify_outcomes, None)
            return
        if self._from_report:
            self._from_report = False
            if not report.verify_outcomes:
                return
            start = time.perf_counter()
            policy = self.policy
            assert isinstance(policy, AdaptiveWidth)
            policy.observe_outcomes(report.verify_outcomes, self._host_s)
            self._host_s = time.perf_counter() - start
            return
        if not self._outcomes:
            return
        start = time.perf_counter()
        if self._wants_cost():
            step = self._measured_step()
            step = replace(step, policy_host_s=self._host_s + (time.perf_counter() - start))
        else:  # between a stood-down width's probes: the outcomes alone
            step = WidthStep(self._outcomes, policy_host_s=self._host_s)
        start = time.perf_counter()
        self.policy.observe(step)
        self._outcomes = ()
        self._host_s = time.perf_counter() - start  # this observation: the next step's cost

    def _wants_cost(self) -> bool:
        """Whether the policy reads the step's cost (False on an adaptive
        width's steps standing down between probes, but for the refresh
        steps before each: it then reads only the outcomes), and the step's
        marks were taken (a step that chose no width, with no drafts to
        trim, keeps the policy's answer from the step before)."""
        policy = self.policy
        wants = not isinstance(policy, AdaptiveWidth) or policy.wants_step_cost
        return wants and self._marked

    def _measured_step(self) -> WidthStep:
        eng = self.engine
        # from after the step's prefill (begin_step) to its end: the draft,
        # the verify and the commit, whatever was admitted
        wall = None if self._t0 is None else max(0.0, eng.clock() - self._t0)
        now = _copied(eng.expert_cache)
        copied = None if now is None or self._bytes0 is None else now - self._bytes0
        exposed = max(0.0, eng.timer.stall_s_ready() - self._stall0)
        verify = max(0.0, eng.timer.kind_s_ready("verify") - self._verify0)
        return WidthStep(
            self._outcomes,
            wall_s=wall,
            union_experts=self._union,
            copied_bytes=copied,
            link_bytes_per_s=link_rate_of(eng.expert_cache),
            verify_compute_s=max(0.0, verify - exposed),
            exposed_fetch_s=exposed,
        )


def _copied(cache: object) -> int | None:
    value = getattr(cache, "bytes_in", None)
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    return None


def link_rate_of(cache: object) -> float | None:
    """The issuer's link-rate estimate in bytes/s (None: not measured)."""
    try:
        state = link_state_of(getattr(cache, "issuer", None))
    except Exception:  # a closed issuer: no estimate this step
        return None
    return None if state is None else state.link_rate_estimate_bps
