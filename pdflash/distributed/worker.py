"""One rank's engine over an offloaded checkpoint: build, run greedy
requests, report. The correctness test runs it in one process (``group``
None: the plain single-process engine) and in ``N`` ranks (:func:`launch`),
and compares the tokens; ``pdflash-bench engine --gpus N`` uses
:func:`expert_parallel_stack` to build each rank's pieces."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdflash.protocols import Band

from .group import RankGroup
from .lockstep import replicated_config
from .moe import (
    BusiestRankByteCost,
    ExpertParallelBatcher,
    ExpertParallelMoE,
    ShardedCacheView,
    install_expert_parallel,
)
from .placement import ExpertPlacement, owned_experts_of, placement_for


@dataclass(frozen=True)
class GreedyRunSpec:
    """A small greedy workload over a checkpoint directory (``target``) and a
    drafter directory (``drafter``). ``cache_slots`` is per rank."""

    target: str
    drafter: str
    baseline: str
    prompts: tuple[tuple[int, ...], ...]
    max_new_tokens: int
    cache_slots: int
    block_size: int = 4
    max_running: int = 2
    token_budget: int = 8
    placement: str = "round_robin"
    frequency: Any = None
    max_steps: int = 400
    threads: int = 1
    #: PD's per-rank missing-byte budget in experts (None: half the cache)
    rank_budget_experts: int | None = None
    #: PD+host: serve every ``host_every``-th missed expert of a layer on the
    #: host (a forced, deterministic plan); None: the calibrated planner
    host_every: int | None = None
    #: PD+host: the link rate the calibrated planner assumes (the host
    #: issuer backend has none)
    host_link_bytes_per_s: float = 1e9
    #: every other :class:`~pdflash.engine.config.EngineConfig` setting
    #: (e.g. ``host_ahead_min_exposed``), passed to the preset on every rank
    engine_settings: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


def expert_parallel_stack(
    adapter: Any,
    cache: Any,
    group: RankGroup,
    placement: ExpertPlacement,
) -> tuple[ExpertParallelMoE, ShardedCacheView, BusiestRankByteCost]:
    """This rank's runtime, engine cache view and per-rank byte cost."""
    runtime, view = install_expert_parallel(adapter, cache, placement, group)
    return runtime, view, BusiestRankByteCost(placement, int(cache.expert_nbytes))


