"""The DFlash serving engine: continuous batching over offloaded experts.

A request moves ``WAITING -> (prefill) -> DRAFT -> VERIFY -> DRAFT ... ->
FINISHED`` (or ``ABORTED`` at any point). The step is a pipeline of owners,
each with one job: the :class:`~pdflash.engine.requests.RequestTable`
(request state and the admission ledger), the drafter, the batcher
(:class:`~pdflash.engine.batching.VerifyBatcher`), the prefetch planner
(:class:`~pdflash.engine.prefetch.ExpertPrefetcher`, every copy started
ahead of need), the :class:`~pdflash.engine.verify.Verifier` (a forward
and acceptance that return outcomes) and the engine, which commits the
outcomes and keeps the books. One :meth:`Engine.step`:

1. admits waiting requests while KV pages and ``max_running`` allow, and
   prefills them in one batched target forward (first token -> TTFT);
2. drafts a block for every request in DRAFT, in one batched drafter forward,
   and cuts each block to its verify width (``config.verify_width``,
   :mod:`pdflash.engine.verify_width`; lossless: the bonus token follows the
   last verified draft);
3. predicts each drafted block's experts (route-ahead predictor; with
   route-ahead off in shadow, :attr:`Engine.route_ahead_shadow`, the
   predictions are only counted against the verify's routing);
4. the batcher picks the verify batch (token grants) from the demands and
   the resident set; with route-ahead on, the batch's predicted missing
   experts are copied ROUTE_AHEAD before the verify forward starts;
5. the verifier runs the batch in one target forward and decides each
   request's acceptance (greedy prefix + bonus, lossless rejection sampling,
   or a forced length), committing nothing; the engine records the books
   (routing trace, route-ahead stats, predictor observations), then commits
   each outcome: rolls the target KV back to the accepted length, streams
   tokens and keeps the committed positions' hidden states for the next draft;
6. the planner's BACKGROUND prefetch of the frequency prior with the byte
   budget left.

With ``streaming_prefetch`` (PD), steps 3-5 copy through a
:class:`~pdflash.engine.prefetch.StreamingPrefetcher` instead of one batch of
copies: right after a verify (end of 5) the next verify's first layers are
planned from the routed set of the requests that go on and their copies
start, so they run while step 2 drafts; step 3 sets the plan from the
predictions, once per step (stale queued copies are cancelled; step 4 only
re-plans if the batcher deferred some requests); during the verify each layer's routing and
release advance the stream to the next layer (gate lookahead), never
evicting an expert the forward needs earlier.

Where the expert cache has a slot for every expert (cache fraction 1.0), the
engine fills it when built, as B3's, and (``config.full_cache`` auto) runs
none of the parts that only serve a miss: no prediction in step 3, no
route-ahead copies, stream, lookahead or background prefetch, no PD
controller, no hybrid miss service, a 2-D scheduler's batch chosen as
B3's, FCFS under the token budget, and every draft verified where the
width was ``adaptive`` (a ``fixed:K`` width is kept;
:meth:`Engine.full_cache_state` says what was switched off).

At the end of every step the request table's invariants are asserted.

Failure semantics (README "Failure semantics"): an exception in a stage of
a step ends only the requests that stage was working on, with
``finish_reason="error"`` and :attr:`Request.error`; their KV pages and the
pages promised to them are released, and every other request goes on. A
verify's outcomes are committed request by request (KV rollback, streaming), so a
failure while accepting or committing one request never touches another's
tokens. A failed prefill releases its pages and is retried once, alone.
Prefetch failures (route-ahead, lookahead, the stream, background) affect no
request: the planner counts them (``Engine.prefetch_failures``). The engine is single-threaded: a second thread
entering while a step runs gets :class:`~pdflash._guard.ConcurrentUseError`.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import numpy.typing as npt
import torch

from pdflash._guard import BusyGuard
from pdflash.engine import pd_controller, validation
from pdflash.engine.acceptance import AcceptanceModel, ModelAcceptance
from pdflash.engine.attention import device_int64
from pdflash.engine.batching import (
    BatchDecision,
    DeficitBatcher,
    DelegatingBatcher,
    FCFSBatcher,
    VerifyBatcher,
    VerifyDemand,
    first_come_grants,
)
from pdflash.engine.config import NOTHING_TO_MISS, EngineConfig
from pdflash.engine.drafter import DFlashDrafter, DraftItem
from pdflash.engine.fixed_step import FixedStepFeed
from pdflash.engine.graphs import CudaGraphBackend, GraphRunner
from pdflash.engine.kv_cache import PagedKVCache
from pdflash.engine.predict import TokenRoutingRecorder
from pdflash.engine.prefetch import ExpertPrefetcher, StreamingPrefetcher
from pdflash.engine.replay import LookaheadRoutingSource, RoutingSource
from pdflash.engine.requests import (
    DONE_STATES,
    Request,
    RequestMetrics,
    RequestState,
    RequestTable,
    TokenCallback,
    TokenCallbackError,
)
from pdflash.engine.sampling import (
    SamplingParams,
    sample_from,
    target_probs,
)
from pdflash.engine.target import Chunk, TargetRunner, kv_cache_for
from pdflash.engine.timing import ComputeTimer, StallTimedCache
from pdflash.engine.verify import Verifier, VerifyOutcome, VerifyResult, anchor_tensor
from pdflash.engine.verify_width import (
    VerifyWidthPolicy,
    WidthHook,
    build_policy,
    follows_setting_alone,
)
from pdflash.models.offload import OffloadedAdapter
from pdflash.protocols import (
    Band,
    DraftedBlock,
    ExpertCacheView,
    ExpertPredictor,
    HorizonPolicy,
    MoEModelAdapter,
    RouteStatsSink,
    decoder_layer_plan,
    flat_expert_ids,
)
from pdflash.routeahead.predictors import token_learners

if TYPE_CHECKING:
    from pdflash.cache.expert_cache import ExpertCache

__all__ = [
    "STALL_STEPS",
    "Engine",
    "Request",
    "RequestMetrics",
    "RequestState",
    "StepReport",
    "TokenCallback",
    "TokenCallbackError",
]

#: consecutive steps without progress after which :meth:`Engine.run_until_done` gives up
STALL_STEPS = 3


@dataclass
class StepReport:
    admitted: int = 0
    drafted: int = 0
    verified: int = 0
    verified_tokens: int = 0  # tokens the verify forward took (anchors + granted drafts)
    committed_tokens: int = 0
    finished: list[int] = field(default_factory=list)
    scheduler_us: float = 0.0
    errors: dict[int, str] = field(default_factory=dict)  # request id -> error text
    #: (request id, drafts verified, drafts accepted) per request the verify
    #: judged (the PD controller's expected committed tokens learn from them)
    verify_outcomes: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def progressed(self) -> bool:
        """Did this step change any request's state?"""
        return bool(self.admitted or self.drafted or self.verified or self.finished or self.errors)


