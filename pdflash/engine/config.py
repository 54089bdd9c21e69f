"""Engine configuration and the baseline presets of docs/design.md §6.

The baselines are configurations of one engine, not separate code paths:

======  ===========  =======================================  =========================
label   decoding     prefetch                                 batching
======  ===========  =======================================  =========================
B0      autoregr.    on demand + next-layer gate lookahead    FCFS under a token budget
B1      DFlash       same as B0 (inside verify)               FCFS under a token budget
B2      DFlash       same as B0                               deficit scheduler, tokens only
B3      DFlash       none needed: every expert resident       FCFS under a token budget
PD      DFlash       route-ahead before verify, in bands,     2-D deficit scheduler
                     streamed in layer order (from drafting
                     on); lookahead; background prefetch
PD+host DFlash       PD's, and the host CPU computes the      2-D deficit scheduler
                     misses the cost model gives it
                     (hybrid miss service, pdflash.hybrid)
======  ===========  =======================================  =========================

PD's ablations (issue 15: what each part buys) are PD with one part switched
off, each a label of its own so its rows never mix with PD's:

=====================  ==============================================================
label                  PD without
=====================  ==============================================================
PD-all-on              the PD controller: every part forced on for the whole run
PD-no-route-ahead      route-ahead (no predictor, so no streaming prefetcher either:
                       on-demand copies, next-layer lookahead, background prefetch)
PD-one-band            bands: every copy in one FIFO band (``bands=False``), so an
                       on-demand miss waits behind every queued prefetch
PD-token-sched         the 2-D scheduler: the token-only deficit scheduler (B2's)
PD-no-stream           the streaming prefetcher: one route-ahead batch copy before
                       each verify plus next-layer lookahead
PD-full-width          the adaptive verify width: every draft verified (PD with its
                       controller and ``verify_width="full"``)
=====================  ==============================================================

PD, PD+host and PD's ablations but ``PD-full-width`` verify an adaptive
prefix of each request's drafts (``verify_width="adaptive"``; README,
"Verify width", has its measurements against every draft); every other
preset, and a hand-made :class:`EngineConfig`, verifies every draft.
Rows recorded under the retired label ``PD-adaptive-width`` (PD at
``adaptive`` while PD's preset verified every draft) are PD's configuration
of today; the report still reads them under their own label.

``PD`` runs its parts under the PD controller (``parts_controller``,
:mod:`pdflash.engine.pd_controller`): route-ahead, the 2-D scheduler and the
streaming prefetcher are switched off where paired-step probes show they
cost more than they save, and probed again later. ``PD-all-on`` is PD with every part
forced on (the controller's own ablation row); ``PD+host`` is PD (with the
controller) plus the hybrid miss service. The ablations above run their
parts as configured.

Where the expert cache has a slot for every expert (cache fraction 1.0),
every offloaded configuration fills it before the first request, as B3
does, and runs none of the parts that only serve a miss (``full_cache``):
B1 then runs as B3, B2 as B3 under the token-only scheduler, and PD and
PD+host as B3: the 2-D scheduler's byte term would be zero for every
request, so PD's batch is chosen as B3's (FCFS under the token budget), the
host has no miss to compute (no hybrid service), and an ``adaptive`` width
verifies every draft (no copy for a narrower verify to save; a ``fixed:K``
width is kept, as asked).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

# the labels are pdflash.labels' (the report reads them without the engine)
from pdflash.labels import ABLATIONS as ABLATIONS
from pdflash.labels import BASELINES as BASELINES
from pdflash.routeahead.predictors import LOOKAHEAD_SCORES as LOOKAHEAD_SCORES

#: :attr:`EngineConfig.lookahead_score`'s choices: the lookahead's scores
#: (:data:`LOOKAHEAD_SCORES`), and ``every``: no threshold, every expert the
#: lookahead predicts is worth a copy, as the plain gate lookahead (B1's,
#: and PD's while its stream is off) copies them
LOOKAHEAD_SCORE_SETTINGS = (*LOOKAHEAD_SCORES, "every")
#: :attr:`EngineConfig.lookahead_tail`'s choices: what the stream does with
#: the gate lookahead's experts below its score threshold
LOOKAHEAD_TAILS = ("skip", "background")

BATCHING = ("fcfs", "deficit_tokens", "deficit_2d")
HOST_EXPERTS = ("off", "auto")
#: :attr:`EngineConfig.rest_batching`'s choices
REST_BATCHINGS = ("first_come", "scheduler")

#: :attr:`EngineConfig.host_control`'s choices, the PD controller's too
#: (:class:`~pdflash.engine.pd_controller.PDController`): ``controller`` (its
#: host gate and must-earn probes) or ``always`` (on, never probed nor gated)
HOST_CONTROLS = ("controller", "always")
#: :attr:`EngineConfig.route_ahead_gate`'s choices: ``precision_cost`` (the
#: PD controller's route-ahead gate on its batch precision and on its host
#: time against what its routed predictions could save), ``precision`` (on
#: its batch precision alone) or ``off``
ROUTE_AHEAD_GATES = ("precision_cost", "precision", "off")
#: :attr:`EngineConfig.route_ahead_gate`'s default
DEFAULT_ROUTE_AHEAD_GATE = "precision_cost"
CUDA_GRAPHS = ("off", "auto", "piecewise")
#: :attr:`EngineConfig.route_ahead_horizon`'s choices: predict for the rows
#: the acceptance horizon keeps, or for every row the verify routes
ROUTE_AHEAD_HORIZONS = ("acceptance", "verified")
FULL_CACHE = ("auto", "off")
#: :attr:`EngineConfig.host_ahead_min_exposed`'s default. On the H200, PD's
#: exposed-fetch share was 0.29-0.48 at the link-bound points and at most 0.17
#: at the compute-bound ones; the link's busy share did not separate them.
DEFAULT_HOST_AHEAD_MIN_EXPOSED = 0.2
#: the parts that only serve a miss: off where the expert cache holds every
#: expert (``full_cache="auto"``), with the reason each was off
NOTHING_TO_MISS = {
    "route_ahead": "every expert resident: no miss to predict (no predictor or router pass)",
    "streaming_prefetch": "every expert resident: no copy to stream",
    "lookahead": "every expert resident: no next-layer copy to start",
    "background_prefetch": "every expert resident: no empty slot to fill",
    "parts_controller": "every expert resident: route-ahead, the stream and the 2-D "
    "scheduler are off",
    # not flags (without_miss_parts): batching "deficit_2d" becomes B3's
    # "fcfs", host_experts "auto" becomes "off", verify_width below
    "scheduler_2d": "every expert resident: no byte can be missing, so the 2-D scheduler's "
    "byte term is zero for every request; the batch is chosen as B3's (FCFS under the "
    "token budget)",
    "host_experts": "every expert resident: no miss for the host CPU to compute (an attached "
    "service would still read each layer's routing on the host and keep the verify off "
    "B3's CUDA graph)",
    # not a flag: verify_width "adaptive" becomes "full" ("fixed:K" is kept)
    "verify_width": "every expert resident: no copy for a narrower verify to save, so the "
    "adaptive width verifies every draft (full), as B3 does",
}


@dataclass(frozen=True)
class EngineConfig:
    """How the engine decodes, batches and prefetches.

    Attributes:
        baseline: the label recorded with results (``"custom"`` if hand-made).
        speculative: DFlash drafting (False: autoregressive, one token per round).
        block_size: verify block ``B`` (anchor + ``B - 1`` drafts).
        max_running: requests decoding at once (the rest wait).
        token_budget: verify tokens per step (``T`` of the scheduler).
        byte_budget: missing expert bytes per step (``M``) for ``deficit_2d``;
            None lets the engine derive it (see :class:`~pdflash.engine.Engine`).
        batching: ``fcfs`` | ``deficit_tokens`` | ``deficit_2d``.
        route_ahead: predict the verify's experts from the drafted blocks and
            copy them ROUTE_AHEAD before the verify forward.
        route_ahead_min_score: an expert counts as predicted when the
            predictor's score exceeds this (scores are in [0, 1] for
            :class:`~pdflash.engine.predict.BatchedUnionPredictor`).
        lookahead: during a forward, apply layer l+1's router to layer l's MoE
            input and prefetch those experts (ROUTE_AHEAD).
        background_prefetch: after verify, prefetch the frequency prior's top
            experts in the BACKGROUND band with the remaining byte budget.
        streaming_prefetch: route-ahead copies as a stream in execution order
            (:class:`pdflash.engine.prefetch.StreamingPrefetcher`): the first
            layers' experts right after a verify (hidden behind drafting),
            the next layer's as each layer is released, never evicting an
            expert the forward needs earlier. Needs ``route_ahead``; replaces
            the one-shot route-ahead batch copy and the plain lookahead.
        stream_ahead: experts the stream copies beyond the next layer's set.
        lookahead_score: how the stream scores a gate-lookahead expert
            against its confidence threshold:
            ``prob``, its gate probability (softmax over every expert)
            summed over the forward's rows; ``share``, its share of each
            row's top-k gate mass summed over the rows (the threshold's
            ``0.6 / top_k`` is then 60% of an average top-k share whatever
            the expert count; with 128 experts a row's top-8 probabilities
            sum to ~0.3, so on ``prob`` the threshold is about three times
            stricter than it was set to be); ``every``, no threshold (the
            stream copies every predicted expert its capacity rules allow,
            ranked by ``prob``) (:data:`LOOKAHEAD_SCORE_SETTINGS`).
        lookahead_tail: what the stream does with a gate-lookahead expert
            below that threshold (:data:`LOOKAHEAD_TAILS`): ``skip`` (the
            default) protects it but copies none; ``background`` copies it
            in the BACKGROUND band, which the issuer serves only while no
            miss and no confident copy waits, and gives back the copies not
            started that the layer's routing does not use
            (:class:`~pdflash.engine.prefetch.StreamingPrefetcher`). Not with
            ``lookahead_score="every"`` (no expert is below a zero
            threshold) nor with ``host_experts`` (the host split plans the
            confident copies only).
        route_ahead_horizon: which rows of a drafted block route-ahead
            predicts for: ``acceptance`` (the default: the first rows up to
            the request's recent acceptance lengths' 0.9 quantile, the
            caller's ``horizon``) or ``verified`` (every row the verify will
            route: the block as the verify width left it).
        bands: copies in priority bands (ON_DEMAND before ROUTE_AHEAD before
            BACKGROUND). False (the ``PD-one-band`` ablation): every copy in
            one band, which the issuer serves FIFO; the expert cache must be
            built with ``single_band`` set (the engine checks).
        all_resident: size the expert cache to hold every expert (B3).
        full_cache: where the expert cache has a slot for every expert of
            the model (any baseline, e.g. at cache fraction 1.0): ``auto``
            (default) fills it before the first request, as B3's, and runs
            none of the parts that only serve a miss
            (:data:`NOTHING_TO_MISS`: route-ahead and its predictor, the
            streaming prefetcher, gate lookahead, background prefetch, the
            PD controller, the 2-D scheduler, which becomes B3's FCFS, the
            hybrid miss service, the ``adaptive`` verify width, which becomes
            ``full``): nothing can miss. ``off`` runs the configuration
            as given, the cache filling on demand (the A/B arm of what that
            machinery costs where nothing can miss).
        parts_controller: switch route-ahead, the 2-D scheduler and the
            streaming prefetcher on and off online
            (:class:`~pdflash.engine.pd_controller.PDController`); the parts
            the configuration leaves off stay off.
        host_experts: ``off`` (every miss is copied) or ``auto`` (the hybrid
            miss service: a :class:`~pdflash.hybrid.MissPlanner` gives some
            misses to the host CPU; the engine needs a ``host_service``).
            Default off until measured on the GPU.
        rest_batching: how a step is batched while the PD controller rests
            (``parts_controller``; :mod:`~pdflash.engine.pd_controller`,
            "Rest": no demand names a predicted expert, so the 2-D scheduler
            has no byte dimension): ``first_come`` (default: B1's rule over
            the waiting requests in arrival order, the last trimmed to fit;
            the deficit scheduler misses those steps, so a long-running
            request runs ahead of later ones as under B1, and per-request
            weights do not apply, the engine adding every request at 1) or
            ``scheduler`` (the configured batcher every step).
        host_control: who decides whether the hybrid miss service runs in
            a step, with ``host_experts`` on and the PD controller on
            (``parts_controller``): ``controller`` (default: its host gate and
            must-earn probes, :mod:`~pdflash.engine.pd_controller`) or
            ``always`` (on in every step from the first, never probed nor
            gated; the controller still probes PD's other parts). Without
            the controller the service runs in every step either way.
            ``always`` needs ``host_experts`` ``auto`` (ValueError otherwise).
            Opt-in (README, "Hybrid miss service", has its measurements).
        route_ahead_gate: with the PD controller on (``parts_controller``),
            route-ahead on and no hybrid miss service (whose planner reads
            route-ahead's predictions too), ``precision_cost`` (default:
            route-ahead runs by default only while its batch precision is at
            least :data:`~pdflash.engine.pd_controller.ROUTE_AHEAD_GATE_PRECISION`
            and its host time is below what its routed predictions could
            save at one expert's copy each; otherwise it is switched off and
            must earn its place by its probes), ``precision`` (the precision
            alone) or ``off`` (route-ahead judged as PD's other parts).
        route_ahead_shadow_check: with the route-ahead gate acting
            (``route_ahead_gate`` not ``off``), at route-ahead's turn while
            it must earn its way back, the PD controller first runs it in
            shadow (its predictions counted, no copy made) and keeps it off,
            with no paired probe, where their precision is below the gate
            (:mod:`~pdflash.engine.pd_controller`, "The shadow check").
            Off by default: neither the CPU A/B nor the GPU one showed it
            pays (``bench/results/cpu/shadow-check-2026-12-07/``,
            ``bench/results/h100/session57-2026-12-07/``); off, the paired
            probe runs at once.
        host_ahead_min_exposed: with ``host_experts`` on, the engine plans
            the host's experts before each verify (the pre-verify plan, and
            with it the service's split of the stream's copies) only where
            forwards waited for expert copies or host results at least this
            share of the time since the previous plan (a share in [0, 1];
            ``0``: before every verify). Default
            :data:`DEFAULT_HOST_AHEAD_MIN_EXPOSED`.
        cuda_graphs: ``off``, ``auto`` or ``piecewise``: on CUDA, steps
            replay recorded CUDA graphs per shape bucket
            (:mod:`pdflash.engine.graphs`). ``auto`` (default): a verify whose
            every expert is resident (B3) as one graph and the drafter's
            forward as one graph; other verifies run eagerly. ``piecewise``:
            also those verifies, as pieces (attention and router replayed,
            the experts eager between them; not ``auto``'s until measured
            never slower than eager: README, "CUDA graphs"). Prefills, and
            every step on the CPU, run eagerly; ``off`` runs everything
            eagerly.
        verify_width: how many of each request's drafts a verify checks
            (:mod:`pdflash.engine.verify_width`): ``full`` (every draft),
            ``fixed:K`` (the first ``K``) or ``adaptive`` (per request, the
            width that maximizes expected tokens per second from the learned
            acceptance and the link time of the experts each row adds).
            Lossless: the target's token after the last verified draft is
            the bonus. Default ``full`` (B0-B3 and ``PD-full-width`` too);
            PD, PD+host and PD's other ablations use ``adaptive`` (the module
            docstring says why).
        kv_page_size: tokens per KV page.
        seed: seeds sampling, forced acceptance and workloads.
    """

    baseline: str = "custom"
    speculative: bool = True
    block_size: int = 16
    max_running: int = 16
    token_budget: int = 512
    byte_budget: int | None = None
    batching: str = "fcfs"
    route_ahead: bool = False
    route_ahead_min_score: float = 0.0
    lookahead: bool = True
    background_prefetch: bool = False
    streaming_prefetch: bool = False
    stream_ahead: int = 2
    lookahead_score: str = "prob"
    lookahead_tail: str = "skip"
    route_ahead_horizon: str = "acceptance"
    bands: bool = True
    parts_controller: bool = False
    all_resident: bool = False
    full_cache: str = "auto"
    host_experts: str = "off"
    host_control: str = "controller"
    rest_batching: str = "first_come"
    route_ahead_gate: str = DEFAULT_ROUTE_AHEAD_GATE
    route_ahead_shadow_check: bool = False
    host_ahead_min_exposed: float = DEFAULT_HOST_AHEAD_MIN_EXPOSED
    cuda_graphs: str = "auto"
    verify_width: str = "full"
    kv_page_size: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not self.speculative and self.block_size != 1:
            raise ValueError("autoregressive decoding needs block_size == 1")
        if self.max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {self.max_running}")
        if self.token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {self.token_budget}")
        if self.byte_budget is not None and self.byte_budget < 0:
            raise ValueError(f"byte_budget must be >= 0, got {self.byte_budget}")
        if self.batching not in BATCHING:
            raise ValueError(f"batching must be one of {BATCHING}, got {self.batching!r}")
        if not self.route_ahead_min_score >= 0.0:
            raise ValueError(
                f"route_ahead_min_score must be >= 0, got {self.route_ahead_min_score}"
            )
        if self.streaming_prefetch and not self.route_ahead:
            raise ValueError("streaming_prefetch needs route_ahead")
        if self.stream_ahead < 0:
            raise ValueError(f"stream_ahead must be >= 0, got {self.stream_ahead}")
        if self.lookahead_score not in LOOKAHEAD_SCORE_SETTINGS:
            raise ValueError(
                f"lookahead_score must be one of {LOOKAHEAD_SCORE_SETTINGS}, "
                f"got {self.lookahead_score!r}"
            )
        check_lookahead_tail(self.lookahead_tail, self.lookahead_score, self.host_experts)
        if self.route_ahead_horizon not in ROUTE_AHEAD_HORIZONS:
            raise ValueError(
                f"route_ahead_horizon must be one of {ROUTE_AHEAD_HORIZONS}, "
                f"got {self.route_ahead_horizon!r}"
            )
        if self.host_experts not in HOST_EXPERTS:
            raise ValueError(
                f"host_experts must be one of {HOST_EXPERTS}, got {self.host_experts!r}"
            )
        check_host_control(self.host_control)
        if self.rest_batching not in REST_BATCHINGS:
            raise ValueError(
                f"rest_batching must be one of {REST_BATCHINGS}, got {self.rest_batching!r}"
            )
        if self.host_control == "always" and self.host_experts == "off":
            raise ValueError(
                "host_control 'always' needs host_experts 'auto' (with host_experts off there "
                "is no host part to run)"
            )
        if self.route_ahead_gate not in ROUTE_AHEAD_GATES:
            raise ValueError(
                f"route_ahead_gate must be one of {ROUTE_AHEAD_GATES}, "
                f"got {self.route_ahead_gate!r}"
            )
        if self.full_cache not in FULL_CACHE:
            raise ValueError(f"full_cache must be one of {FULL_CACHE}, got {self.full_cache!r}")
        check_host_ahead_min_exposed(self.host_ahead_min_exposed)
        if self.cuda_graphs not in CUDA_GRAPHS:
            raise ValueError(f"cuda_graphs must be one of {CUDA_GRAPHS}, got {self.cuda_graphs!r}")
        if self.host_experts != "off" and self.all_resident:
            raise ValueError("host_experts needs offloaded experts (all_resident is set)")
        if self.kv_page_size < 1:
            raise ValueError(f"kv_page_size must be >= 1, got {self.kv_page_size}")
        from pdflash.engine.verify_width import parse_width

        parse_width(self.verify_width, self.block_size)

    @property
    def lookahead_predictor_score(self) -> str:
        """The score the gate lookahead computes (:data:`LOOKAHEAD_SCORES`):
        ``lookahead_score``, with ``every`` ranked by ``prob``."""
        return "prob" if self.lookahead_score == "every" else self.lookahead_score

    @property
    def stream_lookahead_min_score(self) -> float | None:
        """The stream's lookahead threshold: 0 under ``every`` (every predicted
        expert), else None (the stream's default, ``0.6 / top_k``)."""
        return 0.0 if self.lookahead_score == "every" else None

    @staticmethod
    def preset(baseline: str, **overrides: Any) -> EngineConfig:
        """The configuration of a docs/design.md §6 baseline; ``overrides`` adjust
        sizes (block_size, max_running, budgets, seed)."""
        table: dict[str, dict[str, Any]] = {
            "B0": {"speculative": False, "block_size": 1, "batching": "fcfs", "lookahead": True},
            "B1": {"speculative": True, "batching": "fcfs", "lookahead": True},
            "B2": {"speculative": True, "batching": "deficit_tokens", "lookahead": True},
            "B3": {
                "speculative": True,
                "batching": "fcfs",
                "lookahead": False,
                "all_resident": True,
            },
            "PD": {
                "speculative": True,
                "batching": "deficit_2d",
                "route_ahead": True,
                "lookahead": True,
                "background_prefetch": True,
                "streaming_prefetch": True,
                "verify_width": "adaptive",
            },
        }
        fixed = {**table["PD"]}
        table["PD"]["parts_controller"] = True
        table["PD-all-on"] = fixed
        table["PD+host"] = {**table["PD"], "host_experts": "auto"}
        # streaming needs route-ahead: without a predictor there is no stream
        table["PD-no-route-ahead"] = {
            **fixed,
            "route_ahead": False,
            "streaming_prefetch": False,
        }
        table["PD-one-band"] = {**fixed, "bands": False}
        table["PD-token-sched"] = {**fixed, "batching": "deficit_tokens"}
        table["PD-no-stream"] = {**fixed, "streaming_prefetch": False}
        table["PD-full-width"] = {**table["PD"], "verify_width": "full"}
        if baseline not in table:
            raise ValueError(f"unknown baseline {baseline!r}; choose one of {BASELINES}")
        fields = {"baseline": baseline, **table[baseline]}
        if baseline == "B0":
            # one token per round: no drafts, so no block and no width to set
            overrides = {
                k: v for k, v in overrides.items() if k not in ("block_size", "verify_width")
            }
        fields.update(overrides)
        return EngineConfig(**fields)

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    def without_miss_parts(self) -> tuple[EngineConfig, dict[str, str]]:
        """This configuration with the parts that only serve a miss off
        (:data:`NOTHING_TO_MISS`), and why each part it had on is off: the
        flags set False, ``deficit_2d`` batching B3's ``fcfs`` (no byte
        budget), ``host_experts`` ``off`` (``host_control`` back to
        ``controller``: there is no host part to run) and an ``adaptive``
        verify width ``full`` (a ``fixed:K`` width is kept: it was asked for)."""
        off: dict[str, str] = {}
        changes: dict[str, Any] = {}
        for part, why in NOTHING_TO_MISS.items():
            if part == "scheduler_2d":
                if self.batching == "deficit_2d":
                    off[part] = why
                    changes.update(batching="fcfs", byte_budget=None)
            elif part == "host_experts":
                if self.host_experts != "off":
                    off[part] = why
                    changes[part] = "off"
                    changes["host_control"] = "controller"
            elif part == "verify_width":
                from pdflash.engine.verify_width import is_adaptive

                if is_adaptive(self.verify_width):
                    off[part] = why
                    changes[part] = "full"
            elif getattr(self, part):
                off[part] = why
                changes[part] = False
        return self.replace(**changes), off


def check_lookahead_tail(tail: Any, score: Any, host_experts: Any) -> None:
    """Raise ValueError unless ``tail`` is one of :data:`LOOKAHEAD_TAILS` and
    combines with the lookahead score and the hybrid miss service
    (:attr:`EngineConfig.lookahead_tail`)."""
    if tail not in LOOKAHEAD_TAILS:
        raise ValueError(f"lookahead_tail must be one of {LOOKAHEAD_TAILS}, got {tail!r}")
    if tail != "skip" and score == "every":
        raise ValueError(
            f"lookahead_tail {tail!r} needs a threshold: under lookahead_score 'every' no "
            "lookahead expert is below it"
        )
    if tail != "skip" and host_experts != "off":
        raise ValueError(
            f"lookahead_tail {tail!r} is not combined with host_experts {host_experts!r} "
            "(the hybrid miss service's host split plans only the confident copies)"
        )


def check_host_control(value: Any) -> None:
    """Raise ValueError unless ``value`` is one of :data:`HOST_CONTROLS`
    (:attr:`EngineConfig.host_control`, the PD controller's too)."""
    if value not in HOST_CONTROLS:
        raise ValueError(f"host_control must be one of {HOST_CONTROLS}, got {value!r}")


def check_host_ahead_min_exposed(value: Any) -> None:
    """Raise ValueError unless ``value`` is a share in [0, 1]
    (:attr:`EngineConfig.host_ahead_min_exposed`)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not 0.0 <= value <= 1.0
    ):
        raise ValueError(f"host_ahead_min_exposed must be a share in [0, 1], got {value!r}")
