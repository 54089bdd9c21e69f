"""Build a serving :class:`~pdflash.engine.Engine` for a checkpoint directory.

The target's experts go to pinned host memory (:class:`ExpertStore`) and run
from a device :class:`ExpertCache` of ``cache_fraction`` of the experts (or
``cache_gb`` GB) filled by the H2D issuer. With a DFlash draft checkpoint the
engine runs the ``PD`` configuration (DFlash, 2-D deficit verify scheduler,
route-ahead in bands); without one, ``B0`` (autoregressive, on-demand copies
with next-layer gate lookahead). ``PD+host`` adds the hybrid miss service
(:mod:`pdflash.hybrid`: the host CPU computes some missed experts while the
link copies others; its cost model is calibrated at start-up against the
link rate measured then; under ``gpus`` > 1 each rank's service computes
only its own experts, on its share of the host's cores), ``PD-all-on`` runs
PD's parts without the controller that switches them. Everything here is
built on the calling thread: the serving loop calls :func:`build_engine`
from its engine thread.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pdflash.cache.expert_cache import quiesce
from pdflash.distributed.lockstep import LockstepEngine, replicated_config
from pdflash.engine.config import EngineConfig, check_host_control
from pdflash.engine.engine import Engine, fills_full_cache
from pdflash.engine.pd_controller import FixedParts
from pdflash.protocols import link_state_of

if TYPE_CHECKING:
    from pdflash.hybrid.service import HostExpertService


#: the engine configurations ``pdflash serve`` and ``generate`` run (labels
#: of :meth:`EngineConfig.preset`)
SERVE_BASELINES = ("B0", "B1", "B2", "B3", "PD", "PD+host", "PD-all-on")


@dataclass
class ServeModelConfig:
    """What ``pdflash serve`` / ``pdflash generate`` load."""

    model: str
    draft: str | None = None
    cache_fraction: float | None = None
    cache_gb: float | None = None
    device: str = "auto"
    dtype: str | None = None  # None: the checkpoint's
    baseline: str | None = None  # None: PD with a draft, B0 without
    block_size: int = 8
    max_running: int = 8
    max_model_len: int | None = None  # None: min(max_position_embeddings, 4096)
    seed: int = 0
    emulated_link_gbps: float | None = None  # host backend only (CPU tests)
    gpus: int = 1  # expert-parallel ranks (pdflash.distributed); rank r on cuda:r
    # drafts each verify checks (pdflash.engine.verify_width): None the
    # baseline's preset (adaptive for PD, PD+host, PD-all-on; full for B0-B3), or one
    # of pdflash.engine.verify_width.WIDTH_KINDS
    verify_width: str | None = None
    # CUDA graphs of the verify forward (and as many of the drafter's)
    # recorded at start-up, at most this many each (Engine.prepare_graphs:
    # the likeliest buckets first); 0: none,
    # each bucket is recorded by the first step that meets it
    prepare_graphs: int = 0
    # who decides whether PD+host's hybrid miss service runs (EngineConfig.host_control):
    # "controller" (probed and gated by the PD controller) or "always" (every step)
    host_control: str = "controller"
    # PD+host: the host may also compute routed experts whose copy is still
    # queued, giving the copy back (HostExpertService.host_queued; off by default)
    host_queued: bool = False

    def validate(self) -> None:
        if self.cache_fraction is not None and self.cache_gb is not None:
            raise ValueError("give --cache-fraction or --cache-gb, not both")
        if self.cache_fraction is not None and not 0.0 < self.cache_fraction <= 1.0:
            raise ValueError(f"cache fraction must be in (0, 1], got {self.cache_fraction}")
        if self.cache_gb is not None and not self.cache_gb > 0:
            raise ValueError(f"cache GB must be > 0, got {self.cache_gb}")
        if self.max_running < 1 or self.block_size < 1:
            raise ValueError("max_running and block_size must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.dtype is not None and self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.gpus < 1:
            raise ValueError(f"gpus must be >= 1, got {self.gpus}")
        if self.prepare_graphs < 0:
            raise ValueError(f"prepare_graphs must be >= 0, got {self.prepare_graphs}")
        if self.verify_width is not None:
            from pdflash.engine.verify_width import parse_width

            parse_width(self.verify_width, self.block_size)
        if self.baseline is not None and self.baseline not in SERVE_BASELINES:
            raise ValueError(
                f"baseline must be one of {', '.join(SERVE_BASELINES)}, got {self.baseline!r}"
            )
        if self.gpus > 1 and (self.baseline == "B3" or self.device.startswith("cuda:")):
            raise ValueError(
                "--gpus > 1 partitions the experts over ranks (rank r on cuda:r): "
                "not with B3 or --device cuda:N"
            )
        check_host_control(self.host_control)
        if self.host_control != "controller" and self.baseline != "PD+host":
            raise ValueError(
                f"host_control {self.host_control!r} needs --baseline PD+host (the only "
                "configuration with a hybrid miss service)"
            )
        if self.host_queued and self.baseline != "PD+host":
            raise ValueError(
                "host_queued needs --baseline PD+host (the only configuration with a "
                "hybrid miss service)"
            )
        for name, p in (("model", self.model), ("draft", self.draft)):
            if p is not None and not (Path(p) / "config.json").is_file():
                raise ValueError(f"--{name} {p}: not a checkpoint directory (no config.json)")

    @property
    def model_name(self) -> str:
        """The id clients send as ``model``: the directory's name."""
        return Path(self.model).resolve().name


