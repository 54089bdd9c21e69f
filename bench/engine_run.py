"""One benchmark run of the engine: the contract ``pdflash-bench`` builds on.

:func:`run_spec` builds everything a :class:`RunSpec` names (a synthetic or
real target checkpoint, a synthetic or real DFlash drafter, the H2D issuer,
the expert cache, the engine in the requested baseline configuration), runs
its workload (by default a burst: ``num_requests`` requests of ``prompt_len``
random prompt tokens, all queued at t=0, at most ``concurrency`` decoding at
once; or a serving workload: Poisson or closed-loop arrivals with length
ranges, ``max_running`` / ``token_budget`` limits and a byte budget derived
from the verify step, see :mod:`pdflash.bench.workload`) and returns a :class:`RunResult`: one JSON-ready row of docs/design.md §6 metrics
(unmeasured ones ``null`` with reasons; with the routing-trace figures:
``routed_expert_bytes`` and the Belady replay from the run's starting cache
contents and capacity), the routing trace and the starting cache contents.

Synthetic checkpoints (a target and its drafter) are written once under
``$PDFLASH_CACHE`` (default ``~/.cache/pdflash``) and reused while their key
(arch, preset, layers, dtype, seed, format, weights mode, generating device,
the writers' sources, the torch/transformers versions) is unchanged
(:func:`synthetic_paths`); by default
(``RunSpec.synthetic_weights="generated"``) only their config is written and
the loader draws the seeded tensors straight into the host store (the same
values as written files would hold). Within one process the loaded target
(its packed host experts) and drafter are reused across runs, each run
getting a fresh issuer and expert cache; the ``shared`` warm-up (the
default on CUDA) runs each shape's workload warm-up once per process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import hashlib
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

import numpy as np
import numpy.typing as npt
import torch

from pdflash.cache.expert_cache import quiesce
from pdflash.engine.acceptance import (
    AcceptanceModel,
    ForcedAcceptance,
    ModelAcceptance,
    default_mean_tau,
)
from pdflash.engine.attention import (
    SDPA_BACKENDS_ENV,
    canonical_sdpa_backends,
    sdpa_backends,
    sdpa_shapes_met,
)
from pdflash.engine.batching import (
    DeficitBatcher,
    DelegatingBatcher,
    ShadowComparison,
    VerifyBatcher,
)
from pdflash.engine.config import (
    BASELINES,
    CUDA_GRAPHS,
    DEFAULT_HOST_AHEAD_MIN_EXPOSED,
    DEFAULT_ROUTE_AHEAD_GATE,
    FULL_CACHE,
    HOST_CONTROLS,
    LOOKAHEAD_SCORE_SETTINGS,
    REST_BATCHINGS,
    ROUTE_AHEAD_GATES,
    ROUTE_AHEAD_HORIZONS,
    EngineConfig,
    check_host_ahead_min_exposed,
    check_lookahead_tail,
)
from pdflash.engine.drafter import (
    DFlashDrafter,
    load_drafter,
    synthetic_drafter_key,
    write_synthetic_drafter,
)
from pdflash.engine.engine import Engine, fills_full_cache
from pdflash.engine.fixed_step import FixedStepFeed, follow_step_time_fit
from pdflash.engine.pd_controller import PDController, route_ahead_gate_applies
from pdflash.engine.sampling import SamplingParams
from pdflash.hybrid.affinity import DEFAULT_HOST_AFFINITY
from pdflash.hybrid.cost import HostCostModel
from pdflash.hybrid.planner import DEFAULT_MAX_HOST_RATIO, DEFAULT_MAX_HOST_TOKENS
from pdflash.metrics import Metric, NotMeasured, metrics_to_json, ratio
from pdflash.protocols import Band
from pdflash.report.schema import CONTROLLER_WARMUPS, HOST_METRIC_FIELDS, MAX_WARM_BURSTS
from pdflash.serve.build import resolve_device

from .workload import WARMUP_CHOICES, ClosedLoop, LengthDist, Workload, open_loop

P = ParamSpec("P")
R = TypeVar("R")

#: bench arch name -> (model_type, synthetic preset)
ARCHS: dict[str, tuple[str, str]] = {
    "tiny": ("qwen3_moe", "tiny"),
    "tiny-qwen3_moe": ("qwen3_moe", "tiny"),
    "tiny-gpt_oss": ("gpt_oss", "tiny"),
    "tiny-mixtral": ("mixtral", "tiny"),
    "tiny-olmoe": ("olmoe", "tiny"),
    # CPU-sized shapes with the published expert counts / top-k (link-bound
    # under an emulated link, like the full shapes on a GPU)
    "small-gpt_oss": ("gpt_oss", "small"),
    "small-qwen3_moe": ("qwen3_moe", "small"),
    "gpt-oss-20b": ("gpt_oss", "gpt-oss-20b"),
    "qwen3-30b-a3b": ("qwen3_moe", "qwen3-30b-a3b"),
    "mixtral-8x7b": ("mixtral", "mixtral-8x7b"),
    "olmoe": ("olmoe", "olmoe-1b-7b"),
    "olmoe-1b-7b": ("olmoe", "olmoe-1b-7b"),
}


@dataclass
class RunSpec:
    arch: str
    baseline: str  # one of pdflash.labels.BASELINES (B0..B3, PD, PD+host, PD ablations)
    block_size: int = 16
    concurrency: int = 4
    cache_fraction: float = 0.2
    repeat: int = 0
    seed: int = 0
    weights: str = "synthetic"  # or a checkpoint path
    draft: str = "synthetic"
    device: str = "auto"
    num_requests: int | None = None  # default = concurrency
    prompt_len: int = 32
    max_new_tokens: int = 64
    slo_s: float | None = None
    emulated_link_gbps: float | None = None
    layers: int | None = None  # truncate full-size synthetic shapes
    # "model", "forced" or "trace"; "auto": model with a real drafter, else
    # the trace's when `trace` is set, else forced
    acceptance: str = "auto"
    mean_tau: float | None = None
    # PD's missing-byte budget M per step: explicit bytes, else
    # max(link_gbps_measured * step_target_s ("one step's worth of PCIe
    # time"), the bytes of every expert) -- see the NOTE in _run
    byte_budget: int | None = None
    step_target_s: float = 0.25
    dtype: str | None = None  # synthetic weights: None = float32 on CPU, bfloat16 on CUDA
    # expert-cache eviction: "auto" (layer_cyclic, the best non-predictive
    # policy for a layer-cyclic forward, for every offloaded baseline), or one
    # of "lru", "lfu", "route_ahead", "layer_cyclic" (ablation)
    eviction: str = "auto"
    # serving workload: "burst" sends every request at t = 0 (a fixed
    # concurrency); "poisson" sends num_requests at rate_per_s (open loop);
    # "closed" keeps `users` clients, each sending its next request think_s
    # (exponential mean) after its last finished (see pdflash.bench.workload)
    arrivals: str = "burst"
    rate_per_s: float | None = None
    users: int | None = None
    think_s: float = 0.0
    # request lengths uniform in [prompt_len, prompt_len_max] and
    # [max_new_tokens, max_new_tokens_max]; fixed where the max is None
    prompt_len_max: int | None = None
    max_new_tokens_max: int | None = None
    # engine limits: default max_running = concurrency and token_budget =
    # concurrency x block, so every running request fits one verify step;
    # set max_running above token_budget / block for a scheduler that decides
    max_running: int | None = None
    token_budget: int | None = None
    # PD's M: "floor" = max(link x step_target_s, every expert's bytes);
    # "verify" = link x the mean verify-forward time of a warm-up with
    # max_running requests (the bytes the link moves while a verify computes)
    byte_budget_from: str = "floor"
    # PD's marginal rule (docs/scheduler.md rule 4.4: M soft against shared
    # experts): "verify" = on, F = link x the same verify calibration's
    # compute time, wherever the run calibrates one (byte_budget_from
    # "verify", or an explicit byte_budget), then link x the fixed time of
    # the adaptive width's online step-time fit once that is identified
    # (pdflash.engine.fixed_step; one rank only; under a full or fixed:K
    # width F stays the calibration's); "off" = M hard (the rule before)
    marginal_rule: str = "verify"
    # hybrid miss service (pdflash.hybrid): "off" or "auto" (PD+host is
    # always "auto"); the host pool's workers and torch intra-op threads
    # (None: one worker, all cores but two on CUDA / torch's setting on CPU)
    host_experts: str = "off"
    host_workers: int | None = None
    host_threads: int | None = None
    host_max_ratio: float = DEFAULT_MAX_HOST_RATIO  # CostModelPlanner.max_host_ratio
    # CostModelPlanner.max_host_tokens (0: no cap)
    host_max_tokens: int = DEFAULT_MAX_HOST_TOKENS
    # how the host holds the experts it computes (pdflash.hybrid.kernels):
    # "auto" times the formats and keeps the fastest that fits the budget
    host_format: str = "auto"
    # HostExpertService.critical_path: the planner judges the forward's
    # critical path instead of the link's makespan
    host_critical_path: bool = False
    # the planner may host experts whose copy is still queued (giving the
    # copy back): HostExpertService.host_queued
    host_queued: bool = False
    # the host calibration measures a fixed cost per HOST job beside the
    # seconds per expert (pdflash.hybrid.cost.calibrate_host's job_term;
    # off by default until a GPU A/B)
    host_job_term: bool = False
    # how HOST outputs reach the device stream (pdflash.hybrid.handoff):
    # "thread" (the forward's thread waits for the host) or "stream" (a
    # device-side wait; falls back to "thread" with a recorded reason)
    host_handoff: str = "thread"
    # where the host pool's threads and the engine's run (pdflash.hybrid.affinity):
    # "auto" (default: separate core sets, on CUDA) or "off" (no affinity call)
    host_affinity: str = DEFAULT_HOST_AFFINITY
    # how the host planner's pre-verify (route-ahead) plan treats a predicted
    # expert (pdflash.hybrid.planner, "The ahead plan"): "certain" (as routed)
    # or "weighted" (routed with the run's measured probability)
    host_ahead: str = "certain"
    # which copies the host's pre-verify plan splits (pdflash.hybrid.service,
    # "Splitting the stream's copies"): "predicted" (the route-ahead
    # prediction only) or "stream" (also the streaming prefetcher's own copies)
    host_ahead_from: str = "predicted"
    # the pre-verify host plan runs only where forwards waited for misses at
    # least this share of the time since the previous plan (0: before every
    # verify; EngineConfig.host_ahead_min_exposed)
    host_ahead_min_exposed: float = DEFAULT_HOST_AHEAD_MIN_EXPOSED
    # who decides whether the host part runs (EngineConfig.host_control):
    # "controller" (PD's controller: its host gate and must-earn probes) or
    # "always" (on in every step, never probed nor gated); a run without a
    # host service runs "controller" (nothing to run; the report keys it so)
    host_control: str = "controller"
    # synthetic weights: write the experts in this checkpoint format (None:
    # the dtype above; "mxfp4": gpt-oss MXFP4 blocks/scales, as released)
    synthetic_format: str | None = None
    # synthetic weights: "generated" (config.json only; the loader draws the
    # same seeded tensors straight into the host store: no checkpoint write
    # and read-back) or "files" (safetensors shards written, then loaded
    # through the real checkpoint reader); the values are bit-identical
    synthetic_weights: str = "generated"
    # how the experts are stored in host memory, over the link and in the
    # slab: None as the checkpoint stores them (MXFP4 stays MXFP4), "dense"
    # in the compute dtype (dequantized at pack time), "fp8": e4m3 with
    # per-output-channel scales (dense checkpoints; lossy, never the default)
    expert_dtype: str | None = None
    # time each verify's attention / router / experts per layer (CUDA events
    # on CUDA): the verify_breakdown row field; a few events per layer
    breakdown: bool = False
    # CUDA graphs for the target's verify forward (pdflash.engine.graphs):
    # "auto" replays recorded graphs per shape bucket where every expert is
    # resident (B3) on CUDA, eager elsewhere; "off" (default) always eager
    cuda_graphs: str = "off"
    # before the clock: "short" (one 2-token request: kernels, allocator,
    # first copies), "workload" (the run's own shape: as many requests as it
    # runs at once, its prompt and output lengths, random ids, so every batch
    # size and key length it will meet is set up once), "shared" (the
    # workload warm-up once per process for every run that differs only in
    # repeat and request rate, on a throwaway cache and issuer, then a short
    # one per run on the run's own fresh cache), "auto" (shared on CUDA,
    # whose per-shape first-use costs dominate short runs; short on CPU)
    warmup: str = "auto"
    # real text and learned behaviour (issue 14; see pdflash.bench.realtext
    # and pdflash.engine.replay): prompts from "heldout[:ROLE]", a trace .npz
    # or a text file instead of random ids; sampling temperature of every
    # request (0 = greedy); experts padded to a published size ("gpt-oss-20b",
    # "qwen3-30b-a3b", ... or a byte count); a proxy trace whose routing
    # (routing_source="trace") and/or acceptance (acceptance="trace") the run
    # replays
    prompts: str | None = None
    temperature: float = 0.0
    expert_bytes_as: str | None = None
    trace: str | None = None
    routing_source: str = "model"
    # what PD predicts before a verify (pdflash.engine.predict.ROUTE_AHEAD_SOURCES)
    route_ahead_source: str = "union"
    # what the union's approximate router reads
    # (pdflash.engine.predict.ROUTE_AHEAD_PROXIES: auto, drafter, embed)
    route_ahead_proxy: str = "auto"
    # expert-parallel ranks (issue 18, bench/distributed_run.py): experts
    # partitioned over this many GPUs (local processes), by this placement
    gpus: int = 1
    placement: str = "round_robin"
    # drafts each verify checks (pdflash.engine.verify_width): "auto" (the
    # label's preset: adaptive for PD, PD+host and PD's ablations but
    # PD-full-width, full for the rest), "full", "fixed:K" or "adaptive" for
    # any label (at a full cache an adaptive width runs full)
    verify_width: str = "auto"
    # the process-wide compressed-GEMM mode (pdflash.models.compressed_gemm,
    # PDFLASH_COMPRESSED_GEMM) the run must run in: None runs in whichever the
    # process has; the matrix names the mode it planned under, and a spec
    # naming another mode is refused (a resumed matrix never mixes modes)
    compressed_gemm: str | None = None
    # recorded all-resident layer calls (pdflash.models.resident_graphs): the
    # process-wide switch set to this for the run (warm-ups included) and
    # put back after; "on" replays a recording of an all-resident layer's
    # device work where it can, "off" (default) always runs it eagerly
    resident_graphs: str = "off"
    # a cache with a slot for every expert (pdflash.engine.config.EngineConfig.full_cache):
    # "auto" fills it before the clock (as B3's) and runs none of the parts
    # that only serve a miss; "off" runs the label as configured, the cache
    # filling on demand (the A/B arm of what that machinery costs)
    full_cache: str = "auto"
    # experts PD's route-ahead stream copies beyond the next layer's set
    # (pdflash.engine.config.EngineConfig.stream_ahead; a run without the
    # stream ignores it)
    stream_ahead: int = 2
    # how the stream scores a gate-lookahead expert against its threshold
    # (pdflash.engine.config.EngineConfig.lookahead_score: "prob", "share" or
    # "every"; a run without the stream ignores it)
    lookahead_score: str = "prob"
    # what the stream does with a lookahead expert below that threshold
    # (pdflash.engine.config.EngineConfig.lookahead_tail: "skip" or
    # "background"; a run without the stream ignores it)
    lookahead_tail: str = "skip"
    # which rows of a drafted block route-ahead predicts for
    # (pdflash.engine.config.EngineConfig.route_ahead_horizon): "acceptance"
    # (the acceptance horizon's first rows) or "verified" (every row the
    # verify routes); a run without route-ahead ignores it
    route_ahead_horizon: str = "acceptance"
    # how PD's controller gates route-ahead
    # (pdflash.engine.config.EngineConfig.route_ahead_gate: "precision_cost",
    # "precision" or "off"); a run without the controller's route-ahead, or
    # with a host service, ignores it
    route_ahead_gate: str = DEFAULT_ROUTE_AHEAD_GATE
    # whether PD's controller reads a gated route-ahead in shadow (its
    # predictions counted, no copy made) before a must-earn probe of it
    # (pdflash.engine.config.EngineConfig.route_ahead_shadow_check; opt-in);
    # a run where the gate does not act ignores it
    route_ahead_shadow_check: bool = False
    # how a step is batched while PD's controller rests
    # (pdflash.engine.config.EngineConfig.rest_batching: "first_come" or
    # "scheduler"); a run without a resting controller ignores it
    rest_batching: str = "first_come"
    # "first_round": after the warm-up, workload bursts outside the clock
    # until PD's controller has ended its first round of probes (the state a
    # server's engine is in after its first steps); "off": the warm-up alone.
    # Labels without the controller run "off" (pdflash.report.schema)
    controller_warmup: str = "off"
    # workload bursts after the warm-up, outside the clock, for any label
    # (before controller_warmup's): the warm-up a settled controller arm got,
    # given to an arm without the controller so an A/B of the two is fair
    warm_bursts: int = 0
    # the SDPA backends attention may use during this run (the syntax of
    # PDFLASH_SDPA_BACKENDS, "+" allowed for ","); None: the process's
    # setting. Rows record what ran (sdpa_backends)
    sdpa_backends: str | None = None

    @property
    def width_setting(self) -> str:
        """The verify width this run uses (``auto`` resolved for its label)."""
        if self.verify_width == "auto":
            return EngineConfig.preset(self.baseline).verify_width
        return "full" if self.baseline == "B0" else self.verify_width

    def resolved_eviction(self) -> str:
        """The eviction policy the run uses: ``auto`` is ``layer_cyclic`` for
        every baseline."""
        # NOTE: Belady at layer granularity for every baseline: the forward
        # visits layers cyclically, which LRU thrashes; a fair comparison gives
        # the baselines the same policy PD uses
        return "layer_cyclic" if self.eviction == "auto" else self.eviction

    def engine_config(self) -> EngineConfig:
        """The engine configuration this run builds from its label's preset
        and its settings (before the run's measured byte budget and, on
        several GPUs, the ranks' replication)."""
        return EngineConfig.preset(
            self.baseline,
            block_size=self.block_size,
            max_running=self.max_running or self.concurrency,
            token_budget=self.token_budget or self.concurrency * self.block_size,
            seed=self.seed,
            host_experts=self.host_mode,
            host_ahead_min_exposed=self.host_ahead_min_exposed,
            host_control=self.host_control if self.host_mode != "off" else "controller",
            cuda_graphs=self.cuda_graphs,
            verify_width=self.width_setting,
            full_cache=self.full_cache,
            stream_ahead=self.stream_ahead,
            lookahead_score=self.lookahead_score,
            lookahead_tail=self.lookahead_tail,
            route_ahead_horizon=self.route_ahead_horizon,
            route_ahead_gate=self.route_ahead_gate,
            route_ahead_shadow_check=self.route_ahead_shadow_check,
            rest_batching=self.rest_batching,
        )

    @property
    def host_mode(self) -> str:
        """The hybrid mode this run uses (B3 keeps every expert resident)."""
        if self.baseline == "B3":
            return "off"
        return "auto" if self.baseline == "PD+host" else self.host_experts

    def _check_one_of(self, name: str, choices: Collection[str]) -> None:
        """The field ``name`` holds one of ``choices``."""
        value = getattr(self, name)
        if value not in choices:
            raise ValueError(f"{name} must be one of {choices}, got {value!r}")

    def _check_at_least_one(self, *names: str) -> None:
        """Each of ``names`` is None (the default) or >= 1."""
        for name in names:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")

    def validate(self) -> None:
        self._check_one_of("baseline", BASELINES)
        if self.weights == "synthetic" and self.arch not in ARCHS:
            raise ValueError(f"unknown arch {self.arch!r}; choose one of {sorted(ARCHS)}")
        if self.acceptance not in ("auto", "model", "forced", "trace"):
            raise ValueError(
                f"acceptance must be auto, model, forced or trace, got {self.acceptance!r}"
            )
        if self.routing_source not in ("model", "trace"):
            raise ValueError(f"routing_source must be model or trace, got {self.routing_source!r}")
        from pdflash.engine.predict import ROUTE_AHEAD_PROXIES, ROUTE_AHEAD_SOURCES

        self._check_one_of("route_ahead_source", ROUTE_AHEAD_SOURCES)
        self._check_one_of("route_ahead_proxy", ROUTE_AHEAD_PROXIES)
        if (self.acceptance == "trace" or self.routing_source == "trace") and not self.trace:
            raise ValueError("acceptance or routing_source 'trace' needs a trace file (trace=)")
        if self.trace is not None and not Path(self.trace).is_file():
            raise ValueError(f"trace {self.trace!r} does not exist")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature!r}")
        if self.expert_bytes_as is not None:
            from .realtext import published_expert_nbytes

            published_expert_nbytes(self.expert_bytes_as)  # raises on a bad value
        if not 0.0 < self.cache_fraction <= 1.0:
            raise ValueError(f"cache_fraction must be in (0, 1], got {self.cache_fraction}")
        for name in ("block_size", "concurrency", "prompt_len", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        self._check_at_least_one("num_requests")
        if self.eviction not in ("auto", "lru", "lfu", "route_ahead", "layer_cyclic"):
            raise ValueError(
                f"eviction must be auto, lru, lfu, route_ahead or layer_cyclic, got {self.eviction!r}"
            )
        if self.arrivals not in ("burst", "poisson", "closed"):
            raise ValueError(f"arrivals must be burst, poisson or closed, got {self.arrivals!r}")
        if self.arrivals == "poisson" and not (
            self.rate_per_s is not None and math.isfinite(self.rate_per_s) and self.rate_per_s > 0
        ):
            raise ValueError(f"poisson arrivals need rate_per_s > 0, got {self.rate_per_s!r}")
        if self.arrivals == "closed" and (self.users is None or self.users < 1):
            raise ValueError(f"closed arrivals need users >= 1, got {self.users!r}")
        if not (math.isfinite(self.think_s) and self.think_s >= 0):
            raise ValueError(f"think_s must be finite and >= 0, got {self.think_s!r}")
        for name, low in (
            ("prompt_len_max", self.prompt_len),
            ("max_new_tokens_max", self.max_new_tokens),
        ):
            value = getattr(self, name)
            if value is not None and value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        self._check_at_least_one("max_running", "token_budget")
        if self.byte_budget_from not in ("floor", "verify"):
            raise ValueError(
                f"byte_budget_from must be floor or verify, got {self.byte_budget_from!r}"
            )
        if self.marginal_rule not in ("off", "verify"):
            raise ValueError(f"marginal_rule must be off or verify, got {self.marginal_rule!r}")
        if self.host_experts not in ("off", "auto"):
            raise ValueError(f"host_experts must be off or auto, got {self.host_experts!r}")
        if not self.host_max_ratio > 0:
            raise ValueError(f"host_max_ratio must be positive, got {self.host_max_ratio}")
        if self.host_max_tokens < 0:
            raise ValueError(
                f"host_max_tokens must be >= 0 (0: no cap), got {self.host_max_tokens}"
            )
        from pdflash.hybrid import (
            HANDOFF_CHOICES,
            HOST_AFFINITY_CHOICES,
            HOST_AHEAD_CHOICES,
            HOST_AHEAD_FROM_CHOICES,
            HOST_FORMAT_CHOICES,
        )

        self._check_one_of("host_handoff", HANDOFF_CHOICES)
        self._check_one_of("warmup", WARMUP_CHOICES)
        self._check_one_of("controller_warmup", CONTROLLER_WARMUPS)
        self._check_one_of("route_ahead_horizon", ROUTE_AHEAD_HORIZONS)
        if isinstance(self.warm_bursts, bool) or not (
            isinstance(self.warm_bursts, int) and 0 <= self.warm_bursts <= MAX_WARM_BURSTS
        ):
            raise ValueError(
                f"warm_bursts must be an int in [0, {MAX_WARM_BURSTS}], got {self.warm_bursts!r}"
            )
        if self.sdpa_backends is not None:
            if not isinstance(self.sdpa_backends, str):
                raise ValueError(f"sdpa_backends must be a string, got {self.sdpa_backends!r}")
            canonical_sdpa_backends(self.sdpa_backends)
        self._check_one_of("host_format", HOST_FORMAT_CHOICES)
        self._check_one_of("host_affinity", HOST_AFFINITY_CHOICES)
        self._check_one_of("host_ahead", HOST_AHEAD_CHOICES)
        self._check_one_of("host_ahead_from", HOST_AHEAD_FROM_CHOICES)
        self._check_one_of("host_control", HOST_CONTROLS)
        self._check_one_of("route_ahead_gate", ROUTE_AHEAD_GATES)
        if not isinstance(self.route_ahead_shadow_check, bool):
            raise ValueError(
                f"route_ahead_shadow_check must be a bool, got {self.route_ahead_shadow_check!r}"
            )
        self._check_one_of("rest_batching", REST_BATCHINGS)
        self._check_one_of("lookahead_score", LOOKAHEAD_SCORE_SETTINGS)
        check_lookahead_tail(self.lookahead_tail, self.lookahead_score, self.host_mode)
        check_host_ahead_min_exposed(self.host_ahead_min_exposed)
        if isinstance(self.stream_ahead, bool) or not (
            isinstance(self.stream_ahead, int) and self.stream_ahead >= 0
        ):
            raise ValueError(f"stream_ahead must be an int >= 0, got {self.stream_ahead!r}")
        self._check_at_least_one("host_workers", "host_threads")
        if self.dtype is not None and self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.synthetic_format not in (None, "mxfp4"):
            raise ValueError(
                f"synthetic_format must be None or mxfp4, got {self.synthetic_format!r}"
            )
        if self.synthetic_weights not in ("generated", "files"):
            raise ValueError(
                f"synthetic_weights must be generated or files, got {self.synthetic_weights!r}"
            )
        if self.synthetic_format == "mxfp4" and ARCHS.get(self.arch, ("",))[0] != "gpt_oss":
            raise ValueError(f"synthetic_format mxfp4 is for gpt-oss, not {self.arch!r}")
        self._check_one_of("cuda_graphs", CUDA_GRAPHS)
        if self.verify_width != "auto":
            from pdflash.engine.verify_width import parse_width

            parse_width(self.verify_width, self.block_size)  # raises on a bad value
        if self.compressed_gemm is not None:
            from pdflash.models.compressed_gemm import compressed_gemm_mode

            mode = compressed_gemm_mode()
            if self.compressed_gemm != mode:
                raise ValueError(
                    f"compressed_gemm {self.compressed_gemm!r}: this process runs compressed "
                    f"experts in {mode!r} (PDFLASH_COMPRESSED_GEMM); run the spec in a process "
                    "of its mode"
                )
        from pdflash.models.resident_graphs import RESIDENT_GRAPH_MODES

        self._check_one_of("resident_graphs", RESIDENT_GRAPH_MODES)
        self._check_one_of("full_cache", FULL_CACHE)
        if self.expert_dtype not in (None, "dense", "fp8"):
            raise ValueError(f"expert_dtype must be None, dense or fp8, got {self.expert_dtype!r}")
        from .distributed_run import check_spec

        check_spec(self)
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")


@dataclass
class RunResult:
    row: dict[str, Any]
    routing_trace: list[npt.NDArray[np.int64]]  # flat ids needed per forward-layer, in order
    cache_slots: int
    expert_nbytes: int
    trace_kinds: list[str] = field(default_factory=list)  # "prefill" | "verify" per entry
    requests: list[dict[str, Any]] = field(default_factory=list)
    # flat ids resident in the expert cache when the clock started (after the
    # warm-up, copies settled): where a Belady replay of the trace must start
    initial_resident: npt.NDArray[np.int64] | None = None


# ----------------------------------------------------------------------------
# building blocks
# ----------------------------------------------------------------------------


class SetupClock:
    """Seconds a run spent before its clock started, by phase (the row's
    ``setup_s``). A phase that ran more than once (the shared warm-up's pass
    and the measured run's own) adds up; a phase served from the process's
    caches (a target or drafter loaded by an earlier run) is timed too, as
    the lookup it was. ``parts`` records a phase's own split under
    ``<phase>.<part>`` (the shared warm-up's pass: its own phases under
    ``shared_warmup.<phase>``)."""

    def __init__(self) -> None:
        self._s: dict[str, float] = {}
        self._t0 = time.perf_counter()
        self._before_clock: float | None = None

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._s[name] = self._s.get(name, 0.0) + time.perf_counter() - t0

    def parts(self, phase: str, parts: dict[str, float]) -> None:
        for name, seconds in parts.items():
            key = f"{phase}.{name}"
            self._s[key] = self._s.get(key, 0.0) + float(seconds)

    def clock_started(self) -> None:
        """Mark the measured run's start: the end of the setup."""
        self._before_clock = time.perf_counter() - self._t0

    def row(self) -> dict[str, float]:
        """The phases, ``before_clock`` (from the start of :func:`run_spec`
        to the measured run's start) and ``other`` (its part no phase
        names: prompts, config, the row's bookkeeping)."""
        out = dict(self._s)
        if self._before_clock is not None:
            named = sum(v for k, v in self._s.items() if "." not in k)
            out["before_clock"] = self._before_clock
            out["other"] = self._before_clock - named
        return out


def cache_root() -> Path:
    return Path(os.environ.get("PDFLASH_CACHE", Path.home() / ".cache" / "pdflash"))


def synthetic_paths(spec: RunSpec, device: torch.device) -> tuple[Path, Path, torch.dtype]:
    """Write (once) and return the synthetic target and drafter directories.

    Both live in one cached directory (``target/`` and ``drafter/``, see
    :func:`pdflash.models.synthetic.cached_directory`) keyed by the target's
    key (its writer's arguments, the generating device, the writer's source,
    the torch/transformers versions) and the drafter's (its writer's
    arguments and source): the drafter's config is derived from the
    target's, so they are written and reused together."""
    from pdflash.models import write_synthetic_checkpoint
    from pdflash.models.synthetic import (
        cached_directory,
        synthetic_cache_key,
        synthetic_cache_name,
    )

    arch, preset = ARCHS[spec.arch]
    if spec.dtype is not None:
        dtype = getattr(torch, spec.dtype)
    else:
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    target_args: dict[str, Any] = dict(
        num_layers=spec.layers,
        dtype=dtype,
        seed=spec.seed,
        device="cuda" if device.type == "cuda" else "cpu",
        expert_format=spec.synthetic_format,
        weights=spec.synthetic_weights,
    )
    drafter_preset = "tiny" if preset == "tiny" else "full"
    drafter_seed = spec.seed + 1
    key = {
        "target": synthetic_cache_key(arch, preset, **target_args),
        "drafter": synthetic_drafter_key(drafter_preset, seed=drafter_seed, dtype=dtype),
    }

    def write(root: Path) -> None:
        target = write_synthetic_checkpoint(root / "target", arch, preset, **target_args)
        cfg = json.loads((target / "config.json").read_text())
        write_synthetic_drafter(
            root / "drafter", cfg, drafter_preset, seed=drafter_seed, dtype=dtype
        )

    name = synthetic_cache_name(key["target"])
    root, _reused = cached_directory(cache_root() / "synthetic", name, key, write)
    return root / "target", root / "drafter", dtype


def synthetic_drafter_for(target: Path, seed: int, dtype: torch.dtype) -> Path:
    """Write (once) and return a synthetic ``full`` drafter (drawn with
    ``seed``) for a real target checkpoint, keyed by the target's config and the drafter's own key
    (:func:`~pdflash.engine.drafter.synthetic_drafter_key`)."""
    from pdflash.models.synthetic import cached_directory

    config_text = (target / "config.json").read_text()
    key = {
        "target_config": hashlib.sha256(config_text.encode()).hexdigest(),
        "drafter": synthetic_drafter_key("full", seed=seed, dtype=dtype),
    }

    def write(root: Path) -> None:
        write_synthetic_drafter(root, json.loads(config_text), "full", seed=seed, dtype=dtype)

    name = f"{target.name}-drafter-s{seed}-{str(dtype).removeprefix('torch.')}"
    path, _reused = cached_directory(cache_root() / "synthetic-drafters", name, key, write)
    return path


_TARGETS: dict[tuple[str, ...], Any] = {}


def load_target(
    path: Path,
    device: torch.device,
    dtype: torch.dtype | None,
    expert_dtype: str | None = None,
    expert_nbytes: int | None = None,
    owned: tuple[Any, Callable[[int, int], Any]] | None = None,
) -> Any:
    """The adapter for a checkpoint, reused by consecutive runs on the same
    checkpoint (packing experts into pinned host memory is the expensive
    part). NOTE: only the most recent target is kept, so a matrix over
    several full-size architectures never holds two sets of host experts.
    ``owned``: ``(key, owned_experts)``: an expert-parallel rank packs only
    the experts ``owned_experts`` gives (``key`` names that share)."""
    from pdflash.models import load_adapter

    key: tuple[str, ...] = (
        str(path.resolve()),
        str(device),
        str(dtype),
        str(expert_dtype),
        str(expert_nbytes),
    )
    if owned is not None:
        key += (repr(owned[0]),)
    if key not in _TARGETS:
        release_targets()
        extra: dict[str, Any] = {} if expert_nbytes is None else {"expert_nbytes": expert_nbytes}
        if owned is not None:
            extra["owned_experts"] = owned[1]
        _TARGETS[key] = load_adapter(
            path, device=device, dtype=dtype, expert_dtype=expert_dtype, **extra
        )
        if device.type == "cuda":
            # generated weights are drawn on the GPU: hand the drawing's
            # transient blocks back before the runs allocate their slabs
            torch.cuda.empty_cache()
    return _TARGETS[key]


_DRAFTERS: dict[tuple[str, ...], DFlashDrafter] = {}


def _load_drafter(path: Path, device: torch.device, dtype: torch.dtype) -> DFlashDrafter:
    """The drafter of a checkpoint, reused by consecutive runs (its weights
    are read-only during a run: the draft KV cache is the engine's). Only
    the most recent one is kept, like the target."""
    key = (str(path.resolve()), str(device), str(dtype))
    if key not in _DRAFTERS:
        _DRAFTERS.clear()
        _DRAFTERS[key] = load_drafter(path, device=device, dtype=dtype)
    return _DRAFTERS[key]


def release_targets() -> None:
    """Drop the cached target and drafter (host experts, device weights,
    the hybrid service's prepared host weights and their kernel's threads)
    and the shared warm-ups made with them."""
    from pdflash.hybrid import release_host_weights

    for adapter in _TARGETS.values():
        release_host_weights(adapter.store)
    _TARGETS.clear()
    _DRAFTERS.clear()
    _SHARED_WARMUPS.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _percentile(values: list[float], q: float, what: str) -> Metric:
    if not values:
        return NotMeasured(f"no {what} observed")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def _acceptance_for(spec: RunSpec, arch_name: str, synthetic_draft: bool) -> AcceptanceModel:
    mode = spec.acceptance
    if spec.baseline == "B0":
        return ModelAcceptance()  # autoregressive: nothing is drafted, nothing to force
    if mode == "auto":
        # NOTE: a synthetic (random) drafter's guesses are meaningless: a
        # trace's learned acceptance replaces them when the run has one, else
        # forced acceptance at the published mean makes a realistic workload.
        mode = ("trace" if spec.trace else "forced") if synthetic_draft else "model"
    if mode == "model":
        return ModelAcceptance()
    if mode == "trace":
        from pdflash.engine.replay import TraceAcceptance, load_replay_trace

        assert spec.trace is not None
        return TraceAcceptance(load_replay_trace(spec.trace), spec.trace)
    tau, source = default_mean_tau(arch_name)
    if spec.mean_tau is not None:
        tau, source = spec.mean_tau, "configured (RunSpec.mean_tau)"
    tau = min(tau, float(spec.block_size))
    return ForcedAcceptance(
        mean_tau=tau, block_size=spec.block_size, seed=spec.seed + 17, tau_source=source
    )


def _expert_bytes_source(value: str) -> str:
    from .realtext import published_expert_nbytes

    return published_expert_nbytes(value)[1]


def _delta(after: dict[str, Any], before: dict[str, Any], key: str) -> float:
    return float(after.get(key, 0) or 0) - float(before.get(key, 0) or 0)


def _issuer_totals(stats: dict[str, Any]) -> dict[str, float]:
    bands = stats.get("bands", {})
    return {
        "link_busy_s": float(stats.get("link_busy_s", 0.0)),
        "bytes": float(sum(b.get("bytes", 0) for b in bands.values())),
        "blocked_wait_s": float(sum(b.get("blocked_wait_s", 0.0) for b in bands.values())),
    }


# ----------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------


def run_spec(spec: RunSpec, progress: Callable[[int, int], None] | None = None) -> RunResult:
    """Run one (arch, baseline, block, concurrency, repeat) point; see the module doc."""
    with _sdpa_backends_set(spec.sdpa_backends):
        return _run_spec(spec, progress)


@contextlib.contextmanager
def _sdpa_backends_set(value: str | None) -> Iterator[None]:
    """``PDFLASH_SDPA_BACKENDS`` set to ``value`` for the run (and the rank
    processes it starts), then restored; None leaves the process's setting."""
    if value is None:
        yield
        return
    before = os.environ.get(SDPA_BACKENDS_ENV)
    os.environ[SDPA_BACKENDS_ENV] = canonical_sdpa_backends(value)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(SDPA_BACKENDS_ENV, None)
        else:
            os.environ[SDPA_BACKENDS_ENV] = before


def _run_spec(spec: RunSpec, progress: Callable[[int, int], None] | None) -> RunResult:
    from pdflash.distributed import current_group
    from pdflash.h2d import H2DIssuer

    spec.validate()
    group = current_group() if spec.gpus > 1 else None
    if spec.gpus > 1 and group is None:
        from .distributed_run import run_ranks

        return run_ranks(spec, progress)
    device = resolve_device(spec.device) if group is None else group.device
    synthetic_weights = spec.weights == "synthetic"
    synthetic_draft = spec.draft == "synthetic"
    setup = SetupClock()
    if synthetic_weights:
        with setup.phase("synthetic_checkpoint"):
            target_path, synth_draft_path, dtype = synthetic_paths(spec, device)
    else:
        target_path = Path(spec.weights)
        synth_draft_path = None
        dtype = None  # the checkpoint's own
    padded_nbytes = None
    if spec.expert_bytes_as is not None:
        from .realtext import published_expert_nbytes

        padded_nbytes = published_expert_nbytes(spec.expert_bytes_as)[0]
    owned = None
    if group is not None:
        from .distributed_run import rank_owned_experts

        owned = rank_owned_experts(spec, group)
    with setup.phase("target_load"):
        adapter = load_target(target_path, device, dtype, spec.expert_dtype, padded_nbytes, owned)
    model_dtype = adapter.dtype
    drafter: DFlashDrafter | None = None
    with setup.phase("drafter_load"):
        if spec.baseline != "B0":
            if synthetic_draft:
                if synth_draft_path is None:
                    synth_draft_path = synthetic_drafter_for(
                        target_path, spec.seed + 1, model_dtype
                    )
                drafter = _load_drafter(synth_draft_path, device, model_dtype)
            else:
                drafter = _load_drafter(Path(spec.draft), device, model_dtype)

    def new_issuer() -> Any:
        return H2DIssuer(
            backend="cuda" if device.type == "cuda" else "host",
            emulated_link_gbps=spec.emulated_link_gbps if device.type != "cuda" else None,
        )

    mode = warmup_mode(spec, device)
    shared: dict[str, Any] | None = None
    if mode == "shared":
        with setup.phase("shared_warmup"):
            shared = _shared_warm_up(
                spec, device, adapter, drafter, new_issuer, synthetic_weights, synthetic_draft
            )
        # the pass's own phases (its host weights' format selection and
        # preparation among them) as shared_warmup.<phase>
        setup.parts("shared_warmup", shared.pop("setup_s", {}))
    with setup.phase("issuer"):
        issuer = new_issuer()
    try:
        result = _run(
            spec,
            device,
            adapter,
            drafter,
            issuer,
            synthetic_weights,
            synthetic_draft,
            progress,
            setup=setup,
        )
    finally:
        issuer.close()
        # the run's engine lives in reference cycles: freed here (its graphs,
        # cache slab, pinned buffers), not by a collection that would fall in
        # the next run's clock or in one of its graph captures
        gc.collect()
    assert result is not None
    result.row["setup_s"] = setup.row()
    # how warm the process was: a first-use cost shows as a trend over this
    result.row["process_runs_before"] = _PROCESS_RUNS["measured"]
    if shared is not None:
        result.row["warmup"]["shared"] = shared
    _PROCESS_RUNS["measured"] += 1
    return result


#: measured runs this process has completed (rows say how many ran before
#: theirs: a first-use cost shows up as a trend over this count)
_PROCESS_RUNS: dict[str, int] = {"measured": 0}

#: shared warm-up key -> what the process's one workload warm-up for it did
_SHARED_WARMUPS: dict[tuple[Any, ...], dict[str, Any]] = {}

#: RunSpec fields a shared warm-up does not depend on: the repeat (it changes
#: the seeded lengths and prompts, not the shapes the engine is set up for)
#: and the request rate (the warm-up sends its requests in one burst)
SHARED_WARMUP_IGNORES = ("repeat", "rate_per_s")


def warmup_mode(spec: RunSpec, device: torch.device) -> str:
    """The warm-up ``spec`` runs on ``device`` (``auto`` resolved).

    CUDA graphs (a ``cuda_graphs`` setting other than ``off``) are recorded
    per engine, so a warm-up on another engine does not record the run's:
    ``auto`` is then ``workload``, each run recording its own buckets outside
    its clock."""
    if spec.warmup == "auto":
        if device.type != "cuda":
            return "short"
        return "workload" if spec.cuda_graphs != "off" else "shared"
    return spec.warmup


def shared_warmup_key(spec: RunSpec) -> tuple[Any, ...]:
    """What a shared warm-up is reused by: every other field of the spec."""
    fields = dataclasses.asdict(spec)
    for name in SHARED_WARMUP_IGNORES:
        fields.pop(name)
    return tuple(sorted((k, repr(v)) for k, v in fields.items()))


def _shared_warm_up(
    spec: RunSpec,
    device: torch.device,
    adapter: Any,
    drafter: DFlashDrafter | None,
    new_issuer: Callable[[], Any],
    synthetic_weights: bool,
    synthetic_draft: bool,
) -> dict[str, Any]:
    """The workload warm-up for ``spec``'s key, once per process: a full
    build of the run (issuer, cache, calibration, engine) that runs the
    workload warm-up and is then torn down, so the measured run after it
    starts from the same fresh state as every later run of the key. Returns
    the row's description (``ran_now``: whether this run paid for it)."""
    key = shared_warmup_key(spec)
    done = _SHARED_WARMUPS.get(key)
    if done is not None:
        done["runs_after"] += 1
        return {
            "ran_now": False,
            "key_runs_before": done["runs_after"] - 1,
            "warmed_by_repeat": done["repeat"],
            "requests": done["requests"],
            "new_tokens": done["new_tokens"],
            "prompts": done["prompts"],
        }
    warm_spec = dataclasses.replace(spec, warmup="workload")
    issuer = new_issuer()
    warm_setup = SetupClock()
    t0 = time.perf_counter()
    try:
        _run(
            warm_spec,
            device,
            adapter,
            drafter,
            issuer,
            synthetic_weights,
            synthetic_draft,
            None,
            warm_only=True,
            setup=warm_setup,
        )
    finally:
        issuer.close()
    # the pass's cache (a full slab for B3) must be freed before the measured
    # run allocates its own: collect the engine's reference cycles now
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    workload = _serving_workload(warm_spec)
    plans = _warm_up_plans(warm_spec, "workload", workload)
    done = {
        "repeat": spec.repeat,
        "requests": len(plans),
        "new_tokens": sum(t for _, t in plans),
        "prompts": _warm_up_prompts_source(warm_spec, len(plans), len(workload.lengths()[0])),
        "s": time.perf_counter() - t0,
        "runs_after": 1,
    }
    _SHARED_WARMUPS[key] = done
    return {
        "ran_now": True,
        "key_runs_before": 0,
        "warmed_by_repeat": spec.repeat,
        "requests": done["requests"],
        "new_tokens": done["new_tokens"],
        "prompts": done["prompts"],
        "s": done["s"],
        # its phases (run_spec moves them into the row's setup_s)
        "setup_s": warm_setup.row(),
    }


def _under_resident_graphs(
    fn: Callable[Concatenate[RunSpec, P], R],
) -> Callable[Concatenate[RunSpec, P], R]:
    """``fn`` run with the process-wide resident-graph switch at the spec's
    ``resident_graphs``; the setting before is put back after, also on
    failure."""

    @functools.wraps(fn)
    def run(spec: RunSpec, /, *args: P.args, **kwargs: P.kwargs) -> R:
        from pdflash.models.resident_graphs import resident_graphs_as

        with resident_graphs_as(spec.resident_graphs):
            return fn(spec, *args, **kwargs)

    return run


@_under_resident_graphs
def _run(
    spec: RunSpec,
    device: torch.device,
    adapter: Any,
    drafter: DFlashDrafter | None,
    issuer: Any,
    synthetic_weights: bool,
    synthetic_draft: bool,
    progress: Callable[[int, int], None] | None,
    *,
    warm_only: bool = False,
    setup: SetupClock | None = None,
) -> RunResult | None:
    """Build the run's cache, scheduler and engine on ``issuer`` and run its
    workload; ``warm_only``: run the workload warm-up only (the shared
    warm-up's pass) and return None. ``setup``: where the phases before the
    clock are timed (a throwaway clock when None). The whole build and run
    happen with the process-wide resident-graph switch at the spec's
    ``resident_graphs`` (:func:`_under_resident_graphs`)."""
    from pdflash.engine.batching import DeficitBatcher
    from pdflash.engine.predict import route_ahead_predictor
    from pdflash.h2d import measure_link_gbps
    from pdflash.routeahead import AcceptanceHorizon, ApproxRouterPredictor, RouteAheadStats

    setup = SetupClock() if setup is None else setup
    with setup.phase("link_probe"):
        link_gbps = measure_link_gbps(issuer, device)
    # the HBM copy probe of the rows' verify roofline, once per process, here
    # while the device is quiet and before this run's slab is allocated
    from pdflash.engine.roofline import measure_hbm_gbps

    if spec.gpus == 1:
        with setup.phase("hbm_probe"):
            measure_hbm_gbps(device)
    all_resident = spec.baseline == "B3"
    fraction = 1.0 if all_resident else spec.cache_fraction
    eviction = spec.resolved_eviction()
    with setup.phase("expert_cache"):
        cache = adapter.attach_new_cache(
            issuer,
            fraction=fraction,
            policy=eviction,
            # without bands (the PD-one-band ablation) every copy goes in one FIFO band
            single_band=None if EngineConfig.preset(spec.baseline).bands else Band.ON_DEMAND,
        )
    ranks = None
    if spec.gpus > 1:
        from pdflash.distributed import current_group

        from .distributed_run import RankStack

        group = current_group()
        assert group is not None
        ranks = RankStack(group, spec, adapter, cache)
        runtime: Any = ranks.runtime
    else:
        runtime = adapter.runtime

    config = spec.engine_config()
    if spec.gpus > 1:
        from pdflash.distributed import replicated_config

        config = replicated_config(config)
    batcher: VerifyBatcher | None = None
    byte_budget: int | None = None
    # NOTE: where the engine fills a cache that holds every expert
    # (full_cache), no request misses a byte: the engine chooses the batch as
    # B3's (FCFS) instead of a 2-D scheduler, so none is built here (no M, no
    # shadow token-only scheduler, no calibration)
    fills = fills_full_cache(config, adapter, cache if ranks is None else ranks.view)
    if config.batching != "fcfs" and not (fills and config.batching == "deficit_2d"):
        if config.batching == "deficit_2d":
            # NOTE: M is one step's worth of PCIe time at the bandwidth measured
            # in this run (issue 2's sizing), floored at the bytes of every
            # expert of the model (one forward's worst-case union), unless the
            # spec gives bytes. Why the floor: M only changes a schedule when
            # it splits live requests into separate verifies, and in the
            # link-bound regime each of those re-copies nearly the whole
            # expert set (a 16-token block routes ~28 of 32 experts per layer
            # at gpt-oss-20b shape), so a split costs bytes and tokens/s; a
            # block that alone misses more than M would even run alone (the
            # oversize exception) and serialise the batch. With 8 layers at
            # gpt-oss-20b shape the two terms are 55 GB/s x 0.25 s = 13.8 GB
            # and 8 x 32 x 49.8 MB = 12.7 GB; at 24 layers the floor (38 GB)
            # is what keeps requests batched.
            all_expert_bytes = adapter.num_layers * adapter.num_experts * int(cache.expert_nbytes)
            byte_budget = spec.byte_budget or max(
                1, int(link_gbps * 1e9 * spec.step_target_s), all_expert_bytes
            )
            if ranks is not None:  # one link per rank: N x the per-rank budget in total
                byte_budget = ranks.agree(byte_budget * spec.gpus)

        def deficit(budget: int | None) -> DeficitBatcher:
            return DeficitBatcher(
                token_budget=config.token_budget,
                byte_budget=budget,
                num_layers=adapter.num_layers,
                num_experts=adapter.num_experts,
                expert_nbytes=cache.expert_nbytes,
                max_tokens_per_item=config.block_size,
            )

        batcher = deficit(byte_budget)
        if byte_budget is not None:
            # record what the token-only scheduler would have chosen each step
            batcher = ShadowComparison(batcher, deficit(None), cache.expert_nbytes)
    if byte_budget is not None:
        config = config.replace(byte_budget=byte_budget)
    routing = None
    if spec.routing_source == "trace":
        from pdflash.engine.replay import TraceRouting, load_replay_trace

        assert spec.trace is not None
        routing = TraceRouting(load_replay_trace(spec.trace), adapter, spec.trace)
    predictor = None
    horizon = None
    route_stats = RouteAheadStats.for_adapter(adapter)
    if config.route_ahead:
        # under a replay whose trace records it, the union's approximate router
        # replays the trained model's predictions (the live pass still runs,
        # for its time)
        proxy = spec.route_ahead_proxy
        approx = (
            routing.approx_router_predictor(
                charge=ApproxRouterPredictor(adapter, proxy=cast(Any, proxy)),
                proxy=proxy,
            )
            if routing is not None and spec.route_ahead_source == "union"
            else None
        )
        predictor = route_ahead_predictor(
            adapter, spec.route_ahead_source, approx=approx, proxy=proxy
        )
        horizon = AcceptanceHorizon(spec.block_size)
    acceptance = _acceptance_for(spec, spec.arch, synthetic_draft)
    max_seq = (
        (spec.prompt_len_max or spec.prompt_len)
        + (spec.max_new_tokens_max or spec.max_new_tokens)
        + 1
    )
    host_service = None
    # a full cache runs no hybrid service (nothing can miss): none is built
    if config.host_experts != "off" and not fills:
        from pdflash.hybrid import build_host_service

        with setup.phase("host_service"):
            host_service = build_host_service(
                adapter,
                link_bytes_per_s=link_gbps * 1e9,
                workers=spec.host_workers,
                intra_op_threads=spec.host_threads,
                max_host_ratio=spec.host_max_ratio,
                max_host_tokens=spec.host_max_tokens or None,
                host_format=spec.host_format,
                critical_path=spec.host_critical_path,
                host_queued=spec.host_queued,
                host_job_term=spec.host_job_term,
                handoff=spec.host_handoff,
                host_affinity=spec.host_affinity,
                host_ahead=spec.host_ahead,
                host_ahead_from=spec.host_ahead_from,
                # expert-parallel ranks on one host: each its share of the cores and memory
                **({} if ranks is None else ranks.host_share()),
            )
        setup.parts("host_service", host_service.setup_s)
        hw = host_service.host_weights
        if hw is not None and not hw["reused"]:
            parts = {"prepare": hw["prepare_s"]}
            if hw["format_select_s"] is not None:
                parts["format_select"] = hw["format_select_s"]
            setup.parts("host_service.host_weights", parts)

    def make_engine(cfg: EngineConfig, chosen: VerifyBatcher | None) -> Engine:
        from pdflash.engine.pd_controller import FixedParts, PartsPolicy

        # PD-all-on keeps the controller's books with every part on, so its
        # rows record the parts (and pay for the per-step measurement) as PD's do
        controller: PartsPolicy | None = FixedParts() if cfg.baseline == "PD-all-on" else None
        if ranks is not None:
            chosen = ranks.batcher(chosen, cfg.token_budget)
        return Engine(
            adapter,
            cfg,
            drafter=drafter,
            batcher=chosen,
            predictor=predictor if cfg.route_ahead else None,
            horizon=horizon if cfg.route_ahead else None,
            acceptance=acceptance,
            routing=routing,
            expert_cache=cache if ranks is None else ranks.view,
            route_stats=route_stats if cfg.route_ahead else None,
            host_service=host_service if cfg.host_experts != "off" else None,
            max_seq_len=max_seq,
            device=device,
            controller=controller,
        )

    try:
        verify_step_s: float | None = None
        step_compute_s: float | None = None
        fixed_step_bytes: int | None = None
        calibrate = spec.byte_budget_from == "verify" or (
            spec.byte_budget is not None and spec.marginal_rule == "verify"
        )
        if calibrate and isinstance(batcher, ShadowComparison):
            # the shared warm-up's pass calibrates with one verify batch of
            # requests: it sets up the calibration's shapes (batch sizes up to
            # a full verify, the same key lengths) for the measured run's own
            # calibration; its M only steers the warm-up's batches
            calib_requests = (
                max(1, min(config.max_running, config.token_budget // config.block_size))
                if warm_only
                else config.max_running
            )
            with setup.phase("verify_calibration"):
                verify_step_s, step_compute_s = _verify_compute_s(
                    spec, config, make_engine, adapter, calib_requests
                )
            link_verify_bytes = max(1, int(link_gbps * 1e9 * verify_step_s))
            if ranks is not None:
                link_verify_bytes = ranks.agree(link_verify_bytes * spec.gpus)
            if spec.byte_budget is None:
                byte_budget = link_verify_bytes
            if spec.marginal_rule == "verify":
                # F: the step's fixed time as the bytes the link moves in it,
                # estimated by the calibration's compute per step (drafting
                # included; it also holds the calibration batch's per-token
                # compute, so it errs towards keeping batches whole)
                fixed_step_bytes = max(0, int(link_gbps * 1e9 * step_compute_s))
                if ranks is not None:
                    fixed_step_bytes = ranks.agree(fixed_step_bytes * spec.gpus)
            primary = batcher.primary
            assert isinstance(primary, DeficitBatcher)
            assert byte_budget is not None
            primary.set_byte_budget(byte_budget, fixed_step_bytes)
            config = config.replace(byte_budget=byte_budget)
        with setup.phase("engine_build"):
            engine = make_engine(config, batcher)
        # F follows the engine's online step-time fit (its fixed time, not the
        # calibration's per-token compute) once the fit is identified; not
        # across ranks: each rank's fit differs and the schedule must agree
        fixed_feed: FixedStepFeed | None = None
        if fixed_step_bytes is not None and ranks is None:
            assert isinstance(batcher, ShadowComparison)
            assert isinstance(batcher.primary, DeficitBatcher)
            fixed_feed = follow_step_time_fit(engine, batcher.primary, link_gbps * 1e9)
        if spec.breakdown:
            engine.runner.region_timer = engine.timer
        if warm_only:
            sampling = (
                SamplingParams(temperature=spec.temperature) if spec.temperature > 0 else None
            )
            workload = _serving_workload(spec)
            with cache.settled():
                _warm_up(
                    spec,
                    device,
                    engine,
                    acceptance,
                    workload,
                    adapter.vocab_size,
                    sampling,
                    [],
                    setup,
                    None if synthetic_weights else spec.weights,
                )
            cache.drain_inflight()
            return None
        result = _workload(
            spec,
            device,
            adapter,
            engine,
            cache,
            issuer,
            route_stats,
            acceptance,
            link_gbps,
            synthetic_weights,
            progress,
            setup,
        )
        result.row["byte_budget_from"] = spec.byte_budget_from if byte_budget is not None else None
        # the setting (the resume key); fixed_step_bytes says whether it applied
        result.row["marginal_rule"] = spec.marginal_rule
        result.row["fixed_step_bytes"] = fixed_step_bytes
        result.row["fixed_step_compute_s"] = (
            step_compute_s if fixed_step_bytes is not None else None
        )
        result.row.update(_fixed_step_fields(fixed_step_bytes, fixed_feed, ranks is not None))
        if fixed_step_bytes is None:
            if fills and config.batching == "deficit_2d":
                why = "every expert resident (full_cache): no 2-D scheduler, B3's FCFS"
            elif byte_budget is None:
                why = "no byte budget (this baseline does not run the 2-D scheduler)"
            elif spec.marginal_rule == "off":
                why = "marginal rule off (RunSpec.marginal_rule): M hard"
            else:
                why = "M sized from every expert's bytes (byte_budget_from floor): not calibrated"
            result.row.setdefault("not_measured", {}).update(
                dict.fromkeys(
                    ("fixed_step_bytes", "fixed_step_compute_s", "fixed_step_bytes_final"), why
                )
            )
        if ranks is not None:
            ranks.annotate(result.row)
        if verify_step_s is not None and spec.byte_budget is None:
            result.row["byte_budget_verify_compute_s"] = verify_step_s
        return result
    finally:
        # NOTE: copies still queued or in flight (prefetches for a round that
        # never came) write into this run's slab: stop them before the cache
        # (and its slab) can be freed.
        quiesce(issuer, cache)
        # the process-cached adapter must not keep this run's cache alive
        adapter.detach_cache()
        if host_service is not None:
            host_service.close()
            runtime.host_service = None


def _fixed_step_fields(
    calibrated: int | None, feed: FixedStepFeed | None, ranked: bool
) -> dict[str, Any]:
    """The row's record of the marginal rule's ``F``: where the value in
    force at the end came from (the calibration, or the online step-time
    fit), that value, and the fit's books (None with the reason it was not
    followed)."""
    if calibrated is None:
        return {
            "fixed_step_bytes_source": None,
            "fixed_step_bytes_final": None,
            "fixed_step_fit": None,
        }
    if feed is not None:
        return feed.fields()
    why = (
        "not followed across ranks (each rank's fit differs; the schedule must agree)"
        if ranked
        else "the verify width keeps no step-time fit (full/fixed:K)"
    )
    return {
        "fixed_step_bytes_source": "calibration",
        "fixed_step_bytes_final": calibrated,
        "fixed_step_fit": {"followed": False, "why": why},
    }


def _verify_compute_s(
    spec: RunSpec,
    config: EngineConfig,
    make_engine: Callable[[EngineConfig, Any], Engine],
    adapter: Any,
    requests: int,
) -> tuple[float, float]:
    """Mean compute time of one full verify forward, and of one engine step
    (every forward of the step), from a calibration run (FCFS, no prefetch
    machinery) of ``requests`` short requests. The compute-stream stalls on
    copies are subtracted (from the verify's time in proportion to the
    verify forwards' share of all forward time: the timer keeps one stall
    total)."""
    calib_cfg = config.replace(
        batching="fcfs",
        route_ahead=False,
        streaming_prefetch=False,
        background_prefetch=False,
        byte_budget=None,
        host_experts="off",
        parts_controller=False,
    )
    # the calibration runs without the hybrid service: detach it from the
    # runtime meanwhile (an engine with host_experts off refuses a runtime
    # that has one) and give it back after
    runtime: Any = getattr(adapter, "runtime", None)
    service = getattr(runtime, "host_service", None)
    if service is not None:
        runtime.host_service = None
    try:
        return _calibrate(spec, requests, make_engine(calib_cfg, None), adapter.vocab_size)
    finally:
        if service is not None:
            runtime.host_service = service


def _calibrate(spec: RunSpec, requests: int, engine: Engine, vocab: int) -> tuple[float, float]:
    rng = np.random.default_rng(spec.seed * 104729 + 17)
    ids = []
    block = engine.config.block_size
    for _ in range(requests):
        prompt = rng.integers(0, vocab, size=min(8, spec.prompt_len)).tolist()
        ids.append(engine.add_request(prompt, max_new_tokens=min(3 * block, spec.max_new_tokens)))
    engine.run_until_done(max_steps=1000)
    _raise_on_errors({i: e for i in ids if (e := engine.request(i).error) is not None})
    timer = engine.timer
    forwards = engine.verify_forwards
    total = timer.forward_s()
    if forwards == 0 or total <= 0:
        raise RuntimeError("the verify calibration ran no verify forward")
    verify_share = timer.kind_s("verify") / total
    verify_s = max(1e-6, timer.compute_busy_s() * verify_share / forwards)
    # a step's compute (drafting, predicting and verifying, copy stalls
    # excluded): the marginal rule's fixed step time
    step_s = max(verify_s, timer.compute_busy_s() / max(1, engine.steps))
    return verify_s, step_s


def _workload(
    spec: RunSpec,
    device: torch.device,
    adapter: Any,
    engine: Engine,
    cache: Any,
    issuer: Any,
    route_stats: Any,
    acceptance: AcceptanceModel,
    link_gbps: float,
    synthetic_weights: bool,
    progress: Callable[[int, int], None] | None,
    setup: SetupClock,
) -> RunResult:
    rng = np.random.default_rng(spec.seed * 7919 + spec.repeat)
    workload = _serving_workload(spec)
    vocab = adapter.vocab_size
    prompt_lens, _ = workload.lengths()
    prompts = [rng.integers(0, vocab, size=int(n)).tolist() for n in prompt_lens]
    trace_requests: list[int] | None = None
    prompts_source = "random token ids (seeded by seed and repeat)"
    if spec.prompts is not None:
        from .realtext import load_prompts

        loaded = load_prompts(
            spec.prompts,
            [int(n) for n in prompt_lens],
            vocab,
            None if synthetic_weights else spec.weights,
        )
        prompts, trace_requests = loaded.prompts, loaded.trace_requests
        prompts_source = loaded.source
    sampling = SamplingParams(temperature=spec.temperature) if spec.temperature > 0 else None
    # NOTE: settled: the warm-up's evictions wait for its copies, so the
    # resident set it leaves (this run's starting state, and the Belady
    # replay's) does not depend on how fast the copy thread ran
    with cache.settled():
        warmup = _warm_up(
            spec,
            device,
            engine,
            acceptance,
            workload,
            vocab,
            sampling,
            prompts[0],
            setup,
            None if synthetic_weights else spec.weights,
        )
    policy = _pd_controller(engine)
    if policy is not None:
        # its decisions start here (in the bursts, else in the measured run):
        # the settled warm-up's steps waited for copies on the host, where no
        # later step does, so what they showed of PD's parts is no evidence
        policy.restart()
    # NOTE: the bursts run unsettled, as the measured run and a server do: a
    # settled cache waits on the host for every copy, so the stream could
    # not run ahead and the forwards' waits were no stalls the timer sees
    # (the controller's first round, judged there, switched the stream and
    # the host part off on the H200). Their resident set at the clock's
    # start may then depend on the copy thread's speed; the row records it
    # (initial_resident_experts) and the Belady replay starts from it.
    bursts = _Bursts(
        spec,
        engine,
        acceptance,
        workload,
        vocab,
        sampling,
        None if synthetic_weights else spec.weights,
    )
    if spec.warm_bursts > 0:
        warmup["bursts"] = _warm_bursts(bursts, setup)
    if spec.controller_warmup == "first_round":
        warmup["controller"] = _settle_controller(bursts, setup)
    with setup.phase("warmup_settle"):
        cache.drain_inflight()
    # NOTE: the clock starts with a settled cache (warm-up copies landed), so
    # the experts resident now are exactly what this run got for free; the
    # Belady replay starts from the same set (else the optimum pays
    # compulsory loads the run never paid, and ratios < 1 appear).
    cache.drain_inflight()
    initial_resident = np.flatnonzero(np.asarray(cache.slot_of) >= 0).astype(np.int64)
    _reset_measurements(engine)
    recorder = _resident_recorder(adapter)
    if recorder is not None:  # the row counts the measured run's calls only
        recorder.reset_stats()
    issuer_before = _issuer_totals(issuer.stats())
    closed = ClosedLoop(workload) if workload.arrivals == "closed" else None
    pending = closed.start() if closed is not None else open_loop(workload)
    total_tokens = sum(int(n) for n in workload.lengths()[1])
    ids: list[int] = []
    user_of: dict[int, int] = {}
    kv_peak = 0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    shapes_before = sdpa_shapes_met()
    setup.clock_started()
    t0 = time.perf_counter()
    done_tokens = 0
    while pending or engine.has_work:
        now = time.perf_counter() - t0
        while pending and (pending[0].arrival_s or 0.0) <= now:
            plan = pending.pop(0)
            rid = engine.add_request(
                prompts[plan.index],
                sampling,
                max_new_tokens=plan.max_new_tokens,
                slo_s=spec.slo_s,
            )
            # a replayed trace: request i replays the trace request its prompt
            # came from (trace prompts), else trace request (i + repeat x
            # requests) mod R: each repeat replays the trace's next requests,
            # as its prompts and lengths are drawn anew (every label of one
            # repeat replays the same ones: the matrix's pairs stay paired)
            place = plan.index + spec.repeat * workload.num_requests
            _assign_trace_request(
                engine,
                acceptance,
                rid,
                place,
                None if trace_requests is None else trace_requests[plan.index],
            )
            if isinstance(acceptance, ForcedAcceptance):
                # the forced draws follow the request's place in the workload
                # and the repeat, not its id (warm-ups of different lengths
                # ran before it): every label of one repeat draws alike
                acceptance.assign_stream(rid, place)
            ids.append(rid)
            if plan.user is not None:
                user_of[rid] = plan.user
        if not engine.has_work:
            # open loop: nothing to do until the next arrival
            time.sleep(max(0.0, (pending[0].arrival_s or 0.0) - now))
            continue
        rep = engine.step()
        _raise_on_errors(rep.errors)
        done_tokens += rep.committed_tokens + rep.admitted
        kv = engine.kv.occupancy_bytes + (engine.draft_kv.occupancy_bytes if engine.draft_kv else 0)
        kv_peak = max(kv_peak, kv)
        if closed is not None:
            now = time.perf_counter() - t0
            for rid in [r for r in user_of if engine.request(r).metrics.finish_s is not None]:
                nxt = closed.finished(user_of.pop(rid), now)
                if nxt is not None:
                    pending.append(nxt)
            pending.sort(key=lambda p: (p.arrival_s or 0.0, p.index))
        if progress is not None:
            progress(min(done_tokens, total_tokens), total_tokens)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - t0
    issuer_after = _issuer_totals(issuer.stats())
    reqs = [engine.request(i) for i in ids]
    assert int(np.asarray(cache.pins).sum()) == 0, "expert pins leaked"
    result = _result(
        spec,
        device,
        adapter,
        engine,
        cache,
        route_stats,
        acceptance,
        link_gbps,
        synthetic_weights,
        reqs,
        wall,
        kv_peak,
        issuer_before,
        issuer_after,
        initial_resident,
    )
    result.row["prompts_source"] = prompts_source
    result.row["warmup"] = warmup
    # attention shapes first met inside the clock: each pays a per-shape
    # setup where the backend has one (cuDNN), which a warm-up is meant to take
    shapes_after = sdpa_shapes_met()
    result.row["sdpa_shapes"] = {
        "new_in_run": shapes_after - shapes_before,
        "process_total": shapes_after,
    }
    return result


def _raise_on_errors(errors: dict[int, str]) -> None:
    """A request that failed (the engine ended it with finish_reason="error")
    invalidates the run: no row is written from it."""
    if errors:
        rid, text = next(iter(errors.items()))
        raise RuntimeError(f"{len(errors)} benchmark request(s) failed, e.g. {rid}: {text}")


def _mxfp4_dequantizer(adapter: Any) -> str | None:
    """``triton`` / ``torch`` for MXFP4-stored experts, None for other formats."""
    if getattr(getattr(adapter, "layout", None), "format", None) != "mxfp4":
        return None
    from pdflash.models.layout import mxfp4_dequantizer

    return mxfp4_dequantizer(adapter.device)


def _assign_trace_request(
    engine: Engine, acceptance: AcceptanceModel, rid: int, index: int, trace_request: int | None
) -> None:
    """Point the replayed acceptance and routing policies (those that replay a
    trace) at the trace request engine request ``rid`` replays:
    ``trace_request`` when given, else ``index`` mod the trace's requests
    (the measured run passes its request's index plus ``repeat x`` its
    request count)."""
    for policy in (acceptance, engine.routing):
        assign = getattr(policy, "assign", None)
        count = getattr(policy, "num_trace_requests", 0)
        if assign is not None and count:
            assign(rid, trace_request if trace_request is not None else index % count)


def warm_up_prompts(
    spec: RunSpec, workload: Workload, warm_lengths: Sequence[int], vocab: int, weights: str | None
) -> tuple[list[list[int]] | None, str]:
    """The workload warm-up's prompts and where they came from. From real
    text (``RunSpec.prompts``: held-out documents or a text file), the
    windows the source gives after the run's own prompts (the measured
    prompts stay unseen unless the source wraps around), so the warm-up's
    drafts are accepted as the run's are and it meets the verify widths and
    lengths the run will; None (random ids) otherwise, and for trace
    prompts, whose runs replay acceptance and routing from the trace."""
    run_lengths = [int(n) for n in workload.lengths()[0]]
    source = _warm_up_prompts_source(spec, len(warm_lengths), len(run_lengths))
    if spec.prompts is None or source == RANDOM_WARM_UP_PROMPTS:
        return None, source
    from .realtext import load_prompts

    loaded = load_prompts(spec.prompts, [*run_lengths, *warm_lengths], vocab, weights)
    run, warm = loaded.prompts[: len(run_lengths)], loaded.prompts[len(run_lengths) :]
    if any(p == q[: len(p)] or q == p[: len(q)] for p in warm for q in run):
        # a source shorter than run + warm-up wraps around to the run's own
        source += " (the source wrapped: some are the run's)"
    return warm, source


#: the workload warm-up's prompts where the run has no real text
RANDOM_WARM_UP_PROMPTS = "random token ids"


def _warm_up_prompts_source(spec: RunSpec, warm: int, run: int) -> str:
    """Where :func:`warm_up_prompts` takes ``warm`` prompts from, for a run of
    ``run`` requests (the row's ``warmup.prompts``)."""
    if spec.prompts is None or spec.prompts.endswith(".npz") or warm == 0:
        return RANDOM_WARM_UP_PROMPTS
    return f"prompts {spec.prompts!r}: the {warm} after the run's {run}"


def _warm_up(
    spec: RunSpec,
    device: torch.device,
    engine: Engine,
    acceptance: AcceptanceModel,
    workload: Workload,
    vocab: int,
    sampling: SamplingParams | None,
    first_prompt: list[int],
    setup: SetupClock,
    weights: str | None,
) -> dict[str, Any]:
    """Run the warm-up outside the clock (``RunSpec.warmup``) and describe it
    for the row. The short warm-up is the first prompt's first few tokens; the
    workload warm-up sets up shapes, not content, in one burst: prompts from
    the run's real text after its own (:func:`warm_up_prompts`), else random
    ids (``weights``: the checkpoint a text source is tokenized with)."""
    mode = warmup_mode(spec, device)
    rng = np.random.default_rng(spec.seed * 7919 + spec.repeat + 104_729)
    plans = _warm_up_plans(spec, mode, workload)
    texts: list[list[int]] | None = None
    prompts_source = "the run's first prompt"
    if mode == "workload":
        texts, prompts_source = warm_up_prompts(
            spec, workload, [n for n, _ in plans], vocab, weights
        )
    ids = _add_warm_up_requests(
        mode, plans, engine, acceptance, vocab, sampling, first_prompt, texts, rng
    )
    with setup.phase("warmup"):
        _run_warm_up_requests(engine, ids, plans)
    # after the warm-up's requests: the buckets they met are held (most
    # recently used), the pre-capture adds the others up to its bound
    if engine.runner.graphs is not None:
        with setup.phase("graph_precapture"):
            graphs = _prepare_graphs(spec, engine)
    else:
        graphs = None
    out: dict[str, Any] = {
        "mode": mode,
        "requested": spec.warmup,
        "requests": len(plans),
        "new_tokens": sum(t for _, t in plans),
        "prompts": prompts_source,
    }
    if graphs is not None:
        runner = engine.runner.graphs
        assert runner is not None
        # every capture since the engine was built: the pre-capture's and
        # those the warm-up's own steps made (the measured run's are the row's)
        graphs["captures"] = runner.stats.captures
        graphs["draft_captures"] = runner.draft_stats.captures
        out["graphs"] = graphs
    return out


def _add_warm_up_requests(
    mode: str,
    plans: list[tuple[int, int]],
    engine: Engine,
    acceptance: AcceptanceModel,
    vocab: int,
    sampling: SamplingParams | None,
    first_prompt: list[int],
    texts: list[list[int]] | None,
    rng: np.random.Generator,
) -> list[int]:
    """Add one warm-up burst's requests (``plans``) to the engine, not run;
    returns their ids. Prompts: the first prompt's head (``short``), else
    ``texts`` (:func:`warm_up_prompts`), else random ids drawn from ``rng``."""
    ids = []
    for i, (prompt_len, new_tokens) in enumerate(plans):
        if mode != "workload":
            prompt = first_prompt[:prompt_len]
        elif texts is not None:
            prompt = texts[i]
        else:
            prompt = rng.integers(0, vocab, size=prompt_len).tolist()
        rid = engine.add_request(
            prompt, sampling if mode == "workload" else None, max_new_tokens=new_tokens
        )
        # replayed acceptance/routing: a workload warm-up request i replays
        # trace request i mod R (the short one takes the policies' default)
        if mode == "workload":
            _assign_trace_request(engine, acceptance, rid, i, None)
        ids.append(rid)
    return ids


def _run_warm_up_requests(engine: Engine, ids: list[int], plans: list[tuple[int, int]]) -> None:
    engine.run_until_done(max_steps=100 + 10 * sum(t for _, t in plans))
    _raise_on_errors({rid: err for rid in ids if (err := engine.request(rid).error) is not None})


def _pd_controller(engine: Engine) -> PDController | None:
    """The engine's PD controller (None: its label or a full cache runs none,
    or its parts are fixed)."""
    policy = engine.parts.policy if engine.parts is not None else None
    return policy if isinstance(policy, PDController) else None


#: ``controller_warmup="first_round"`` starts no burst past this many engine
#: steps (a first round takes some 30-60 measured steps; a burst's prefill
#: steps are not measured)
MAX_CONTROLLER_WARM_STEPS = 400


@dataclass(frozen=True)
class _Bursts:
    """Workload bursts after the warm-up: the warm-up's requests again, their
    prompts (texts loaded once, or random ids drawn anew each burst)."""

    spec: RunSpec
    engine: Engine
    acceptance: AcceptanceModel
    workload: Workload
    vocab: int
    sampling: SamplingParams | None
    weights: str | None

    @functools.cached_property
    def _plans(self) -> list[tuple[int, int]]:
        return _warm_up_plans(self.spec, "workload", self.workload)

    @functools.cached_property
    def _texts(self) -> list[list[int]] | None:
        texts, _ = warm_up_prompts(
            self.spec, self.workload, [n for n, _ in self._plans], self.vocab, self.weights
        )
        return texts

    def run(self, stream: int, done: Callable[[int], bool]) -> int:
        """Bursts until ``done(bursts so far)``, random ids from the seed's
        ``stream``; returns how many ran."""
        spec, engine = self.spec, self.engine
        rng = np.random.default_rng(spec.seed * 7919 + spec.repeat + stream)
        plans, texts = self._plans, self._texts
        bursts = 0
        while not done(bursts):
            ids = _add_warm_up_requests(
                "workload",
                plans,
                engine,
                self.acceptance,
                self.vocab,
                self.sampling,
                [],
                texts,
                rng,
            )
            _run_warm_up_requests(engine, ids, plans)
            bursts += 1
        return bursts


def _warm_bursts(bursts: _Bursts, setup: SetupClock) -> dict[str, int]:
    """``warm_bursts``: that many workload bursts outside the clock, for any
    label (the row's ``warmup.bursts`` says how many steps they took)."""
    engine, want = bursts.engine, bursts.spec.warm_bursts
    steps_before = engine.steps
    with setup.phase("warm_bursts"):
        ran = bursts.run(3 * 104_729, lambda n: n >= want)
    return {"bursts": ran, "steps": engine.steps - steps_before}


def _settle_controller(bursts: _Bursts, setup: SetupClock) -> dict[str, Any]:
    """``controller_warmup="first_round"``: workload bursts outside the clock
    until PD's controller has ended its first round of probes, none started
    past :data:`MAX_CONTROLLER_WARM_STEPS` steps (the row's
    ``warmup.controller`` says how many ran and whether the round ended).
    An engine without the controller (its label or a full cache) runs none."""
    engine = bursts.engine
    policy = _pd_controller(engine)
    if policy is None:
        return {
            "bursts": 0,
            "steps": 0,
            "first_round_done": None,
            "why": "no PD controller",
            "at_end": None,
            "decisions": [],
            "gate_window": None,
        }
    steps_before = engine.steps
    with setup.phase("controller_warmup"):
        ran = bursts.run(
            2 * 104_729,
            lambda n: (
                policy.rounds_done >= 1 or engine.steps - steps_before >= MAX_CONTROLLER_WARM_STEPS
            ),
        )
    # the warm-up's decisions: the clock's reset_stats clears the
    # controller's books, so the measured row's pd_parts lists none of them
    settled = policy.summary()
    return {
        "bursts": ran,
        "steps": engine.steps - steps_before,
        "first_round_done": policy.rounds_done >= 1,
        "why": None,
        "at_end": settled["at_end"],
        "decisions": settled["decisions"],
        "gate_window": settled["gate_window"],
    }


def _prepare_graphs(spec: RunSpec, engine: Engine) -> dict[str, Any] | None:
    """Record the verify (and draft) graphs of every bucket the run can
    meet (its request count, prompt and output lengths:
    ``Engine.prepare_graphs``); None where the engine records no graphs.
    The report lands in the row's ``warmup.graphs``."""
    if engine.runner.graphs is None:
        return None
    longest = (spec.prompt_len_max or spec.prompt_len) + (
        spec.max_new_tokens_max or spec.max_new_tokens
    )
    report = engine.prepare_graphs(
        _built(engine).max_running,
        min(longest, engine.max_seq_len),
        min_prompt_len=spec.prompt_len,
        min_seq_len=spec.prompt_len + spec.max_new_tokens,
        max_prompt_len=spec.prompt_len_max or spec.prompt_len,
    )
    return {"prepare": report}


def _warm_up_plans(spec: RunSpec, mode: str, workload: Workload) -> list[tuple[int, int]]:
    """(prompt length, new tokens) of each warm-up request: the short one
    (``short``, and the per-run part of ``shared``), or as many of the
    workload's requests as the run keeps running (``workload``)."""
    if mode != "workload":
        return [(max(1, min(4, spec.prompt_len)), 2)]
    prompt_lens, output_lens = workload.lengths()
    n = min(len(prompt_lens), max(1, spec.max_running or spec.concurrency))
    return [(int(prompt_lens[i]), int(output_lens[i])) for i in range(n)]


def _serving_workload(spec: RunSpec) -> Workload:
    """The spec's requests as a :class:`~pdflash.bench.workload.Workload`
    (seeded by seed and repeat)."""

    def lengths(low: int, high: int | None) -> LengthDist:
        return LengthDist("fixed", low, low) if high is None else LengthDist("uniform", low, high)

    return Workload(
        arrivals=spec.arrivals,  # type: ignore[arg-type]
        num_requests=spec.num_requests or spec.concurrency,
        rate_per_s=spec.rate_per_s,
        users=spec.users,
        think_s=spec.think_s,
        prompt_len=lengths(spec.prompt_len, spec.prompt_len_max),
        output_len=lengths(spec.max_new_tokens, spec.max_new_tokens_max),
        seed=spec.seed * 7919 + spec.repeat,
    )


def _approx_router_source(predictor: Any) -> str | None:
    """``trace`` / ``router``: where the route-ahead union's approximate
    router predicts from (None: the predictor has none)."""
    from pdflash.engine.replay import TraceApproxRouter
    from pdflash.routeahead import ApproxRouterPredictor

    for member, _ in getattr(predictor, "members", None) or ():
        if isinstance(member, TraceApproxRouter):
            return "trace"
        if isinstance(member, ApproxRouterPredictor):
            return "router"
    return None


def _built(engine: Engine) -> EngineConfig:
    """The configuration the engine was built with (the PD controller switches
    parts of ``engine.config`` during the run)."""
    return engine.parts.full_config if engine.parts is not None else engine.config


def _reset_measurements(engine: Engine) -> None:
    """The warm-up is not measured: the engine's books (and the cache's, the
    route-ahead stats', the acceptance model's, the hybrid service's) start
    from zero, and its finished requests are released."""
    reset_ranks = getattr(engine.batcher, "reset_rank_books", None)
    if reset_ranks is not None:  # expert-parallel ranks (bench/distributed_run.py)
        reset_ranks()
    engine.reset_stats()  # the row's `steps` counts measured steps only, like the rest
    engine.pop_finished()


def _result(
    spec: RunSpec,
    device: torch.device,
    adapter: Any,
    engine: Engine,
    cache: Any,
    route_stats: Any,
    acceptance: AcceptanceModel,
    link_gbps: float,
    synthetic_weights: bool,
    reqs: list[Any],
    wall: float,
    kv_peak: int,
    issuer_before: dict[str, float],
    issuer_after: dict[str, float],
    initial_resident: npt.NDArray[np.int64],
) -> RunResult:
    speculative = engine.config.speculative
    committed = sum(len(r.output) for r in reqs)
    rounds = [a for r in reqs for a in r.metrics.acceptance_lengths]
    ttfts = [r.metrics.ttft_s for r in reqs if r.metrics.ttft_s is not None]
    round_lat = [x for r in reqs for x in r.metrics.round_latencies_s]
    cstats = cache.stats()
    host = engine.host_service
    host_busy = host.books.busy_s if host is not None else 0.0
    compute_busy = engine.timer.compute_busy_s()
    exposed = engine.timer.stall_s()
    link_busy = issuer_after["link_busy_s"] - issuer_before["link_busy_s"]
    h2d_bytes = int(cstats["bytes_in"])
    # NOTE: a HOST-served expert is a cache miss served by the CPU: it counts
    # as a miss here, so hit rates compare across PD and PD+host
    requested = cstats["hits"] + cstats["misses"] + (host.books.experts if host else 0)
    metrics: dict[str, Metric] = {
        "output_tokens_per_s": ratio(committed, wall, "zero wall time"),
        "acceptance_length_mean": ratio(sum(rounds), len(rounds), "no verify round observed"),
        "ttft_p50_s": _percentile(ttfts, 50, "first token"),
        "ttft_p99_s": _percentile(ttfts, 99, "first token"),
        "round_latency_p50_s": _percentile(round_lat, 50, "verify round"),
        "round_latency_p99_s": _percentile(round_lat, 99, "verify round"),
        "expert_cache_hit_rate": ratio(cstats["hits"], requested, "no expert requested"),
        "expert_cache_landed_hit_rate": ratio(
            cstats["hits"] - cstats["inflight_hits"], requested, "no expert requested"
        ),
        "expert_cache_inflight_hits": float(cstats["inflight_hits"]),
        "wasted_prefetch_bytes": float(cstats["prefetch_bytes_evicted_unused"]),
        "exposed_fetch_s": exposed,
        **_exposed_by_kind(engine.timer),
        "h2d_bytes": float(h2d_bytes),
        "expert_occupancy_bytes": float(cache.num_slots * cache.expert_nbytes),
        "kv_occupancy_bytes": float(kv_peak),
        "compute_busy_s": compute_busy,
        "link_busy_s": link_busy,
        "wall_s": wall,
        # NOTE: three resources with the hybrid miss service: the compute
        # stream, the link and the host CPU's expert pool
        "eta": ratio(max(compute_busy, link_busy, host_busy), wall, "zero wall time"),
        "link_busy_fraction": ratio(link_busy, wall, "zero wall time"),
        "useful_byte_fraction": cstats["useful_byte_fraction"],
        "committed_tokens": float(committed),
        "bytes_per_token": ratio(h2d_bytes, committed, "no token committed"),
        "issuer_blocked_wait_s": issuer_after["blocked_wait_s"] - issuer_before["blocked_wait_s"],
    }
    tpots = [r.metrics.tpot_s for r in reqs if r.metrics.tpot_s is not None]
    queue = [r.metrics.queue_delay_s for r in reqs if r.metrics.queue_delay_s is not None]
    metrics["tpot_p50_s"] = _percentile(tpots, 50, "request with two or more output tokens")
    metrics["tpot_p99_s"] = _percentile(tpots, 99, "request with two or more output tokens")
    metrics["queue_delay_p50_s"] = _percentile(queue, 50, "admitted request")
    metrics["queue_delay_p99_s"] = _percentile(queue, 99, "admitted request")
    shadow = engine.batcher if isinstance(engine.batcher, ShadowComparison) else None
    if shadow is None or shadow.steps == 0:
        if shadow is not None:
            reason = "no verify step was scheduled"
        elif "scheduler_2d" in engine.full_cache_state().get("switched_off", {}):
            reason = "every expert resident (full_cache): no 2-D scheduler, B3's FCFS"
        else:
            reason = f"baseline {spec.baseline} runs no 2-D scheduler"
        for name in (
            "token_only_differing_step_fraction",
            "batch_missing_bytes_2d",
            "batch_missing_bytes_token_only",
        ):
            metrics[name] = NotMeasured(reason)
    else:
        metrics["token_only_differing_step_fraction"] = shadow.differing_steps / shadow.steps
        metrics["batch_missing_bytes_2d"] = float(shadow.primary_missing_bytes)
        metrics["batch_missing_bytes_token_only"] = float(shadow.shadow_missing_bytes)
    metrics.update(_host_metrics(engine, wall, committed))
    metrics["h2d_overlap_fraction"] = (
        NotMeasured("no H2D copies in this run")
        if link_busy <= 0
        else min(1.0, max(0.0, 1.0 - exposed / link_busy))
    )
    if spec.slo_s is None:
        metrics["goodput_rps"] = NotMeasured("no per-request SLO set (RunSpec.slo_s)")
    else:
        met = sum(1 for r in reqs if r.metrics.met_slo)
        metrics["goodput_rps"] = ratio(met, wall, "zero wall time")
    if _built(engine).route_ahead:
        snap = route_stats.snapshot()
        # per-request scope (the predictor's quality) and batch scope (the
        # union the copy engine moves)
        metrics["routeahead_coverage"] = snap.request.coverage
        metrics["routeahead_precision"] = snap.request.precision
        metrics["routeahead_batch_coverage"] = snap.batch.coverage
        metrics["routeahead_batch_precision"] = snap.batch.precision
    else:
        reason = (
            f"route-ahead off: {off}"
            if (off := engine.full_cache_state().get("switched_off", {}).get("route_ahead"))
            else f"baseline {spec.baseline} runs no route-ahead predictor"
        )
        for name in ("coverage", "precision", "batch_coverage", "batch_precision"):
            metrics[f"routeahead_{name}"] = NotMeasured(reason)
    metrics["scheduler_us_per_step"] = (
        float(statistics.median(engine.scheduler_us))
        if engine.scheduler_us
        else NotMeasured("no verify step was scheduled")
    )
    metrics["uncontended_step_fraction"] = (
        NotMeasured("no verify step was scheduled")
        if not engine.scheduler_us
        else NotMeasured(f"batcher {engine.batcher.name!r} consults no deficit scheduler")
        if not _deficit_batching(engine.batcher)
        else engine.uncontended_steps / len(engine.scheduler_us)
    )
    forced = acceptance.source == "forced" and speculative
    replayed_acceptance = acceptance.source == "trace" and speculative
    layout = getattr(adapter, "layout", None)
    padding = int(getattr(layout, "padding_nbytes", 0) or 0)
    stream = engine.prefetch.built_stream
    approx_source = _approx_router_source(engine.predictor)
    row: dict[str, Any] = {
        "arch": spec.arch,
        "model_type": getattr(adapter, "arch", None),
        "baseline": spec.baseline,
        "weights_source": "synthetic" if synthetic_weights else "checkpoint",
        "weights": spec.weights,
        # synthetic weights drawn at load ("generated") or read back from
        # written files ("files"): the same values either way
        "synthetic_weights": spec.synthetic_weights if synthetic_weights else None,
        "draft_source": "none"
        if not speculative
        else ("synthetic" if spec.draft == "synthetic" else "checkpoint"),
        "acceptance_source": "forced" if forced else ("trace" if replayed_acceptance else "model"),
        "acceptance_params": acceptance.params() if (forced or replayed_acceptance) else {},
        "routing_source": "model" if engine.routing is None else engine.routing.name,
        "route_ahead_source": spec.route_ahead_source if engine.predictor is not None else None,
        # what the union's approximate router predicts from: the target's
        # router, or the trained model's predictions replayed from a trace
        # (None: no approximate router runs)
        "route_ahead_approx_source": approx_source,
        # what that approximate router reads (None: none runs)
        "route_ahead_proxy": spec.route_ahead_proxy if approx_source else None,
        # the gate lookahead's predictions: the target's router, or replayed
        # from a trace that records the trained model's (None: no lookahead)
        "lookahead_source": (
            engine.prefetch.lookahead_source
            if engine.expert_cache is not None and _built(engine).lookahead
            else None
        ),
        "routing_params": (
            engine.routing.describe()
            if engine.routing is not None
            else {
                "router": "the target's own router over its (synthetic)"
                if synthetic_weights
                else "the target's own router"
            }
        ),
        "temperature": spec.temperature,
        # expert_nbytes below is what copies, slots and Belady move: padded
        # when expert_bytes_as is set (the compute reads the natural bytes)
        "expert_bytes_source": (
            "natural (the checkpoint's stored layout)"
            if spec.expert_bytes_as is None
            else "padded to " + _expert_bytes_source(spec.expert_bytes_as)
        ),
        "expert_natural_nbytes": int(getattr(layout, "natural_nbytes", cache.expert_nbytes)),
        "expert_padding_nbytes": padding,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "device_type": device.type,
        "issuer_backend": "cuda" if device.type == "cuda" else "host",
        "emulated_link_gbps": spec.emulated_link_gbps if device.type != "cuda" else None,
        "link_gbps_measured": link_gbps,
        "block_size": engine.config.block_size if speculative else 1,
        "requested_block_size": spec.block_size,
        "concurrency": spec.concurrency,
        "cache_fraction": 1.0 if spec.baseline == "B3" else spec.cache_fraction,
        "repeat": spec.repeat,
        "seed": spec.seed,
        "num_requests": len(reqs),
        "prompt_len": spec.prompt_len,
        "max_new_tokens": spec.max_new_tokens,
        "layers": adapter.num_layers,
        "num_experts": adapter.num_experts,
        "top_k": adapter.top_k,
        "dtype": str(adapter.dtype).removeprefix("torch."),
        "cache_slots": int(cache.num_slots),
        "expert_nbytes": int(cache.expert_nbytes),
        # how experts are stored and moved (dense / mxfp4): expert_nbytes and
        # every byte count are of this stored form
        "expert_format": getattr(getattr(adapter, "layout", None), "format", "dense"),
        # which MXFP4 dequantizer the compressed block runs (same bits either way)
        "mxfp4_dequantizer": _mxfp4_dequantizer(adapter),
        # fused (dequantized inside the GEMM kernel) / dequant; None: dense experts
        "compressed_gemm": getattr(getattr(adapter, "runtime", None), "compressed_gemm", None),
        # the setting (PDFLASH_COMPRESSED_GEMM, auto by default) and why it
        # resolved so on this device; None with dense experts
        "compressed_gemm_reason": getattr(
            getattr(adapter, "runtime", None), "compressed_gemm_reason", None
        ),
        "sdpa_backends": sdpa_backends(),
        "byte_budget": engine.config.byte_budget,
        "step_target_s": spec.step_target_s if spec.byte_budget is None else None,
        "eviction_policy": getattr(cache.policy, "name", type(cache.policy).__name__),
        "token_budget": engine.config.token_budget,
        "max_running": engine.config.max_running,
        "workload": _serving_workload(spec).describe(),
        "batching": _built(engine).batching,
        # PD's switchable parts (the ablation labels switch them off; PD's
        # controller switches them during the run: pd_parts says how often)
        "route_ahead": _built(engine).route_ahead,
        "bands": engine.config.bands,
        "steps": engine.steps,
        "verify_forwards": engine.verify_forwards,
        "route_ahead_bytes_submitted": engine.prefetch_bytes[Band.ROUTE_AHEAD],
        # the stream PD was built with (also while its controller has it off)
        "streaming_prefetch": stream is not None,
        "stream_ahead": engine.config.stream_ahead if stream is not None else None,
        "lookahead_score": (
            _built(engine).lookahead_score
            if stream is not None and _built(engine).lookahead
            else None
        ),
        "lookahead_tail": (
            _built(engine).lookahead_tail
            if stream is not None and _built(engine).lookahead
            else None
        ),
        # the lookahead tail's copies the stream asked for, those it gave back
        # unstarted, and the bytes of the rest (None: the stream copies no tail)
        "stream_tail": (
            {
                "copies": stream.tail_copies,
                "given_back": stream.tail_given_back,
                "copied_bytes": (stream.tail_copies - stream.tail_given_back)
                * int(cache.expert_nbytes),
            }
            if stream is not None and stream.tail_band is not None
            else None
        ),
        "route_ahead_horizon": (
            engine.config.route_ahead_horizon if engine.predictor is not None else None
        ),
        # "first_round": the warm-up ran PD's controller past its first round
        # of probes (warmup.controller says how); "off" for labels without it
        "controller_warmup": spec.controller_warmup if _pd_controller(engine) else "off",
        # extra workload bursts after the warm-up (warmup.bursts: their steps)
        "warm_bursts": spec.warm_bursts,
        "route_ahead_cancelled_copies": stream.cancelled if stream is not None else None,
        # the stream's running precision per plan source at the end of the
        # run (it copies before a forward only from the best one >= 0.7)
        "stream_source_precision": dict(stream.precision) if stream is not None else None,
        # the PD controller (PD) or its fixed books (PD-all-on): the policy,
        # the fraction of measured steps each part ran, switches and why
        "parts_controller": _built(engine).parts_controller,
        "pd_parts": engine.parts.policy.summary() if engine.parts is not None else None,
        "background_bytes_submitted": engine.prefetch_bytes[Band.BACKGROUND],
        "predict_s": engine.predict_s,
        "draft_s": engine.timer.kind_s("draft"),
        "verify_s": engine.timer.kind_s("verify"),
        "prefill_s": engine.timer.kind_s("prefill"),
        "router_pass_s": engine.timer.kind_s("predict"),
        "timing_method": engine.timer.method,
        "h2d_overlap_definition": "1 - exposed_fetch_s / link_busy_s (time-weighted)",
        "compute_busy_definition": (
            "prefill+draft+predict+verify time on the compute stream minus exposed_fetch_s "
            "and host_wait_s (CUDA events on CUDA, perf_counter on CPU; includes "
            "kernel-launch gaps)"
        ),
        "expert_cache_hit_rate_definition": (
            "cache hits / experts requested; an expert computed on the host (hybrid miss "
            "service) counts as a miss; a hit on a copy still in flight counts as a hit"
        ),
        "expert_cache_landed_hit_rate_definition": (
            "cache hits whose copy had landed when the forward asked / experts requested "
            "(expert_cache_hit_rate less expert_cache_inflight_hits)"
        ),
        "exposed_fetch_definition": "time the compute stream waited for expert copies (ExpertCache.wait_ready)",
        "exposed_fetch_by_kind_definition": (
            "each wait on expert copies waits first for the copies issued ahead of any access "
            "(prefetches not landed yet: exposed_fetch_inflight_s), then for those issued on "
            "demand for missing experts (the extra time: exposed_fetch_miss_s); they add up to "
            "exposed_fetch_s. exposed_fetch_queued_s is the part of exposed_fetch_inflight_s "
            "spent on prefetches still queued (no chunk started) when the forward asked, "
            "waited for after the started ones (the extra time)"
        ),
        # the run's setting (full_cache may have switched the service off)
        "host_experts": spec.host_mode,
        "host_service": host.describe() if host is not None else None,
        # the pre-verify host plan's gate: its setting and how often it opened
        "host_ahead_gate": engine.host_ahead_gate(),
        # who decided whether the host part ran (EngineConfig.host_control);
        # pd_parts' on_fraction says in how many steps it did
        "host_control": _built(engine).host_control,
        # the controller's route-ahead gate (None: no controller over
        # route-ahead, or a host service, where the gate does not act)
        "route_ahead_gate": (
            _built(engine).route_ahead_gate
            if engine.parts is not None
            and isinstance(engine.parts.policy, PDController)
            and route_ahead_gate_applies(engine.parts.available)
            else None
        ),
        # whether the gate read a gated route-ahead in shadow before probing
        # it (None: no gate acting, as route_ahead_gate's None or "off")
        "route_ahead_shadow_check": (
            engine.parts.policy.route_ahead_shadow_check
            if engine.parts is not None
            and isinstance(engine.parts.policy, PDController)
            and engine.parts.policy.route_ahead_gate is not None
            and route_ahead_gate_applies(engine.parts.available)
            else None
        ),
        # how steps were batched while PD's controller rested (None: no
        # controller that rests)
        "rest_batching": (
            _built(engine).rest_batching
            if engine.parts is not None and engine.parts.rests
            else None
        ),
        "torch_intra_op_threads": torch.get_num_threads(),
    }
    row.update(metrics_to_json(metrics))
    breakdown = _verify_breakdown(engine.timer, spec.breakdown)
    row.setdefault("not_measured", {}).update(breakdown.pop("not_measured", {}))
    row.update(breakdown)
    roofline = _verify_roofline(spec, device, adapter, engine, cache)
    row.setdefault("not_measured", {}).update(roofline.pop("not_measured", {}))
    row.update(roofline)
    row["cuda_graphs"] = _graph_fields(engine, spec)
    row["resident_graphs"] = _resident_graph_fields(adapter, spec)
    # filled before the clock (and what was switched off, why), or why not
    row["full_cache"] = engine.full_cache_state()
    row["verify_width"] = _width_fields(engine, spec)
    row["slo_s"] = spec.slo_s
    if spec.slo_s is None:
        row.setdefault("not_measured", {})["slo_s"] = "no per-request SLO set (RunSpec.slo_s)"
    _add_trace_fields(row, engine.routing_trace, cache, committed, initial_resident)
    _add_eta_phys(row, host.cost if host is not None else None, wall, compute_busy)
    if host is not None:
        row["belady_note"] = (
            "the Belady replay copies every routed expert; with the hybrid miss service some "
            "are computed on the host instead, so bytes_per_token_vs_belady can be below 1"
        )
    per_request = [
        {
            "request_id": r.request_id,
            "output_tokens": len(r.output),
            "ttft_s": r.metrics.ttft_s,
            "latency_s": r.metrics.latency_s,
            "tpot_s": r.metrics.tpot_s,
            "queue_delay_s": r.metrics.queue_delay_s,
            "acceptance_lengths": list(r.metrics.acceptance_lengths),
            "forced_rounds": r.metrics.forced_rounds,
            "model_rounds": r.metrics.model_rounds,
        }
        for r in reqs
    ]
    return RunResult(
        row=row,
        routing_trace=[np.asarray(t, dtype=np.int64) for t in engine.routing_trace],
        cache_slots=int(cache.num_slots),
        expert_nbytes=int(cache.expert_nbytes),
        trace_kinds=list(engine.trace_kinds),
        requests=per_request,
        initial_resident=initial_resident,
    )


def _deficit_batching(batcher: VerifyBatcher) -> bool:
    """Whether ``batcher`` executes a :class:`DeficitBatcher`'s choices (one
    that may grant uncontended steps whole), through a shadow comparison or
    a delegating batcher too."""
    if isinstance(batcher, DelegatingBatcher):
        return _deficit_batching(batcher.inner)
    if isinstance(batcher, ShadowComparison):
        return _deficit_batching(batcher.primary) or _deficit_batching(batcher.shadow)
    return isinstance(batcher, DeficitBatcher)


def _host_metrics(engine: Engine, wall: float, committed: int) -> dict[str, Metric]:
    """The hybrid miss service's books: what the host served and what it cost."""
    host = engine.host_service
    if host is None:
        off = engine.full_cache_state().get("switched_off", {}).get("host_experts")
        why = NotMeasured(
            f"host expert service off ({off})"
            if off
            else "host expert service off (host_experts=off)"
        )
        return dict.fromkeys(HOST_METRIC_FIELDS, why)
    b = host.books
    return {
        "host_served_experts": float(b.experts),
        "host_tokens": float(b.tokens),
        "host_compute_s": b.compute_s,
        "host_busy_s": b.busy_s,
        "host_wait_s": engine.timer.host_wait_s(),
        "host_busy_fraction": ratio(b.busy_s, wall, "zero wall time"),
        "link_bytes_saved": float(b.bytes_saved),
        "link_bytes_saved_per_token": ratio(b.bytes_saved, committed, "no token committed"),
        "host_planned_ahead_experts": float(b.planned_ahead),
    }


def miss_floor_s(
    belady_bytes: float, expert_nbytes: int, link_bytes_per_s: float, host_expert_s: float | None
) -> float:
    """Least time to serve the Belady misses: over the link alone, or (with a
    host expert cost) with the link and the host CPU working at once on a
    perfect split: ``n * t_link * t_host / (t_link + t_host)`` for ``n``
    missed experts, ``t_link`` per copy and ``t_host`` the host's cheapest
    per-expert time (its calibrated cost of one token)."""
    link_s = belady_bytes / link_bytes_per_s
    if host_expert_s is None or host_expert_s <= 0 or expert_nbytes <= 0:
        return link_s
    n = belady_bytes / expert_nbytes
    t_link = expert_nbytes / link_bytes_per_s
    return n * t_link * host_expert_s / (t_link + host_expert_s)


def _add_eta_phys(
    row: dict[str, Any], cost: HostCostModel | None, wall: float, compute_busy: float
) -> None:
    """``eta_phys`` = max(miss floor, compute floor) / wall (docs/design.md §6), with
    the host CPU as a third resource when the hybrid service ran (see
    :func:`miss_floor_s`); the compute floor is this run's measured
    compute-stream busy time."""
    reasons = dict(row.get("not_measured") or {})
    belady = row.get("belady_bytes")
    link = row.get("link_gbps_measured")
    value: float | None = None
    if not isinstance(belady, (int, float)) or not isinstance(link, (int, float)) or link <= 0:
        reasons["eta_phys"] = "no Belady bytes or no measured link bandwidth"
    elif wall <= 0:
        reasons["eta_phys"] = "zero wall time"
    else:
        # a routed expert has at least one token: the model's cost of one
        host_s = float(cost.expert_s(1)) if cost is not None else None
        floor = miss_floor_s(float(belady), int(row["expert_nbytes"]), link * 1e9, host_s)
        value = max(floor, compute_busy) / wall
        row["miss_floor_s"] = floor
    row["eta_phys"] = value
    row["eta_phys_definition"] = (
        "max(miss floor, compute floor) / wall; miss floor = Belady bytes / measured link "
        "bandwidth, or with the host CPU (hybrid service) the Belady misses split perfectly "
        "between the link and the host at its calibrated one-token cost per expert; compute "
        "floor = this run's compute-stream busy time (compute_busy_s)"
    )
    if reasons:
        row["not_measured"] = reasons


def _add_trace_fields(
    row: dict[str, Any],
    routing_trace: list[Any],
    cache: Any,
    committed: int,
    initial_resident: npt.NDArray[np.int64],
) -> None:
    """The routing-trace figures every row carries (routed expert bytes, the
    Belady replay from this run's starting cache and capacity), so a row of
    any suite can be validated and evaluated alike (vacuous coverage / hit
    rate, the hide inequality, bytes per token against the optimum)."""
    from pdflash.report.belady import bytes_per_token_vs_belady, trace_metrics

    reasons = dict(row.get("not_measured") or {})
    fields = trace_metrics(
        routing_trace, int(cache.num_slots), int(cache.expert_nbytes), committed, initial_resident
    )
    extra = fields.pop("not_measured", {})
    assert isinstance(extra, dict)
    reasons.update(extra)
    row.update(fields)
    value, why = bytes_per_token_vs_belady(
        row.get("bytes_per_token"), row.get("belady_bytes_per_token")
    )
    row["bytes_per_token_vs_belady"] = value
    if why is not None:
        reasons["bytes_per_token_vs_belady"] = why
    if reasons:
        row["not_measured"] = reasons


def _graph_fields(engine: Engine, spec: RunSpec) -> dict[str, Any]:
    """The row's ``cuda_graphs``: the setting, whether graphs ran, and the
    graph runner's counters over the measured steps for the target's
    verify forward and (``draft``) the drafter's (captures made during the
    warm-up, its pre-capture included, are not in ``captures``, which
    ``captures_in_run`` repeats; ``graphs_held`` counts them; the warm-up's
    are the row's ``warmup.graphs``). ``captures`` counts piecewise pieces
    too (one per MoE layer of a bucket); ``replays`` counts whole-step
    graphs only, ``piecewise_steps`` the steps run as replayed pieces, and
    ``state`` is ``on`` where either ran."""
    graphs = engine.runner.graphs
    if graphs is None:
        why = "cuda_graphs off" if spec.cuda_graphs == "off" else "not a CUDA device"
        return {"setting": spec.cuda_graphs, "state": "off", "why_off": why}
    out: dict[str, Any] = {"setting": spec.cuda_graphs, "backend": graphs.backend.name}
    out.update(graphs.stats.as_dict())
    # the measured run's own recordings (0 where the warm-up's pre-capture
    # covered every bucket it met); the warm-up's are in warmup.graphs
    out["captures_in_run"] = graphs.stats.captures
    out["draft_captures_in_run"] = graphs.draft_stats.captures
    # piecewise steps replay their pieces (not counted in `replays`, which
    # counts whole-step graphs)
    replayed = graphs.stats.replays or graphs.stats.piecewise_steps
    out["state"] = "on" if replayed else "on_no_replay"
    out["graphs_held"] = graphs.num_graphs
    out["piecewise_buckets_held"] = graphs.num_piecewise_buckets
    out["draft"] = {**graphs.draft_stats.as_dict(), "graphs_held": graphs.num_draft_graphs}
    if graphs.failures:
        out["capture_errors"] = graphs.failures
    return out


def _resident_recorder(adapter: Any) -> Any:
    """The target's recorder of all-resident layer calls
    (:class:`~pdflash.models.resident_graphs.ResidentGraphs`), or None
    (a target without an offloaded MoE runtime)."""
    return getattr(getattr(adapter, "runtime", None), "resident_graphs", None)


def _resident_graph_fields(adapter: Any, spec: RunSpec) -> dict[str, Any]:
    """The row's ``resident_graphs``: the setting and what the recorder of
    all-resident layer calls (one for every layer of the target) did over
    the measured run: recordings made (``captures``, with ``capture_s``,
    the host seconds they took, their first replay and the eager check
    included), replays, ``distinct_keys`` (layer x exact token count x
    shapes asked for), eager calls by reason (``off`` where the setting is
    off: the all-resident calls there were), mismatches with the eager
    check, recordings dropped (``evictions``, ``stale``) and ``graphs_held``
    at the end. ``state``: ``off``, ``on`` (replays ran) or
    ``on_no_replay``."""
    recorder = _resident_recorder(adapter)
    if recorder is None:
        return {
            "setting": spec.resident_graphs,
            "state": "off",
            "why_off": "the target has no offloaded MoE layer to record",
        }
    out: dict[str, Any] = {"setting": spec.resident_graphs}
    out.update(recorder.stats.as_dict())
    out["graphs_held"] = recorder.num_graphs
    if spec.resident_graphs == "off":
        out["state"] = "off"
    else:
        out["state"] = "on" if recorder.stats.replays else "on_no_replay"
    if recorder.failures:
        out["capture_errors"] = {str(k): v for k, v in recorder.failures.items()}
    return out


def _width_fields(engine: Engine, spec: RunSpec) -> dict[str, Any]:
    """The row's ``verify_width``: the setting (``auto`` resolved for the
    label; the run's key), the width the engine ran (``ran``: ``full`` where
    a full cache switched an ``adaptive`` setting off) and, where a policy
    ran, what it decided: mean width, width histogram, expected vs realized
    accepted drafts, its estimates."""
    hook = getattr(engine, "width", None)
    out: dict[str, Any] = {
        "setting": spec.width_setting,
        "requested": spec.verify_width,
        # no policy: every draft verified (or none drafted)
        "ran": "full" if hook is None else hook.policy.name,
    }
    if hook is None:
        out["policy"] = None
        switched = engine.full_cache_state().get("switched_off", {}).get("verify_width")
        if engine.drafter is None:
            out["why_no_policy"] = "no drafter (autoregressive)"
        elif switched:
            out["why_no_policy"] = f"{spec.width_setting} switched to full: {switched}"
        else:
            out["why_no_policy"] = "full width: every draft verified, no policy consulted"
        return out
    out.update(hook.policy.stats())
    # steps at the PD controller's rest that did not consult the policy
    out["controller_rest_steps"] = hook.rest_steps
    return out


def _exposed_by_kind(timer: Any) -> dict[str, Metric]:
    """The exposed fetch split by what the waits waited for
    (:data:`pdflash.engine.timing.STALL_KINDS`), or absent with a reason
    where some wait could not be classified."""
    if timer.stall_kind_s("unclassified") > 0:
        why = NotMeasured("some copy waits ran on a cache that cannot tell misses from prefetches")
        return {
            "exposed_fetch_miss_s": why,
            "exposed_fetch_inflight_s": why,
            "exposed_fetch_queued_s": why,
        }
    unsplit = timer.stall_kind_s("inflight_unsplit")
    queued = timer.stall_kind_s("queued")
    return {
        "exposed_fetch_miss_s": timer.stall_kind_s("miss"),
        "exposed_fetch_inflight_s": timer.stall_kind_s("inflight") + queued + unsplit,
        "exposed_fetch_queued_s": (
            NotMeasured("the copy issuer reports no ticket states: queued and started look alike")
            if unsplit > 0
            else queued
        ),
    }


def _verify_breakdown(timer: Any, enabled: bool) -> dict[str, Any]:
    """Per verify step: the target forward's attention, router and experts
    (summed over layers), the drafter, and the rest of the verify span (the
    embedding, lm_head, bookkeeping kernels and the stream idling while the
    host issues work: host gaps), in ms. Steps replayed as CUDA graphs are
    one region, ``graphed`` (every layer's attention, router and experts
    together; the parts are not separable inside a replay)."""
    steps = timer.kind_count("verify")
    if not enabled or steps == 0:
        reason = "RunSpec.breakdown is off" if not enabled else "no verify step ran"
        return {"verify_breakdown_ms": None, "not_measured": {"verify_breakdown_ms": reason}}
    parts = {n: timer.region_s("verify", n) or 0.0 for n in ("attention", "router", "experts")}
    graphed = timer.region_s("verify", "graphed")
    if graphed is not None:
        parts["graphed"] = graphed
    total = timer.kind_s("verify")
    out = {f"{n}_ms": 1e3 * v / steps for n, v in parts.items()}
    out["other_and_host_gaps_ms"] = 1e3 * (total - sum(parts.values())) / steps
    out["verify_ms"] = 1e3 * total / steps
    drafts = timer.kind_count("draft")
    out["draft_ms_per_verify"] = 1e3 * timer.kind_s("draft") / steps if drafts else 0.0
    out["timing_method"] = timer.method
    if graphed is not None:
        out["graphed_note"] = (
            "replayed CUDA graphs are one region: graphed_ms holds the attention and router "
            "of every replayed step (and its experts when the whole step is one graph); "
            "attention/router/experts_ms hold only what ran eagerly"
        )
    return {"verify_breakdown_ms": out, "verify_steps": steps}


def _verify_roofline(
    spec: RunSpec, device: torch.device, adapter: Any, engine: Engine, cache: Any
) -> dict[str, Any]:
    """The HBM roofline of the run's verify forwards
    (:mod:`pdflash.engine.roofline`): ``verify_roofline`` (mean bytes per
    forward by part, the mean verify ms, the probe's method),
    ``hbm_gbps`` (the device's copy bandwidth), ``hbm_roofline_ms`` (mean
    bytes per verify forward / ``hbm_gbps``) and ``verify_over_roofline``
    (mean verify ms / ``hbm_roofline_ms``). The bytes are counted on every
    device; without a measured bandwidth (not CUDA) the three figures are
    null with the reason in ``not_measured``."""
    from pdflash.engine import roofline as rl

    figures = ("hbm_gbps", "hbm_roofline_ms", "verify_over_roofline")
    forwards = len(engine.verify_kv_spans)
    why: str | None = None
    if forwards == 0:
        why = "no verify forward ran"
    elif spec.gpus > 1:
        why = "experts split across ranks: one rank's bytes are not the forward's"
    elif getattr(adapter, "hf_model", None) is None:
        why = "the adapter has no hf_model to count non-expert parameters from"
    if why is not None:
        names = ("verify_roofline", *figures)
        return {**dict.fromkeys(names), "not_measured": dict.fromkeys(names, why)}
    model = rl.roofline_model(adapter, engine.kv, int(cache.expert_nbytes))
    distinct = rl.distinct_per_forward(
        engine.routing_trace, engine.trace_kinds, "verify", adapter.num_layers
    )
    mean = rl.mean_forward_bytes(model, distinct, engine.verify_kv_spans)
    steps = engine.timer.kind_count("verify")
    out: dict[str, Any] = {
        "forwards": forwards,
        "bytes_per_forward": {k: v for k, v in mean.items() if k != "total"},
        "total_bytes_per_forward": mean["total"],
        "verify_ms": 1e3 * engine.timer.kind_s("verify") / steps if steps else None,
        "definition": (
            "bytes a verify forward must read once: non-expert parameters (attention, norms, "
            "routers, final norm, lm_head; embedding rows gathered only), per MoE layer its "
            "distinct routed experts x stored expert bytes (expert_nbytes), and the KV "
            "positions its attention reads (sliding windows capped); hbm_roofline_ms = "
            "those bytes / hbm_gbps"
        ),
    }
    result: dict[str, Any] = {"verify_roofline": out}
    gbps = rl.measure_hbm_gbps(device)  # measured once per process (see _run)
    if isinstance(gbps, str):
        return {**result, **dict.fromkeys(figures), "not_measured": dict.fromkeys(figures, gbps)}
    out["hbm_gbps_method"] = rl.HBM_PROBE_METHOD
    roof_ms = 1e3 * rl.hbm_seconds(mean["total"], gbps)
    result.update(hbm_gbps=gbps, hbm_roofline_ms=roof_ms)
    if out["verify_ms"] is None:
        result["verify_over_roofline"] = None
        result["not_measured"] = {"verify_over_roofline": "no timed verify forward"}
    else:
        result["verify_over_roofline"] = out["verify_ms"] / roof_ms
    return result


def spec_from_dict(d: dict[str, Any]) -> RunSpec:
    names = {f.name for f in dataclasses.fields(RunSpec)}
    return RunSpec(**{k: v for k, v in d.items() if k in names})