class Engine:
    """Continuous-batching DFlash engine over an :class:`MoEModelAdapter`.

    Single-threaded: call it from one thread at a time (a second thread
    entering while a step runs gets a clear ``RuntimeError``,
    :class:`~pdflash._guard.ConcurrentUseError`). Stream callbacks may call
    :meth:`abort` and :meth:`add_request` but not :meth:`step` (not re-entrant).

    Retention: finished requests stay in :attr:`finished` until
    :meth:`pop_finished` (or, with ``max_finished``, the oldest beyond that
    many are dropped); the measurement lists (``routing_trace``,
    ``trace_kinds``, ``verify_kv_spans``, ``scheduler_us``) grow per forward/step until
    :meth:`reset_stats`.

    Args:
        adapter: the target model (offloaded or resident).
        config: an :class:`EngineConfig` (see :meth:`EngineConfig.preset`).
        drafter: the DFlash drafter (required when ``config.speculative``).
        batcher: the verify batcher; default FCFS under ``config.token_budget``.
            ``deficit_*`` batching needs one (see :mod:`pdflash.engine.batching`).
        predictor: route-ahead predictor (used when ``config.route_ahead``).
            One that learns from per-row routing (``observe_tokens``, e.g.
            :class:`pdflash.routeahead.TokenPriorPredictor`) gets every
            prefill's and verify's rows and their top-k (one host copy per
            forward, only then).
        horizon: optional acceptance-aware horizon
            (:class:`pdflash.routeahead.AcceptanceHorizon`): predict only for the
            positions the request is likely to accept.
        acceptance: forced or model-driven acceptance (default model-driven).
        routing: where each layer's top-k experts come from (default: the
            target's router; :class:`pdflash.engine.replay.TraceRouting`
            replays a trace's).
        expert_cache: the adapter's expert cache, if experts are offloaded
            (``resident_mask()``, ``prefetch(ids, band)``, ``stats()``). One
            with a slot for every expert is filled here, before the first
            request, and (``config.full_cache`` auto) the parts that only
            serve a miss are off (:meth:`full_cache_state`); ``config`` is
            then that configuration, a 2-D deficit ``batcher`` is
            replaced by FCFS (a :class:`~pdflash.engine.batching.DelegatingBatcher`'s
            inner one, e.g. expert-parallel ranks'), a
            ``host_service`` is detached from the runtime and not used, and
            a ``width`` policy that decides from measured timing (anything
            but ``fixed:K``) is not used: every draft is verified.
        route_stats: route-ahead bookkeeping with ``update(predicted, routed,
            resident)`` over ``(layers, experts)`` masks (optional).
        host_service: the hybrid miss service
            (:class:`pdflash.hybrid.HostExpertService`, attached to the
            adapter's offloaded runtime) when ``config.host_experts`` is
            ``auto``: before each verify its planner turns the route-ahead
            prediction into the experts expected to be computed on the host;
            those are left out of the stream's ROUTE_AHEAD copies and handed
            to the verify scheduler as if resident (they cost no link bytes).
        max_seq_len: longest prompt + output a request may have (sizes KV).
        device: where activations live (the adapter's device).
        max_finished: keep at most this many finished requests in
            :attr:`finished` (oldest dropped first); None keeps all until
            :meth:`pop_finished`.
        controller: a :class:`~pdflash.engine.pd_controller.PartsPolicy`
            that switches PD's parts (route-ahead, 2-D scheduler, streaming
            prefetcher) on and off each step; default: a
            :class:`~pdflash.engine.pd_controller.PDController` when
            ``config.parts_controller`` is set, else none (the parts run as
            configured). None where the cache holds every expert
            (``config.full_cache`` auto): nothing to switch.
        graphs: a :class:`~pdflash.engine.graphs.GraphRunner` the target
            forward and the drafter replay their steps through (any device; e.g. with the
            :class:`~pdflash.engine.graphs.EagerBackend` in tests). Default:
            one over CUDA graphs when ``config.cuda_graphs`` is not ``off``
            and the device is CUDA (pieces only with ``piecewise``), else none.
        width: a :class:`~pdflash.engine.verify_width.VerifyWidthPolicy`
            (how many of each request's drafts a verify checks); default:
            the one ``config.verify_width`` names (none for ``full``: every
            draft is verified). None where the cache holds every expert
            (``config.full_cache`` auto) and the width is ``adaptive``:
            nothing to save by narrowing.
    """

    def __init__(
        self,
        adapter: MoEModelAdapter,
        config: EngineConfig,
        *,
        drafter: DFlashDrafter | None = None,
        batcher: VerifyBatcher | None = None,
        predictor: ExpertPredictor | None = None,
        horizon: HorizonPolicy | None = None,
        acceptance: AcceptanceModel | None = None,
        routing: RoutingSource | None = None,
        expert_cache: ExpertCacheView | None = None,
        route_stats: RouteStatsSink | None = None,
        host_service: Any = None,
        max_seq_len: int = 1024,
        device: torch.device | str = "cpu",
        kv_dtype: torch.dtype | None = None,
        clock: Callable[[], float] = time.perf_counter,
        max_finished: int | None = None,
        controller: pd_controller.PartsPolicy | None = None,
        graphs: GraphRunner | None = None,
        width: VerifyWidthPolicy | None = None,
    ) -> None:
        if max_finished is not None:
            validation.check_int("max_finished", max_finished, low=0)
        if config.speculative and drafter is None:
            raise ValueError(f"baseline {config.baseline!r} is speculative and needs a drafter")
        if config.speculative and drafter is not None:
            if config.block_size > 1 and drafter.cfg.hidden_size != adapter.hidden_size:
                raise ValueError(
                    f"drafter hidden_size {drafter.cfg.hidden_size} != target {adapter.hidden_size}"
                )
            # the drafter reads decoder layers' hidden states (dense ones included)
            n_decoder = len(decoder_layer_plan(adapter))
            bad = [i for i in drafter.target_layer_ids if not 0 <= i < n_decoder]
            if bad:
                raise ValueError(
                    f"drafter target_layer_ids {list(drafter.target_layer_ids)} out of range for "
                    f"a {n_decoder}-layer target"
                )
        #: the full-cache decision (:meth:`full_cache_state`): with a slot
        #: for every expert, the cache is filled before the first request and
        #: the parts that only serve a miss are off (``config.full_cache``)
        self._full_cache_off: dict[str, str] | None = None
        if fills_full_cache(config, adapter, expert_cache):
            config, off = config.without_miss_parts()
            if controller is not None:  # e.g. PD-all-on's fixed books: no part to switch
                off.setdefault("parts_controller", NOTHING_TO_MISS["parts_controller"])
                controller = None
            self._full_cache_off = off
            if "scheduler_2d" in off:
                batcher = _without_2d_scheduler(batcher, config.token_budget)
            if "host_experts" in off and host_service is not None:
                # the caller's service (attached to the runtime when built)
                # stays unused: detached, so no layer reads its routing for it
                runtime_now = adapter.runtime if isinstance(adapter, OffloadedAdapter) else None
                if runtime_now is not None and runtime_now.host_service is host_service:
                    runtime_now.host_service = None
                host_service = None
            if width is not None and follows_setting_alone(width):
                # the caller's fixed:K policy runs, whatever the configuration's width
                off.pop("verify_width", None)
            elif width is not None:
                # e.g. an adaptive policy: it narrows a verify to save
                # copies, and there is none to save
                off.setdefault("verify_width", NOTHING_TO_MISS["verify_width"])
                width = None
        if config.batching != "fcfs" and batcher is None:
            raise ValueError(
                f"batching {config.batching!r} needs a batcher (the deficit scheduler)"
            )
        if config.route_ahead and predictor is None:
            raise ValueError("route_ahead needs a predictor")
        if max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len}")
        if config.host_experts != "off" and (host_service is None or expert_cache is None):
            raise ValueError(
                f"host_experts={config.host_experts!r} needs offloaded experts and a host_service "
                "(pdflash.hybrid.build_host_service)"
            )
        if expert_cache is not None:
            single = expert_cache.single_band
            if not config.bands and single is None:
                raise ValueError(
                    "config.bands is False (one FIFO band) but the expert cache issues copies in "
                    "bands: build it with ExpertCache(single_band=Band.ON_DEMAND)"
                )
            if config.bands and single is not None:
                raise ValueError(
                    f"the expert cache issues every copy in one band ({single!r}) but "
                    "config.bands is True: use bands=False (the PD-one-band ablation)"
                )
        self.adapter = adapter
        self.config = config
        self.device = torch.device(device)
        self.drafter = drafter if config.speculative else None
        self.batcher: VerifyBatcher = batcher or FCFSBatcher(config.token_budget)
        self.predictor = predictor if config.route_ahead else None
        # "verified": predict for every row the verify routes (no horizon)
        self.horizon = (
            horizon if config.route_ahead and config.route_ahead_horizon == "acceptance" else None
        )
        self.predict_s = 0.0
        #: route-ahead's batch books over the verify forwards: the (layer,
        #: expert) pairs the batch's predictions named (union over its
        #: requests) and how many of them the verify routed (the PD
        #: controller's route-ahead gate reads each step's deltas)
        self.route_ahead_predicted_n = 0
        self.route_ahead_hit_n = 0
        #: route-ahead runs in shadow (set by the PD controller's parts,
        #: :class:`~pdflash.engine.pd_controller.PartsState`): with
        #: ``config.route_ahead`` off, the predictor still predicts
        #: (``Request.shadow_predicted``) and its predictions enter the two
        #: counters above, and nothing else (no copy, stream plan, eviction
        #: protection, host plan or scheduler demand)
        self.route_ahead_shadow = False
        self.acceptance: AcceptanceModel = acceptance or ModelAcceptance()
        self.expert_cache = expert_cache
        self.route_stats = route_stats
        self.max_seq_len = max_seq_len
        self.clock = clock
        self.timer = ComputeTimer(self.device)
        self.host_service = host_service if config.host_experts != "off" else None
        # the offloaded block the adapter runs now, if any
        runtime = adapter.runtime if isinstance(adapter, OffloadedAdapter) else None
        if self.host_service is not None:
            self.host_service.timer = self.timer
            if runtime is not None:
                runtime.host_service = self.host_service  # the block's hook
        elif runtime is not None and runtime.host_service is not None:
            raise ValueError(
                "the adapter's offloaded runtime has a host_service but config.host_experts is "
                "'off' (its books would be missing from the engine's): detach it "
                "(runtime.host_service = None) or use host_experts='auto'"
            )
        #: (layers, experts) experts planned for the host in the coming verify
        self.host_ahead: npt.NDArray[np.bool_] | None = None
        self._wait_sample: tuple[float, float] | None = None  # (waited s, clock s)
        #: pre-verify host plans the exposed-miss gate let run (``open``) and
        #: skipped (``closed``): see :meth:`host_ahead_gate`
        self._gate_counts = {"open": 0, "closed": 0}

        ps = config.kv_page_size
        self._pages_per_seq = -(-(max_seq_len + config.block_size) // ps)
        num_pages = self._pages_per_seq * config.max_running
        dtype = kv_dtype or _param_dtype(adapter)
        if graphs is None and config.cuda_graphs != "off" and self.device.type == "cuda":
            piecewise = config.cuda_graphs == "piecewise"
            graphs = GraphRunner(CudaGraphBackend(self.device), piecewise=piecewise)
        self.kv = kv_cache_for(
            adapter,
            page_size=ps,
            num_pages=num_pages,
            dtype=dtype,
            device=self.device,
            scratch=graphs is not None,  # the padded rows' writes
        )
        self.draft_kv: PagedKVCache | None = None
        capture: tuple[int, ...] = ()
        if self.drafter is not None:
            self.draft_kv = self.drafter.new_kv_cache(
                num_pages=num_pages,
                page_size=ps,
                device=self.device,
                dtype=dtype,
                scratch=graphs is not None,
            )
            capture = self.drafter.target_layer_ids
        self.runner = TargetRunner(adapter, self.kv, capture_layers=capture, device=self.device)
        self.runner.graphs = graphs
        self.routing = routing
        self.runner.routing = routing
        before_layer = getattr(getattr(expert_cache, "policy", None), "before_layer", None)
        if before_layer is not None:
            self.runner.before_moe_hooks.append(before_layer)
        #: the one owner of expert prefetching (route-ahead, the stream,
        #: lookahead, background) and of its counters
        self.prefetch = ExpertPrefetcher(
            adapter,
            expert_cache,
            config,
            lookahead_predictor=(
                routing.next_layer_predictor(config.lookahead_predictor_score)
                if isinstance(routing, LookaheadRoutingSource)
                else None
            ),
        )
        # after the policy's before_layer, so the stream's victims are ranked from this layer
        self.prefetch.install(self.runner)
        #: predictors that learn from every routed row (token id -> experts):
        #: each prefill's and verify's per-row top-k comes back for them
        self._token_learners = token_learners(self.predictor)
        self._token_recorder: TokenRoutingRecorder | None = None
        if self._token_learners:
            self._token_recorder = TokenRoutingRecorder(adapter.num_layers)
            self.runner.observers.append(self._token_recorder)
        self.verifier = Verifier(
            self.runner,
            self.kv,
            self.timer,
            self.acceptance,
            self.device,
            keep_features=self.drafter is not None,
        )
        # NOTE: time the compute stream's waits on copies by wrapping the cache
        # the offloaded MoE runtime calls (``adapter.runtime.cache``) if it has one.
        if runtime is not None:
            base: Any = runtime.cache
            while isinstance(base, StallTimedCache):  # an earlier engine's wrapper
                base = base.wrapped
            # the wrapper passes every other call through to the cache
            runtime.cache = cast("ExpertCache", StallTimedCache(base, self.timer))

        if expert_cache is not None and (config.all_resident or self._full_cache_off is not None):
            self.prefetch.load_every_expert()

        #: every request and where it stands (queue, running, finished, KV ledger)
        self.requests = RequestTable(max_finished)
        self._guard = BusyGuard("Engine")
        self._stage = "idle"  # the stage running now (named in error texts)
        # measurements
        self.routing_trace: list[npt.NDArray[np.int64]] = []
        self.trace_kinds: list[str] = []
        #: per verify forward: each request's (KV length before, tokens
        #: verified), what its attention read (the verify roofline's KV bytes)
        self.verify_kv_spans: list[tuple[tuple[int, int], ...]] = []
        self.steps = 0
        self.scheduler_us: list[float] = []
        #: scheduled steps the batcher granted whole without its scheduler
        self.uncontended_steps = 0
        self.verify_forwards = 0
        self.first_step_s: float | None = None
        self.last_step_s: float | None = None
        # ---- PD controller hook (pdflash.engine.pd_controller) ----
        if controller is None and config.parts_controller:
            controller = pd_controller.PDController(
                host_gate=pd_controller.HOST_GATE_EXPOSED,
                host_control=config.host_control,
                route_ahead_gate=pd_controller.ROUTE_AHEAD_GATE_PRECISION
                if config.route_ahead_gate != "off"
                else None,
                route_ahead_cost_gate=config.route_ahead_gate == "precision_cost",
                route_ahead_shadow_check=config.route_ahead_shadow_check,
            )
        self.parts = pd_controller.attach(self, controller) if controller is not None else None
        # ---- verify width hook (pdflash.engine.verify_width) ----
        if width is None and self.drafter is not None:
            width = build_policy(
                config.verify_width,
                block_size=config.block_size,
                num_layers=adapter.num_layers,
                num_experts=adapter.num_experts,
                top_k=adapter.top_k,
                expert_bytes=0 if expert_cache is None else int(expert_cache.expert_nbytes),
            )
        self.width = WidthHook(self, width) if width is not None and self.drafter else None
        #: the marginal rule's F following the width policy's step-time fit
        #: (pdflash.engine.fixed_step; attached by the caller that set F)
        self.fixed_step: FixedStepFeed | None = None

    def full_cache_state(self) -> dict[str, Any]:
        """Whether the expert cache holds every expert, for the books:
        ``state`` ``filled`` (filled before the first request; B3's
        ``all_resident`` or ``config.full_cache`` auto with a slot for every
        expert) with ``switched_off`` (each part the configuration had on
        that only serves a miss, and why it is off), or ``off`` with
        ``why_off``."""
        setting = self.config.full_cache
        cache = self.expert_cache
        if cache is None:
            return {"setting": setting, "state": "off", "why_off": "no expert cache"}
        if self.config.all_resident:
            return {"setting": setting, "state": "filled", "by": "all_resident", "switched_off": {}}
        if self._full_cache_off is not None:
            return {
                "setting": setting,
                "state": "filled",
                "by": "full_cache",
                "switched_off": dict(self._full_cache_off),
            }
        total = self.adapter.num_layers * self.adapter.num_experts
        if int(cache.num_slots) < total:
            why = f"the expert cache has {int(cache.num_slots)} slots for {total} experts"
        else:
            why = "full_cache off: the configuration runs as given, the cache fills on demand"
        return {"setting": setting, "state": "off", "why_off": why}

    # ------------------------------------------------- owners' state, by name
    @property
    def stream(self) -> StreamingPrefetcher | None:
        """The planner's streaming prefetcher (PD), if any."""
        return self.prefetch.stream

    @property
    def prefetch_bytes(self) -> dict[Band, int]:
        """Bytes of the copies the planner submitted, per band."""
        return self.prefetch.bytes_submitted

    @property
    def prefetch_failures(self) -> int:
        """Prefetch calls that raised (no request was affected)."""
        return self.prefetch.failures

    @property
    def route_freq(self) -> npt.NDArray[np.float64]:
        """The planner's routing-frequency prior, ``(layers, experts)``."""
        return self.prefetch.route_freq

    @property
    def finished(self) -> OrderedDict[int, Request]:
        """Finished requests until :meth:`pop_finished`."""
        return self.requests.finished

    @property
    def max_finished(self) -> int | None:
        return self.requests.max_finished

    @property
    def _requests(self) -> dict[int, Request]:
        return self.requests.live

    @property
    def _waiting(self) -> deque[int]:
        return self.requests.waiting

    @property
    def _running(self) -> list[int]:
        return self.requests.running

    @property
    def _committed_pages(self) -> int:
        return self.requests.promised_pages

    # ------------------------------------------------------------------ API
    def add_request(
        self,
        prompt_ids: Sequence[int] | npt.NDArray[np.integer[Any]] | torch.Tensor,
        params: SamplingParams | None = None,
        *,
        max_new_tokens: int = 64,
        stop_ids: Sequence[int] | frozenset[int] | set[int] = (),
        slo_s: float | None = None,
        on_token: TokenCallback | None = None,
        seed: int | None = None,
    ) -> int:
        """Queue a request; returns its id.

        ``seed``: the request's own random stream. A sampled request with a
        seed gives the same tokens for the same prompt, parameters and seed
        on the same engine whatever the load: it is verified at a width that
        does not follow timing (every draft under ``adaptive``; ``fixed:K``
        as configured), since under speculative sampling the committed
        tokens depend on which drafts were verified. Without a seed the
        stream derives from ``config.seed`` and the request id, and the
        width follows the policy. Not covered: a different batch can change
        the forwards' floating-point rounding (and a scheduler's token budget
        that trims blocks, the verified drafts), either of which can change a
        sampled token.

        Raises ``TypeError`` or ``ValueError`` with nothing queued and no state
        changed on: prompt ids that are not integers (bools, floats and
        strings are refused; numpy/torch integer arrays are fine), an empty
        prompt or an id outside the vocabulary; ``max_new_tokens`` that is not
        an integer >= 1; ``len(prompt) + max_new_tokens`` beyond
        ``max_seq_len`` or beyond the model's ``max_position_embeddings``
        (the last position a request can reach); stop ids likewise; a seed
        that is not an integer in ``[0, 2**64)``; a non-finite or
        non-positive ``slo_s``; ``params`` that is not a
        :class:`SamplingParams`; an ``on_token`` that is not callable."""
        with self._guard.enter("add_request"):
            vocab = self.adapter.vocab_size
            prompt = validation.token_ids("prompt_ids", prompt_ids, vocab)
            if not prompt:
                raise ValueError("prompt_ids is empty")
            max_new = validation.check_int("max_new_tokens", max_new_tokens, low=1)
            if len(prompt) + max_new > self.max_seq_len:
                raise ValueError(
                    f"prompt ({len(prompt)}) + max_new_tokens ({max_new}) exceeds "
                    f"max_seq_len {self.max_seq_len}"
                )
            max_pos = validation.max_positions(self.adapter)
            if max_pos is not None and len(prompt) + max_new > max_pos:
                raise ValueError(
                    f"prompt ({len(prompt)}) + max_new_tokens ({max_new}) exceeds the model's "
                    f"max_position_embeddings {max_pos}"
                )
            if isinstance(stop_ids, (set, frozenset)):
                stop_ids = sorted(stop_ids, key=repr)
            stops = validation.token_ids("stop_ids", stop_ids, vocab)
            slo = validation.positive_seconds("slo_s", slo_s)
            if params is not None and not isinstance(params, SamplingParams):
                raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
            if on_token is not None and not callable(on_token):
                raise TypeError(f"on_token must be callable, got {type(on_token).__name__}")
            if seed is not None:
                seed = validation.check_int("seed", seed, low=0, high=validation.SEED_MAX)
            rid = self.requests.next_id()
            gen = torch.Generator().manual_seed(
                (self.config.seed * 1_000_003 + rid) if seed is None else seed
            )
            req = Request(
                request_id=rid,
                prompt=prompt,
                params=params or SamplingParams(),
                max_new_tokens=max_new,
                stop_ids=frozenset(stops),
                on_token=on_token,
                metrics=RequestMetrics(rid, len(prompt), arrival_s=self.clock(), slo_s=slo),
                generator=gen,
                seeded=seed is not None,
            )
            self.requests.add(req)
            return rid

    def abort(self, request_id: int) -> bool:
        """Abort a waiting or running request, releasing its KV pages; False if
        unknown or already done (aborting twice is harmless)."""
        if not validation.is_int(request_id):
            return False
        with self._guard.enter("abort"):
            req = self.requests.live.get(int(request_id))
            if req is None:
                return False
            self._finish(req, "abort")
            return True

    def pop_finished(self, request_ids: Sequence[int] | None = None) -> dict[int, Request]:
        """Remove and return finished requests (all, or those of ``request_ids``
        that are finished): the way a long-running server releases them."""
        with self._guard.enter("pop_finished"):
            return self.requests.pop_finished(
                None if request_ids is None else [int(r) for r in request_ids]
            )

    def reset_stats(self) -> None:
        """Zero every measurement a fresh engine starts without: the routing
        trace, per-step scheduler times, forward timers, step and verify
        counts, prediction time, the planner's counters (bytes per band,
        failures, the stream's copies), and the books of what the engine was
        given: the expert cache's, the route-ahead stats', the acceptance
        model's and routing source's, the hybrid service's. Kept: requests
        (finished ones stay until :meth:`pop_finished`) and what was
        learned (routing prior, plan-source precision, predictor state)."""
        with self._guard.enter("reset_stats"):
            self.routing_trace.clear()
            self.trace_kinds.clear()
            self.verify_kv_spans.clear()
            self.scheduler_us.clear()
            self.uncontended_steps = 0
            self.timer.reset()
            self.verify_forwards = 0
            self.steps = 0
            self.predict_s = 0.0
            self.route_ahead_predicted_n = 0
            self.route_ahead_hit_n = 0
            self.prefetch.reset_stats()
            for books in (self.acceptance, self.routing, self.expert_cache):
                reset = getattr(books, "reset_stats", None)
                if reset is not None:
                    reset()
            if self.route_stats is not None:
                self.route_stats.reset()
            if self.host_service is not None:
                self.host_service.reset_stats()
            self._gate_counts = dict.fromkeys(self._gate_counts, 0)
            if self.parts is not None:  # PD controller hook: its books too
                self.parts.policy.reset_stats()
            if self.width is not None:
                self.width.reset_stats()
            if self.runner.graphs is not None:
                self.runner.graphs.reset_stats()

    def prepare_graphs(
        self,
        max_running: int | None = None,
        max_seq_len: int | None = None,
        *,
        min_prompt_len: int = 1,
        min_seq_len: int | None = None,
        max_prompt_len: int | None = None,
        limit: int | None = None,
        max_bytes: int | None = None,
        draft_limit: int | None = None,
    ) -> dict[str, Any]:
        """Record the verify forward's CUDA graphs for every bucket the
        engine can meet (:meth:`~pdflash.engine.graphs.GraphRunner.verify_buckets`),
        before any request, so no step of a later run pays a capture or its
        first-replay check (a server at start-up, a bench in its warm-up).

        ``max_running`` (default and at most ``config.max_running``): the
        most requests a verify batches; ``max_seq_len`` (default and at
        most the engine's): the longest prompt + output a request will
        have; ``min_prompt_len`` / ``min_seq_len`` (default
        ``min_prompt_len + 1``): the shortest prompt, and prompt + output.
        ``limit`` and ``max_bytes`` bound the graphs held and the bytes the
        prepared ones take (:meth:`~pdflash.engine.graphs.GraphRunner.prepare`).
        With a drafter, its graphs too
        (:meth:`~pdflash.engine.graphs.GraphRunner.draft_buckets`: every
        new-context bucket a draft of so many requests can have, the
        longest prompt ``max_prompt_len``, default ``max_seq_len - 1``), at
        most ``draft_limit`` (default: the runner's limit), under the
        report's ``draft``. Returns its report (``state`` ``off`` with
        ``why`` when the engine has no graph runner). Raises
        ``RuntimeError`` with requests live and ``ValueError`` on bad
        bounds (nothing recorded)."""
        with self._guard.enter("prepare_graphs"):
            graphs = self.runner.graphs
            if graphs is None:
                why = "cuda_graphs off" if self.config.cuda_graphs == "off" else "not a CUDA device"
                return {"state": "off", "why": why}
            if self.has_work:
                raise RuntimeError("prepare_graphs needs an engine with no live request")
            running = self.config.max_running if max_running is None else max_running
            longest = self.max_seq_len if max_seq_len is None else max_seq_len
            validation.check_int("max_running", running, low=1, high=self.config.max_running)
            validation.check_int("max_seq_len", longest, low=2, high=self.max_seq_len)
            validation.check_int("min_prompt_len", min_prompt_len, low=1, high=longest - 1)
            shortest = min_prompt_len + 1 if min_seq_len is None else min_seq_len
            validation.check_int("min_seq_len", shortest, low=min_prompt_len + 1, high=longest)
            if max_prompt_len is not None:
                validation.check_int(
                    "max_prompt_len", max_prompt_len, low=min_prompt_len, high=longest - 1
                )
            block = self.config.block_size if self.drafter is not None else 1
            keys = graphs.verify_buckets(
                max_requests=running,
                max_tokens=block,
                min_prompt_len=min_prompt_len,
                min_seq_len=shortest,
                max_seq_len=longest,
                full_width=self.width is None,
            )
            report = graphs.prepare(
                self.runner, keys, limit=limit, max_bytes=max_bytes, seed=self.config.seed
            )
            out: dict[str, Any] = {"state": "on", **report}
            if self.drafter is not None and self.draft_kv is not None:
                ad = self.adapter
                act = ad.embed(torch.zeros(1, dtype=torch.int64, device=self.device)).dtype
                draft_keys = graphs.draft_buckets(
                    max_requests=running,
                    max_tokens=block,
                    min_prompt_len=min_prompt_len,
                    max_prompt_len=longest - 1 if max_prompt_len is None else max_prompt_len,
                    min_seq_len=shortest,
                    max_seq_len=longest,
                    features=len(self.drafter.target_layer_ids) * ad.hidden_size,
                    dtype=act,
                    full_width=self.width is None,
                )
                out["draft"] = graphs.prepare_drafts(
                    self.drafter,
                    self.draft_kv,
                    draft_keys,
                    embed_dim=ad.hidden_size,
                    limit=draft_limit,
                    seed=self.config.seed + 1,
                )
            return out

    def request(self, request_id: int) -> Request:
        return self.requests.get(request_id)

    @property
    def has_work(self) -> bool:
        return bool(self.requests.waiting or self.requests.running)

    @property
    def num_running(self) -> int:
        return len(self.requests.running)

    def run_until_done(self, max_steps: int | None = None) -> dict[int, Request]:
        """Step until no request is waiting or running; returns finished requests.

        Raises ``RuntimeError`` after ``max_steps`` steps, or after
        :data:`STALL_STEPS` consecutive steps that changed no request's state
        (a stage doing nothing: it can never loop without progress)."""
        n = 0
        stalled = 0
        while self.has_work:
            if max_steps is not None and n >= max_steps:
                raise RuntimeError(f"requests still live after {max_steps} steps")
            report = self.step()
            n += 1
            stalled = 0 if report.progressed else stalled + 1
            if stalled >= STALL_STEPS:
                live = {rid: self._requests[rid].state.value for rid in self._requests}
                raise RuntimeError(
                    f"the engine made no progress in {STALL_STEPS} consecutive steps with "
                    f"requests still live (id: state) {live}"
                )
        return self.finished

    @torch.no_grad()
    def step(self) -> StepReport:
        """One step (module docstring). A failure inside a stage does not raise:
        the requests that stage was working on end with
        ``finish_reason="error"`` (listed in :attr:`StepReport.errors`).
        Raises :class:`~pdflash._guard.ConcurrentUseError` when another
        thread is inside the engine, or when called from a stream callback."""
        with self._guard.enter("step", reentrant=False):
            try:
                return self._step()
            finally:
                self._stage = "idle"

    def _step(self) -> StepReport:
        """The pipeline: admit and prefill, draft and predict, schedule,
        prefetch, verify, commit, then the end-of-step books."""
        if self.parts is not None:  # PD controller hook: this step's parts
            pd_controller.before_step(self.parts)
        report = StepReport()
        self._begin_step()
        self._prefill_admitted(self._admit(), report)
        if self.width is not None:  # verify width hook: marks after the prefill
            self.width.begin_step()
        self._draft_stage(report)
        batch, decision = self._schedule_stage(report)
        if batch:
            resident_before = self._resident_mask()  # what route-ahead stats score against
            self._prefetch_before_verify(batch, decision)
            result = self._verify_stage(batch, resident_before, report)
            if result is not None:
                self._commit_verified(result, report)
                self.prefetch.background()
        self._end_step(report)
        return report

    def _begin_step(self) -> None:
        now = self.clock()
        if self.first_step_s is None:
            self.first_step_s = now

    def _end_step(self, report: StepReport) -> None:
        self.steps += 1
        self.last_step_s = self.clock()
        self.requests.check()
        if self.width is not None:  # verify width hook: the step's cost
            self.width.end_step(report)
        if self.fixed_step is not None:  # marginal rule's F from the step-time fit
            if self.config.route_ahead:
                self.fixed_step.after_step()
            else:
                self.fixed_step.skip()
        if self.parts is not None:  # PD controller hook: the step's measurement
            pd_controller.after_step(self.parts, report)

    def _draft_stage(self, report: StepReport) -> None:
        """Draft a block for every request in DRAFT (and predict its experts)."""
        to_draft = self.requests.in_state(RequestState.DRAFT)
        if not to_draft:
            return
        self._stage = "draft"
        try:
            self._draft(to_draft)
        except Exception as exc:
            self._fail(to_draft, exc, report)
        report.drafted = sum(r.state == RequestState.VERIFY for r in to_draft)

    def _schedule_stage(
        self, report: StepReport
    ) -> tuple[list[tuple[Request, int]], BatchDecision | None]:
        """The batcher picks the verify batch (request, tokens granted)."""
        waiting = self.requests.in_state(RequestState.VERIFY)
        if not waiting:
            return [], None
        self._stage = "schedule"
        try:
            decision = self._schedule(waiting)
            batch = [(self.requests.live[rid], g) for rid, g in decision.grants]
        except Exception as exc:
            self._fail(waiting, exc, report)
            return [], None
        report.scheduler_us = decision.scheduler_us
        return batch, decision

    def _prefetch_before_verify(
        self, batch: list[tuple[Request, int]], decision: BatchDecision | None
    ) -> None:
        self._stage = "route_ahead"
        missing = decision.missing if decision is not None else np.zeros(0, np.int64)
        self.prefetch.before_verify(
            [r.predicted for r, _ in batch if r.predicted is not None], missing
        )

    def _verify_stage(
        self,
        batch: list[tuple[Request, int]],
        resident_before: npt.NDArray[np.bool_] | None,
        report: StepReport,
    ) -> VerifyResult | None:
        """The verify forward and acceptance, then the books that follow a
        verify (trace, routing prior, route-ahead stats, predictor). A
        failure here, before any request is committed, ends the batch."""
        self._stage = "verify"
        try:
            result = self._verify(batch)
            self._record_verify(batch, result, resident_before)
        except Exception as exc:
            self._fail([r for r, _ in batch], exc, report)
            return None
        report.verified_tokens = sum(g for _, g in batch)
        report.verify_outcomes = [
            (req.request_id, grant - 1, int(o.accepted))
            for (req, grant), o in zip(batch, result.outcomes, strict=True)
            if o.error is None
        ]
        return result

    def _fail(self, reqs: Sequence[Request], exc: Exception, report: StepReport) -> None:
        """End the live requests among ``reqs`` with ``finish_reason="error"``."""
        if isinstance(exc, TokenCallbackError):
            text = str(exc)
        else:
            text = f"{self._stage} failed: {type(exc).__name__}: {exc}"
        for req in reqs:
            if req.state in DONE_STATES:
                continue
            req.error = text
            report.errors[req.request_id] = text
            self._finish(req, "error")

    # ------------------------------------------------------------ lifecycle
    def _admit(self) -> list[Request]:
        """Admit in arrival order while ``max_running`` and the KV ledger allow.

        NOTE: each admitted request is promised its worst-case pages (prompt +
        max_new_tokens + one block), so a running request never fails to grow
        its KV and nothing needs preempting; pages are still allocated lazily,
        so the reported occupancy is what is really used.
        """
        admitted: list[Request] = []
        table = self.requests
        while (req := table.head()) is not None and len(table.running) < self.config.max_running:
            need = self.kv.pages_for(len(req.prompt) + req.max_new_tokens + self.config.block_size)
            if table.promised_pages + need > self.kv.num_pages:
                break
            table.admit(req, need)
            self.kv.add_sequence(req.request_id)
            if self.draft_kv is not None:
                self.draft_kv.add_sequence(req.request_id)
            self.batcher.add(req.request_id)
            req.metrics.admitted_s = self.clock()
            admitted.append(req)
        return admitted

    def _finish(self, req: Request, reason: str) -> None:
        rid = req.request_id
        if not self.requests.end(req, reason, self.clock()):
            return
        self.kv.free(rid)
        if self.draft_kv is not None:
            self.draft_kv.free(rid)
        self.batcher.remove(rid)
        if self.predictor is not None:
            self.predictor.forget(rid)
        if self.horizon is not None:
            self.horizon.forget(rid)
        if self.width is not None:
            self.width.policy.forget(rid)
        if self.parts is not None:
            self.parts.forget(rid)
        for policy in (self.acceptance, self.routing):
            forget = getattr(policy, "forget", None)
            if forget is not None:
                forget(rid)
        req.drafts = req.draft_probs = req.pending_context = req.draft_hidden = None
        self.requests.retire(req)

    def _unadmit(self, req: Request) -> None:
        """Undo :meth:`_admit` (after a failed prefill): release the pages and
        put the request back at the head of the queue."""
        rid = req.request_id
        self.kv.free(rid)
        if self.draft_kv is not None:
            self.draft_kv.free(rid)
        self.batcher.remove(rid)
        self.requests.requeue(req)

    def _commit(self, req: Request, tokens: Sequence[int]) -> int:
        """Append tokens, stream them, finish on a stop id or the length cap.
        Returns how many were committed."""
        n = 0
        try:
            for tok in tokens:
                req.output.append(int(tok))
                n += 1
                if req.on_token is not None:
                    try:
                        req.on_token(req.request_id, int(tok))
                    except Exception as exc:
                        raise TokenCallbackError(
                            f"on_token callback raised {type(exc).__name__}: {exc}"
                        ) from exc
                    if req.state == RequestState.ABORTED:  # the callback aborted it
                        break
                if int(tok) in req.stop_ids:
                    self._finish(req, "stop")
                    break
                if len(req.output) >= req.max_new_tokens:
                    self._finish(req, "length")
                    break
        finally:
            req.metrics.output_tokens = len(req.output)
        return n

    # -------------------------------------------------------------- forwards
    def _record_trace(self, needed: list[npt.NDArray[np.int64]], kind: str) -> None:
        self.routing_trace.extend(needed)
        self.trace_kinds.extend([kind] * len(needed))

    def _prefill_admitted(self, admitted: list[Request], report: StepReport) -> None:
        """Prefill the new requests in one forward, and each request whose
        prefill failed before alone. A failed prefill releases the group's
        pages and requeues it at the head; a second failure is an error."""
        report.admitted = len(admitted)
        fresh = [r for r in admitted if r.prefill_failures == 0]
        groups = ([fresh] if fresh else []) + [[r] for r in admitted if r.prefill_failures]
        for group in groups:
            self._stage = "prefill"
            try:
                self._prefill(group, report)
            except Exception as exc:
                for req in reversed(group):
                    if req.state != RequestState.PREFILL:
                        continue  # aborted by a callback
                    req.prefill_failures += 1
                    if req.prefill_failures > 1:
                        self._fail([req], exc, report)
                    else:
                        self._unadmit(req)
            except BaseException:
                # e.g. KeyboardInterrupt: leave nothing half-admitted
                for req in reversed(group):
                    if req.state == RequestState.PREFILL:
                        self._unadmit(req)
                raise

    def _prefill(self, reqs: list[Request], report: StepReport) -> None:
        # NOTE: every prompt in one asynchronous copy through the runner's
        # reused pinned buffers (a tensor built on CUDA from a list is one
        # blocking pageable copy per request); the forward reads the ids on
        # the same stream, after the copy
        prompts = device_int64(
            [r.prompt for r in reqs], self.device, getattr(self.runner, "staging", None)
        )
        chunks = [Chunk(r.request_id, ids, False) for r, ids in zip(reqs, prompts, strict=True)]
        self.prefetch.begin_forward()
        with self.timer.forward("prefill"):
            out = self.runner.forward(chunks)
        self._settle_host()
        self._record_trace(out.needed_flat, "prefill")
        self.prefetch.observe_routing(np.asarray(out.routed.any(axis=0), dtype=np.bool_))
        if self._token_recorder is not None:
            self._learn_token_routing(np.concatenate([np.asarray(r.prompt) for r in reqs]))
        now = self.clock()
        for i, req in enumerate(reqs):
            if req.state != RequestState.PREFILL:  # aborted by another request's callback
                continue
            try:
                logits = out.logits[i]
                if req.params.greedy:
                    tok = int(torch.argmax(logits[-1]))
                else:
                    tok = int(sample_from(target_probs(logits[-1:], req.params), req.generator)[0])
                if self.drafter is not None:
                    req.pending_context = out.features[i]
                req.metrics.first_token_s = now
                req.round_start_s = now
                req.state = RequestState.DRAFT
                req.anchor = tok
                self._commit(req, [tok])
            except Exception as exc:
                self._fail([req], exc, report)

    def _num_drafts(self, req: Request) -> int:
        left = req.max_new_tokens - len(req.output)
        return max(0, min(self.config.block_size - 1, left - 1))

    def _draft(self, reqs: list[Request]) -> None:
        drafter = self.drafter
        todo: list[tuple[Request, int]] = []
        for req in reqs:
            n = self._num_drafts(req) if drafter is not None else 0
            if n == 0:
                req.drafts = torch.zeros(0, dtype=torch.int64, device=self.device)
                req.draft_probs = None
                req.draft_hidden = None
                req.state = RequestState.VERIFY
            else:
                todo.append((req, n))
        if todo:
            self._draft_blocks(todo)
            if self.width is not None:  # verify width hook: trim before predicting
                self._stage = "verify_width"
                self.width.trim([req for req, _ in todo])
        # off: the PD controller (in shadow it predicts for its books alone)
        if self.predictor is not None and (self.config.route_ahead or self.predicts_in_shadow):
            self._stage = "predict"
            self._predict([r for r in reqs if r.state == RequestState.VERIFY])

    def _draft_blocks(self, todo: list[tuple[Request, int]]) -> None:
        drafter = self.drafter
        assert drafter is not None and self.draft_kv is not None
        mask = drafter.cfg.mask_token_id
        items: list[DraftItem] = []
        ctx: list[torch.Tensor] = []
        blocks: list[int] = []
        for req, n in todo:
            pc = req.pending_context
            assert pc is not None and req.anchor is not None
            items.append(DraftItem(req.request_id, int(pc.shape[0]), n + 1))
            ctx.append(pc)
            blocks += [req.anchor] + [mask] * n
        # one LM-head call over every block's MASK rows (row 0 is the anchor)
        starts = np.cumsum([0] + [n + 1 for _, n in todo])
        rows = [
            r for (_, n), s in zip(todo, starts[:-1], strict=True) for r in range(s + 1, s + n + 1)
        ]
        # NOTE: both index lists in one asynchronous copy from pinned memory
        # (a tensor built on the device from a list waits for the stream)
        block_ids, mask_rows = device_int64([blocks, rows], self.device)
        with self.timer.forward("draft"):
            emb = self.adapter.embed(block_ids)
            scale = drafter.cfg.input_embedding_scale
            if scale != 1.0:
                emb = emb * scale
            hidden = drafter.forward_blocks(
                torch.cat(ctx), emb, items, self.draft_kv, graphs=self.runner.graphs
            )
            all_logits = drafter.logits(hidden[mask_rows], self.adapter.lm_head).float()
            greedy_all = torch.argmax(all_logits, dim=-1)
            row = 0
            for (req, n), s in zip(todo, starts[:-1].tolist(), strict=True):
                h = hidden[s : s + n + 1]
                logits = all_logits[row : row + n]
                if req.params.greedy:
                    req.drafts = greedy_all[row : row + n]
                    req.draft_probs = None
                else:
                    probs = target_probs(logits, req.params)
                    req.draft_probs = probs
                    req.drafts = sample_from(probs, req.generator).to(self.device)
                row += n
                req.pending_context = None
                req.draft_hidden = h
                req.state = RequestState.VERIFY

    @property
    def predicts_in_shadow(self) -> bool:
        """Route-ahead's predictor runs for the books alone this step
        (:attr:`route_ahead_shadow` with ``config.route_ahead`` off)."""
        return self.route_ahead_shadow and not self.config.route_ahead

    def _predict(self, reqs: list[Request]) -> None:
        """Route-ahead: predict every drafted block's experts in one call.
        In shadow (:attr:`predicts_in_shadow`) the
        predictions are kept as ``Request.shadow_predicted``, for the
        route-ahead counters alone: nothing plans from them."""
        from pdflash.routeahead import predict_batch

        assert self.predictor is not None
        if not reqs:
            return
        blocks = []
        anchors = anchor_tensor(reqs, self.device)
        for i, req in enumerate(reqs):
            assert req.anchor is not None and req.drafts is not None
            tokens = torch.cat([anchors[i : i + 1], req.drafts.view(-1)])
            start = self.kv.length(req.request_id)
            block = DraftedBlock(
                request_id=req.request_id,
                token_ids=tokens,
                positions=torch.arange(start, start + tokens.numel(), device=self.device),
                drafter_hidden=req.draft_hidden,
            )
            if self.horizon is not None:
                block = self.horizon.apply(block)
            blocks.append(block)
        t0 = time.perf_counter()
        with self.timer.forward("predict"):
            scores = np.asarray(predict_batch(self.predictor, blocks))
        self.predict_s += time.perf_counter() - t0
        shadow = self.predicts_in_shadow
        for req, sc in zip(reqs, scores, strict=True):
            ids = flat_expert_ids(sc > self.config.route_ahead_min_score)
            if shadow:
                req.shadow_predicted = ids
            else:
                req.predicted = ids
            req.draft_hidden = None
        if shadow:
            return
        if self.host_service is not None:
            self._plan_host_ahead()
        # the planner plans the coming verify as soon as the prediction exists
        # (the batch is chosen next; with every request batched this is its plan)
        self.prefetch.on_predicted(
            [
                r.predicted
                for r in self.requests.live.values()
                if r.state == RequestState.VERIFY and r.predicted is not None
            ]
        )

    def _schedule(self, reqs: list[Request]) -> BatchDecision:
        demands = [
            VerifyDemand(
                request_id=r.request_id,
                tokens=1 + (0 if r.drafts is None else int(r.drafts.numel())),
                predicted=r.predicted,
            )
            for r in reqs
        ]
        parts = self.parts
        if parts is not None and parts.first_come:  # the PD controller at rest
            t0 = time.perf_counter()
            decision = BatchDecision(grants=first_come_grants(demands, self.config.token_budget))
        else:
            resident = self._resident_mask()
            if resident is not None and self.host_ahead is not None:
                # NOTE: experts planned for the host move no link bytes: the
                # scheduler sees them as resident
                resident = resident | self.host_ahead
            t0 = time.perf_counter()
            decision = self.batcher.select(demands, resident)
        us = (time.perf_counter() - t0) * 1e6
        decision.scheduler_us = us
        self.scheduler_us.append(us)
        self.uncontended_steps += decision.uncontended
        if not decision.grants:
            raise RuntimeError(f"batcher {self.batcher.name!r} chose nothing with live work")
        return decision

    def _verify(self, batch: list[tuple[Request, int]]) -> VerifyResult:
        """The verify forward and every request's acceptance (commits nothing)."""
        self.prefetch.begin_forward()
        result = self.verifier.run(batch)
        self._settle_host()
        return result

    def _settle_host(self) -> None:
        """The stream hand-off's check after a forward (its outputs read):
        raises if a HOST job the forward added failed (see
        :meth:`pdflash.hybrid.service.HostExpertService.settle`)."""
        if self.host_service is not None:
            self.host_service.settle()

    def _record_verify(
        self,
        batch: list[tuple[Request, int]],
        result: VerifyResult,
        resident_before: npt.NDArray[np.bool_] | None,
    ) -> None:
        """The books of a verify forward: the routing trace, the planner's
        routing prior, route-ahead stats, the predictor's observations."""
        out = result.output
        self.verify_forwards += 1
        self._record_trace(out.needed_flat, "verify")
        self.verify_kv_spans.append(
            tuple((o.start, grant) for o, (_, grant) in zip(result.outcomes, batch, strict=True))
        )
        self.prefetch.observe_routing(result.routed_union)
        shadow = self.predicts_in_shadow
        if self.config.route_ahead or shadow:
            predicted = np.zeros_like(out.routed)
            for i, (req, _) in enumerate(batch):
                ids = req.shadow_predicted if shadow else req.predicted
                if ids is not None and ids.size:
                    predicted[i].reshape(-1)[ids] = True
            named = predicted.any(axis=0)
            self.route_ahead_predicted_n += int(named.sum())
            self.route_ahead_hit_n += int((named & out.routed.any(axis=0)).sum())
            # the route-ahead stats count copies too: a shadow made none
            if self.route_stats is not None and not shadow:
                self.route_stats.update(predicted, out.routed, resident_before)
        if self.predictor is not None:
            for i, (req, _) in enumerate(batch):
                self.predictor.observe(req.request_id, out.routed[i])
        if self._token_recorder is not None:
            # the verified rows' tokens, in the forward's row order
            anchors = anchor_tensor([req for req, _ in batch], self.device)
            parts = []
            for i, (req, grant) in enumerate(batch):
                assert req.drafts is not None
                parts += [anchors[i : i + 1], req.drafts[: grant - 1].reshape(-1)]
            self._learn_token_routing(torch.cat(parts).cpu().numpy())
        if self.width is not None:  # verify width hook: the outcomes
            self.width.record(batch, result)

    def _learn_token_routing(self, tokens: npt.NDArray[np.int64]) -> None:
        """Hand the latest forward's per-row routing to the token learners."""
        assert self._token_recorder is not None
        topk = self._token_recorder.take()
        if topk is None or topk.shape[0] != tokens.size:
            return  # the forward did not run every layer over these rows
        for learner in self._token_learners:
            learner.observe_tokens(tokens, topk)

    def _commit_verified(self, result: VerifyResult, report: StepReport) -> None:
        """Commit the outcomes request by request, then hand the planner the
        routing of the requests that go on.

        An outcome whose acceptance raised, or whose commit raises, ends only
        its request. A ``BaseException`` (e.g. ``KeyboardInterrupt``) rolls
        the KV of every request not yet committed back to the step's start
        (so a later step verifies it again) and propagates."""
        now = self.clock()
        outcomes = result.outcomes
        i = 0
        try:
            for i in range(len(outcomes)):
                outcome = outcomes[i]
                req = outcome.request
                if req.state != RequestState.VERIFY:  # aborted by another request's callback
                    continue
                self._stage = "accept"
                try:
                    if outcome.error is not None:
                        raise outcome.error
                    got = self._commit_outcome(outcome, now)
                except Exception as exc:
                    self._fail([req], exc, report)
                    report.finished.append(req.request_id)
                    continue
                report.committed_tokens += got
                if req.state in DONE_STATES:
                    report.finished.append(req.request_id)
        except BaseException:
            for outcome in outcomes[i:]:
                rid = outcome.request.request_id
                if (
                    outcome.request.state == RequestState.VERIFY
                    and self.kv.length(rid) > outcome.start
                ):
                    self.kv.truncate(rid, outcome.start)
            raise
        report.verified = len(outcomes)
        # Nothing is planned when no request goes on.
        going_on = [i for i, o in enumerate(outcomes) if o.request.state == RequestState.DRAFT]
        routed = result.output.routed
        nxt = np.asarray(routed[going_on].any(axis=0), dtype=np.bool_) if going_on else None
        self._stage = "stream_plan"
        self.prefetch.after_verify(result.routed_union, nxt)

    def _commit_outcome(self, outcome: VerifyOutcome, now: float) -> int:
        """Apply one request's outcome: roll its KV back to the accepted
        length, keep the committed positions' features for the next draft,
        commit (stream) the tokens. Returns how many were committed."""
        req = outcome.request
        if outcome.forced:
            req.metrics.forced_rounds += 1
        else:
            req.metrics.model_rounds += 1
        # roll the target KV back to anchor + accepted drafts
        self.kv.truncate(req.request_id, outcome.kv_length)
        feats = outcome.features
        if feats is not None:
            prev = req.pending_context
            req.pending_context = feats if prev is None else torch.cat([prev, feats])
        req.drafts = req.draft_probs = None
        req.predicted = req.shadow_predicted = None
        req.anchor = outcome.tokens[-1]
        req.state = RequestState.DRAFT
        got = self._commit(req, outcome.tokens)
        req.metrics.acceptance_lengths.append(got)
        if self.horizon is not None and req.state == RequestState.DRAFT:
            self.horizon.observe(req.request_id, min(got, self.config.block_size))
        req.metrics.round_latencies_s.append(now - req.round_start_s)
        req.round_start_s = now
        return got

    # -------------------------------------------------------------- experts
    def _resident_mask(self) -> npt.NDArray[np.bool_] | None:
        if self.expert_cache is None:
            return None
        return np.asarray(self.expert_cache.resident_mask(), dtype=np.bool_)

    def _plan_host_ahead(self) -> None:
        """Before a verify: the experts the host is expected to compute.

        Expected tokens per predicted expert: each waiting request spreads its
        block's ``tokens x top_k`` routed rows evenly over the experts it is
        predicted to use in a layer; the requests' shares add up. The
        planner's split of the non-resident ones (link idle ahead of the
        verify) is :attr:`host_ahead`; the stream skips copying them. Only
        while forwards wait for misses (``config.host_ahead_min_exposed``,
        see :meth:`_misses_exposed`).

        With the service's ``ahead_from == "stream"`` the stream's own copies
        are split too (:mod:`pdflash.hybrid.service`, "Splitting the stream's
        copies"): the candidates include what the stream would copy for the
        coming forward (an expert only there expects the mean share of its
        layer's predicted experts, at least one token), and during the
        forward the stream's gate lookahead splits each next layer's copies
        through :meth:`_split_lookahead`.
        """
        assert self.host_service is not None and self.expert_cache is not None
        if not self.host_service.enabled:
            # switched off (PD controller): every miss is copied, and the
            # waiting share is not read (nothing to plan)
            self.host_ahead = None
            self.prefetch.set_host_planned(None)
            return
        if not self._misses_exposed():
            # NOTE: the link keeps up: route-ahead copies are hidden behind
            # compute, while a HOST expert is computed on the forward's
            # critical path. Plan nothing ahead (layers still split their
            # on-demand misses, which are on the critical path either way).
            self._gate_counts["closed"] += 1
            self.host_ahead = None
            self.prefetch.set_host_planned(None)
            return
        self._gate_counts["open"] += 1
        L, E = self.adapter.num_layers, self.adapter.num_experts
        expected = np.zeros(L * E, dtype=np.float64)
        predicted: list[npt.NDArray[np.int64]] = []
        for req in self.requests.live.values():
            if req.state != RequestState.VERIFY or req.predicted is None or not req.predicted.size:
                continue
            predicted.append(req.predicted)
            tokens = 1 + (0 if req.drafts is None else int(req.drafts.numel()))
            layers = req.predicted // E
            per_layer = np.bincount(layers, minlength=L).astype(np.float64)
            share = tokens * self.adapter.top_k / per_layer[layers]
            expected[req.predicted] += np.minimum(share, tokens)
        from_stream = self.host_service.ahead_from == "stream"
        fetch = self.prefetch.stream_fetch_if(predicted) if from_stream else None
        if fetch is not None:
            expected = _with_stream_candidates(expected.reshape(L, E), fetch).reshape(-1)
        owned = getattr(self.expert_cache, "owned", None)
        if owned is not None:
            # an expert-parallel rank's host computes only its own experts
            expected[~np.asarray(owned, dtype=np.bool_).reshape(-1)] = 0.0
        resident = np.asarray(self.expert_cache.resident_mask(), dtype=np.bool_)
        mask = self.host_service.plan_ahead(expected.reshape(L, E), resident)
        self.host_ahead = mask
        self.host_service.books.planned_ahead += int(mask.sum())
        self.prefetch.set_host_planned(mask, self._split_lookahead if fetch is not None else None)

    def _split_lookahead(
        self, layer: int, local_ids: npt.NDArray[np.int64], expected: npt.NDArray[np.float64]
    ) -> npt.NDArray[np.bool_]:
        """The stream's gate lookahead's copies of ``layer`` (experts with no
        slot, their expected tokens) through the host service's split: the
        mask of those the host is expected to compute (an expert-parallel
        rank's host computes only its own experts)."""
        assert self.host_service is not None
        ids = np.asarray(local_ids, dtype=np.int64)
        keep = np.ones(ids.size, dtype=np.bool_)
        owned = getattr(self.expert_cache, "owned", None)
        if owned is not None:
            keep = np.asarray(owned, dtype=np.bool_).reshape(self.adapter.num_layers, -1)[
                layer, ids
            ]
        out = np.zeros(ids.size, dtype=np.bool_)
        out[keep] = self.host_service.plan_lookahead(layer, ids[keep], expected[keep])
        return out

    def _misses_exposed(self) -> bool:
        """Did forwards wait for expert copies or host results for at least
        ``config.host_ahead_min_exposed`` of the time since the last call?
        True where that share is 0, before a measurement (a cold cache
        misses everything) or after the timer was reset."""
        gate = self.config.host_ahead_min_exposed
        if gate <= 0.0:
            return True
        # NOTE: the spans whose end events have completed only: a device
        # synchronize here would also wait for the prefetch copies in flight
        # (the issuer's streams), which PD without the host never waits for;
        # spans still running count at a later call
        waited = self.timer.stall_s_ready() + self.timer.host_wait_s_ready()
        now = time.perf_counter()
        last, self._wait_sample = self._wait_sample, (waited, now)
        if last is None or now <= last[1] or waited < last[0]:
            return True
        return (waited - last[0]) / (now - last[1]) >= gate

    def host_ahead_gate(self) -> dict[str, Any] | None:
        """The pre-verify host plan's gate, for a row: the setting
        (``min_exposed``, ``config.host_ahead_min_exposed``) and the verifies
        whose plan it let run (``open``) or skipped (``closed``) since the
        last :meth:`reset_stats` (a verify while the host service is
        switched off counts in neither). None without a host service."""
        if self.host_service is None:
            return None
        return {"min_exposed": self.config.host_ahead_min_exposed, **self._gate_counts}

    def byte_budget(self) -> int:
        """Missing expert bytes per step (``M``): the configured value, else
        half the expert cache (so a batch's copies never thrash the cache)."""
        return self.prefetch.byte_budget()


def _with_stream_candidates(
    expected: npt.NDArray[np.float64], fetch: npt.NDArray[np.bool_]
) -> npt.NDArray[np.float64]:
    """``expected`` tokens per expert ``(layers, experts)`` with the stream's
    fetch experts no prediction named added: each expects the mean share of
    its layer's predicted experts (at least one token; one where the layer
    has none)."""
    out: npt.NDArray[np.float64] = np.array(expected, dtype=np.float64)
    extra = fetch & (out <= 0)
    if not extra.any():
        return out
    named = out > 0
    count = named.sum(axis=1)
    mean = np.where(count > 0, out.sum(axis=1) / np.maximum(count, 1), 1.0)
    fill = np.maximum(1.0, mean)
    out[extra] = np.broadcast_to(fill[:, None], out.shape)[extra]
    return out


def holds_every_expert(adapter: MoEModelAdapter, cache: ExpertCacheView | None) -> bool:
    """Does ``cache`` have a slot for every expert of ``adapter`` (so that,
    filled, no forward can miss)?"""
    if cache is None:
        return False
    return int(cache.num_slots) >= adapter.num_layers * adapter.num_experts


def fills_full_cache(
    config: EngineConfig, adapter: MoEModelAdapter, cache: ExpertCacheView | None
) -> bool:
    """Does an engine built with ``config`` over ``cache`` fill it before the
    first request and run none of the parts that only serve a miss
    (``config.full_cache`` auto, not B3's ``all_resident``, and a slot for
    every expert)?"""
    return (
        config.full_cache == "auto"
        and not config.all_resident
        and holds_every_expert(adapter, cache)
    )


def _without_2d_scheduler(batcher: VerifyBatcher | None, token_budget: int) -> VerifyBatcher | None:
    """The batcher of a full cache whose configuration chose ``deficit_2d``:
    nothing can miss, so the 2-D deficit scheduler (whose byte term would be
    zero for every request) gives way to B3's FCFS under the token budget
    (None: the engine builds it); a :class:`DelegatingBatcher` (expert-parallel
    ranks) keeps delegating, to FCFS (or its inner batcher's own
    replacement). Raises ValueError for any other batcher that would still
    run the 2-D scheduler."""
    if batcher is None or (isinstance(batcher, DeficitBatcher) and batcher.name == "deficit_2d"):
        return None
    if isinstance(batcher, DelegatingBatcher) and batcher.inner.name == "deficit_2d":
        inner = _without_2d_scheduler(batcher.inner, token_budget) or FCFSBatcher(token_budget)
        batcher = batcher.with_inner(inner)
    if batcher.name == "deficit_2d":
        raise ValueError(
            f"every expert is resident (full_cache auto), but the batcher {type(batcher).__name__} "
            "still runs the 2-D deficit scheduler: pass none (B3's FCFS is used)"
        )
    return batcher


def _param_dtype(adapter: MoEModelAdapter) -> torch.dtype:
    dt = getattr(adapter, "dtype", None)
    if isinstance(dt, torch.dtype):
        return dt
    return torch.float32