@dataclass
class EngineBundle:
    """The engine and what it runs on; :meth:`close` frees the cache, the
    issuer's queue and the pinned host experts."""

    engine: Engine | LockstepEngine
    adapter: Any
    cache: Any
    issuer: Any
    max_model_len: int
    closers: list[Any] = field(default_factory=list)
    #: the start-up pre-capture's report (``ServeModelConfig.prepare_graphs``), if it ran
    graphs_prepared: dict[str, Any] | None = None

    def resource_counts(self) -> dict[str, int]:
        """Per-request resources held now (all 0 when no request is live and
        copies have settled): KV pages (target and draft), pages promised to
        running requests, running/waiting requests, pinned expert slots,
        copies queued or in flight."""
        eng = self.engine
        link = link_state_of(self.issuer)
        return {
            "kv_pages": int(eng.kv.used_pages),
            "draft_kv_pages": int(eng.draft_kv.used_pages) if eng.draft_kv is not None else 0,
            "promised_pages": int(eng._committed_pages),
            "running": int(eng.num_running),
            "waiting": len(eng._waiting),
            "expert_pins": int(np.asarray(self.cache.pins).sum()),
            "copies_in_flight": 0 if link is None else link.queued_copies + link.inflight_chunks,
        }

    def close(self) -> None:
        for closer in self.closers:
            with contextlib.suppress(Exception):
                closer()
        quiesce(self.issuer, self.cache)
        self.adapter.detach_cache()
        self.issuer.close()
        self.adapter.close()