def run_greedy(group: RankGroup | None, spec: GreedyRunSpec) -> dict[str, Any]:
    """Run ``spec`` on this rank (or alone when ``group`` is None); returns
    each request's output tokens and this rank's counters."""
    import torch

    from pdflash.engine.batching import DeficitBatcher, VerifyBatcher
    from pdflash.engine.config import EngineConfig
    from pdflash.engine.drafter import load_drafter
    from pdflash.engine.engine import Engine
    from pdflash.engine.predict import BatchedUnionPredictor
    from pdflash.h2d import H2DIssuer
    from pdflash.models import load_adapter
    from pdflash.routeahead import ApproxRouterPredictor, PreviousRoundPredictor, RouteAheadStats

    torch.set_num_threads(spec.threads)
    torch.manual_seed(0)
    # the single-process reference runs the ranks' configuration too
    config = replicated_config(
        EngineConfig.preset(
            spec.baseline,
            block_size=spec.block_size,
            max_running=spec.max_running,
            token_budget=spec.token_budget,
            **spec.engine_settings,
        )
    )
    if config.all_resident:
        raise ValueError(f"{spec.baseline}: not supported with expert parallelism")
    world = 1 if group is None else group.world_size
    issuer = H2DIssuer(backend="host")
    host_service: Any = None
    try:
        owned = None
        if group is not None:  # this rank's host store packs only its experts
            owned = owned_experts_of(spec.placement, group.rank, world, spec.frequency)
        adapter: Any = load_adapter(spec.target, device="cpu", owned_experts=owned)
        cache = adapter.attach_new_cache(
            issuer,
            num_slots=spec.cache_slots,
            policy="layer_cyclic",
            single_band=None if config.bands else Band.ON_DEMAND,
        )
        view: Any = cache
        cost = None
        runtime: Any = None
        if group is not None:
            placement = placement_for(
                spec.placement, adapter.num_layers, adapter.num_experts, world, spec.frequency
            )
            runtime, view, cost = expert_parallel_stack(adapter, cache, group, placement)
        batcher: VerifyBatcher | None = None
        if config.batching != "fcfs":
            per_rank = None
            if config.batching == "deficit_2d":
                experts = spec.rank_budget_experts
                per_rank = int(cache.expert_nbytes) * (
                    int(cache.num_slots) // 2 if experts is None else experts
                )
            batcher = DeficitBatcher(
                token_budget=config.token_budget,
                byte_budget=None if per_rank is None else per_rank * world,
                num_layers=adapter.num_layers,
                num_experts=adapter.num_experts,
                expert_nbytes=cache.expert_nbytes,
            )
        if group is not None:
            assert cost is not None
            batcher = ExpertParallelBatcher(batcher or _fcfs(config.token_budget), view, cost)
        predictor = None
        if config.route_ahead:
            predictor = BatchedUnionPredictor(
                [
                    (ApproxRouterPredictor(adapter), 1.0),
                    (PreviousRoundPredictor(adapter.num_layers, adapter.num_experts), 0.5),
                ]
            )
        if config.host_experts != "off":
            from pdflash.hybrid import ForcedHostPlanner, build_host_service

            # after the runtime is installed: a rank's host serves the misses
            # of the rows its experts received, from its own store
            forced = spec.host_every is not None
            host_service = build_host_service(
                adapter,
                link_bytes_per_s=spec.host_link_bytes_per_s,
                planner=ForcedHostPlanner(every=spec.host_every) if forced else None,
                calibrate=not forced,
                host_format="packed" if forced else "auto",
                workers=1,
                # auto places per process: every rank on one host would put
                # its engine threads on the same two cores
                host_affinity="off",
            )
        engine = Engine(
            adapter,
            config,
            drafter=load_drafter(spec.drafter) if config.speculative else None,
            batcher=batcher,
            predictor=predictor,
            host_service=host_service,
            expert_cache=view,
            route_stats=RouteAheadStats.for_adapter(adapter),
            max_seq_len=max(len(p) for p in spec.prompts) + spec.max_new_tokens + 1,
        )
        ids = [
            engine.add_request(list(p), max_new_tokens=spec.max_new_tokens) for p in spec.prompts
        ]
        done = engine.run_until_done(max_steps=spec.max_steps)
        stats = cache.stats()
        issuer_stats = issuer.stats()
        out: dict[str, Any] = {
            "outputs": [list(done[r].output) for r in ids],
            "finish": [(done[r].metrics.finish_reason, done[r].error) for r in ids],
            "steps": engine.steps,
            "misses": int(stats["misses"]),
            "bytes_in": int(stats["bytes_in"]),
            "link_busy_s": float(issuer_stats.get("link_busy_s", 0.0)),
            "pins_left": int(np.asarray(cache.pins).sum()),
            "resident_foreign": 0,
            "host_packed_bytes": int(adapter.store.packed_nbytes),
            "host_packed_experts": int(adapter.store.num_packed),
            "host_model_bytes": int(adapter.store.total_nbytes),
            "host_books": None if host_service is None else host_service.books.to_json(),
            "config": engine.config,
        }
        if group is not None:
            assert isinstance(batcher, ExpertParallelBatcher)
            out["exchange"] = runtime.exchange.as_dict()
            out["placement"] = getattr(runtime.placement, "name", None)
            out["rank_missing_bytes"] = batcher.rank_missing_bytes.tolist()
            out["rank_books"] = batcher.rank_books()
            out["busiest_rank_bytes"] = list(batcher.busiest_rank_bytes)
            out["batch_sizes"] = list(batcher.batch_sizes)
            out["residency_syncs"] = view.syncs
            # experts another rank owns must never take a slot here
            foreign = np.asarray(cache.resident_mask(), dtype=np.bool_) & ~view.owned
            out["resident_foreign"] = int(foreign.sum())
            packed = adapter.store.owned
            # experts packed here that another rank owns (host memory wasted)
            out["host_packed_foreign"] = int((packed & ~view.owned).sum())
        return out
    finally:
        if host_service is not None:
            host_service.close()
        issuer.close()


def _fcfs(token_budget: int) -> Any:
    from pdflash.engine.batching import FCFSBatcher

    return FCFSBatcher(token_budget)


def run_greedy_all(group: RankGroup | None, specs: list[GreedyRunSpec]) -> list[dict[str, Any]]:
    """:func:`run_greedy` for each spec in turn (one launch, one process group)."""
    return [run_greedy(group, spec) for spec in specs]