def resolve_device(name: str) -> torch.device:
    """The torch device a ``--device`` value names: ``"auto"`` is CUDA where
    it is available, else the CPU; a CUDA device without CUDA is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {name!r} requested but CUDA is not available")
    return dev


def build_engine(cfg: ServeModelConfig) -> EngineBundle:
    """Load the target (and draft), the issuer, the expert cache and the engine."""
    from pdflash.engine.batching import DeficitBatcher, VerifyBatcher
    from pdflash.engine.drafter import load_drafter
    from pdflash.engine.predict import BatchedUnionPredictor
    from pdflash.h2d import H2DIssuer
    from pdflash.models import load_adapter
    from pdflash.routeahead import (
        AcceptanceHorizon,
        ApproxRouterPredictor,
        PreviousRoundPredictor,
        RouteAheadStats,
    )

    cfg.validate()
    group = None
    if cfg.gpus > 1:
        from pdflash.distributed import current_group

        group = current_group()
        if group is None or group.world_size != cfg.gpus:
            raise RuntimeError(
                f"--gpus {cfg.gpus}: join a {cfg.gpus}-rank group first "
                "(pdflash serve starts the ranks; pdflash.distributed.init_from_env under torchrun)"
            )
    device = resolve_device(cfg.device) if group is None else group.device
    dtype = getattr(torch, cfg.dtype) if cfg.dtype else None
    baseline = cfg.baseline or ("PD" if cfg.draft else "B0")
    if baseline != "B0" and cfg.draft is None:
        raise ValueError(f"baseline {baseline} is speculative: give --draft DIR")
    owned = None
    if group is not None:  # this rank's host store packs only its experts
        from pdflash.distributed import owned_experts_of

        owned = owned_experts_of("round_robin", group.rank, cfg.gpus)
    adapter: Any = load_adapter(cfg.model, device=device, dtype=dtype, owned_experts=owned)
    issuer = H2DIssuer(
        backend="cuda" if device.type == "cuda" else "host",
        emulated_link_gbps=cfg.emulated_link_gbps if device.type != "cuda" else None,
    )
    host_service: HostExpertService | None = None
    try:
        fraction = cfg.cache_fraction
        capacity = None if cfg.cache_gb is None else int(cfg.cache_gb * 1e9)
        if baseline == "B3":
            fraction, capacity = 1.0, None
        elif fraction is None and capacity is None:
            fraction = 0.2 if device.type == "cuda" else 1.0
        # every baseline: the forward visits the layers cyclically, which LRU
        # thrashes (it evicts what the next forward needs first)
        cache = adapter.attach_new_cache(
            issuer, fraction=fraction, capacity_bytes=capacity, policy="layer_cyclic"
        )
        view: Any = cache
        ep_batcher = None
        if group is not None:
            from pdflash.distributed import (
                BusiestRankByteCost,
                ExpertParallelBatcher,
                RoundRobinPlacement,
                install_expert_parallel,
            )

            placement = RoundRobinPlacement(adapter.num_layers, adapter.num_experts, cfg.gpus)
            if baseline == "PD+host":
                from pdflash.distributed import check_every_rank_owns_experts

                # a rank's host computes only its own experts (every rank
                # raises alike: the placement is the same everywhere)
                check_every_rank_owns_experts(placement, f"PD+host on {cfg.gpus} ranks")
            runtime, view = install_expert_parallel(adapter, cache, placement, group)

            def ep_batcher(inner: VerifyBatcher | None, token_budget: int) -> VerifyBatcher:
                from pdflash.engine.batching import FCFSBatcher

                return ExpertParallelBatcher(
                    inner or FCFSBatcher(token_budget),
                    view,
                    BusiestRankByteCost(placement, int(cache.expert_nbytes)),
                    runtime.exchange,
                )

        drafter = load_drafter(cfg.draft, device=device, dtype=adapter.dtype) if cfg.draft else None
        config = EngineConfig.preset(
            baseline,
            block_size=cfg.block_size,
            max_running=cfg.max_running,
            token_budget=cfg.max_running * cfg.block_size,
            seed=cfg.seed,
            **({} if cfg.verify_width is None else {"verify_width": cfg.verify_width}),
            **({} if cfg.host_control == "controller" else {"host_control": cfg.host_control}),
        )
        if group is not None:
            config = replicated_config(config)
        batcher: VerifyBatcher | None = None
        if config.batching != "fcfs":
            byte_budget = None
            if config.batching == "deficit_2d":
                # every expert's bytes: one forward's worst-case union (as pdflash.bench.engine_run does)
                byte_budget = adapter.num_layers * adapter.num_experts * int(cache.expert_nbytes)
                byte_budget *= cfg.gpus  # one link per rank
                config = config.replace(byte_budget=byte_budget)
            batcher = DeficitBatcher(
                token_budget=config.token_budget,
                byte_budget=byte_budget,
                num_layers=adapter.num_layers,
                num_experts=adapter.num_experts,
                expert_nbytes=cache.expert_nbytes,
                max_tokens_per_item=config.block_size,
            )
        predictor = horizon = route_stats = None
        if config.route_ahead:
            predictor = BatchedUnionPredictor(
                [
                    (ApproxRouterPredictor(adapter, proxy="auto"), 1.0),
                    (PreviousRoundPredictor(adapter.num_layers, adapter.num_experts), 0.5),
                ]
            )
            horizon = AcceptanceHorizon(config.block_size)
            route_stats = RouteAheadStats.for_adapter(adapter)
        if ep_batcher is not None:
            batcher = ep_batcher(batcher, config.token_budget)
        max_len = cfg.max_model_len or min(
            int(getattr(adapter.config, "max_position_embeddings", 4096) or 4096), 4096
        )
        if config.host_experts != "off" and not fills_full_cache(config, adapter, view):
            # a full cache switches the service off in the engine: none is built
            from pdflash.h2d import measure_link_gbps
            from pdflash.hybrid import build_host_service, rank_host_share

            # each rank: its own link measured, its own experts, its share of
            # the host's cores and of the memory for prepared weights
            host_service = build_host_service(
                adapter,
                link_bytes_per_s=measure_link_gbps(issuer, device) * 1e9,
                host_queued=cfg.host_queued,
                **({} if group is None else rank_host_share(group.local_rank, group.ranks_on_host)),
            )
        engine = Engine(
            adapter,
            config,
            drafter=drafter,
            batcher=batcher,
            predictor=predictor,
            horizon=horizon,
            expert_cache=view,
            route_stats=route_stats,
            host_service=host_service,
            max_seq_len=max_len,
            device=device,
            # PD-all-on keeps every part on: fixed books, nothing switched
            controller=FixedParts() if baseline == "PD-all-on" else None,
        )
        prepared = None
        if cfg.prepare_graphs and group is None:
            prepared = engine.prepare_graphs(
                limit=cfg.prepare_graphs, draft_limit=cfg.prepare_graphs
            )
    except BaseException:
        if host_service is not None:
            host_service.close()
        issuer.close()
        adapter.close()
        raise
    closers: list[Any] = [] if host_service is None else [host_service.close]
    if group is not None and group.is_main:
        lockstep = LockstepEngine(engine, group)
        return EngineBundle(
            lockstep, adapter, cache, issuer, max_len, closers=[lockstep.stop, *closers]
        )
    return EngineBundle(
        engine, adapter, cache, issuer, max_len, closers=closers, graphs_prepared=prepared
    )


def write_synthetic_model(
    out: str | Path,
    arch: str = "qwen3_moe",
    preset: str = "tiny",
    *,
    num_layers: int | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    draft: bool = True,
) -> tuple[Path, Path | None]:
    """A synthetic target checkpoint (with its tokenizer) under ``out/target``
    and, with ``draft``, a synthetic DFlash drafter under ``out/draft``.
    Random weights: the text is meaningless, the serving path is real."""
    from pdflash.engine.drafter import write_synthetic_drafter
    from pdflash.models import write_synthetic_checkpoint

    root = Path(out)
    target = write_synthetic_checkpoint(
        root / "target", arch, preset, num_layers=num_layers, dtype=dtype, seed=seed
    )
    if not draft:
        return target, None
    cfg = json.loads((target / "config.json").read_text())
    drafter = write_synthetic_drafter(
        root / "draft", cfg, "tiny" if preset == "tiny" else "full", seed=seed + 1, dtype=dtype
    )
    return target, drafter
