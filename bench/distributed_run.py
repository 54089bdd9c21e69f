"""``--gpus N``: one engine run on ``N`` expert-parallel ranks (issue 18).

:func:`run_ranks` starts ``N`` local processes (torchrun environment, one
rank each, :func:`pdflash.distributed.launch`); each runs the ordinary
:func:`pdflash.bench.engine_run.run_spec` with its expert cache, H2D issuer
and link restricted to the experts it owns (:mod:`pdflash.distributed`), and
its host store packing (and pinning) only those experts.
Every rank runs the same workload with the same seeds (replicated control),
so rank 0's row is the run's; it gains the per-rank books: each rank's link
busy seconds and bytes, all-to-all seconds and rows exchanged, host bytes
packed, and their aggregates. Cache-local row fields (hit rate, h2d bytes, link busy,
Belady figures) are rank 0's own (``rank_local_fields`` says so).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pdflash.report.schema import HOST_METRIC_FIELDS

if TYPE_CHECKING:
    from pdflash.distributed import RankGroup

    from .engine_run import RunResult, RunSpec

#: row fields that describe rank 0's cache and link, not the group's
RANK_LOCAL_FIELDS = (
    "expert_cache_hit_rate",
    "expert_cache_landed_hit_rate",
    "expert_cache_inflight_hits",
    "h2d_bytes",
    "link_busy_s",
    "link_busy_fraction",
    "bytes_per_token",
    "useful_byte_fraction",
    "wasted_prefetch_bytes",
    "expert_occupancy_bytes",
    "exposed_fetch_s",
    "exposed_fetch_miss_s",
    "exposed_fetch_inflight_s",
    "exposed_fetch_queued_s",
    # PD+host: each rank's host serves misses of its own experts only
    *HOST_METRIC_FIELDS,
    "host_service",
)

#: row fields a single-GPU Belady replay gives: the replay runs the whole
#: model's routing against one cache, which no rank of an expert-parallel run
#: is (each caches only its experts), so they are absent with a reason
SINGLE_CACHE_FIELDS = (
    "belady_bytes",
    "belady_bytes_per_token",
    "belady_free_start_bytes",
    "bytes_per_token_vs_belady",
    "miss_floor_s",
    "eta_phys",
)


def check_spec(spec: RunSpec) -> None:
    """What ``--gpus N > 1`` supports (clear errors, nothing started)."""
    if spec.gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {spec.gpus}")
    if spec.placement not in ("round_robin", "frequency"):
        raise ValueError(f"placement must be round_robin or frequency, got {spec.placement!r}")
    if spec.gpus == 1:
        return
    if spec.baseline == "B3":
        raise ValueError("B3 keeps every expert resident on one GPU: not an expert-parallel run")
    if spec.arrivals != "burst":
        # NOTE: replicated control needs every rank to add the same requests
        # at the same step; wall-clock arrivals differ between processes
        raise ValueError(f"--gpus > 1 runs burst arrivals only, got {spec.arrivals!r}")
    if spec.device.startswith("cuda:"):
        raise ValueError("--gpus > 1 places rank r on cuda:r: give --device auto, cuda or cpu")
    if spec.placement == "frequency" and spec.trace is None:
        raise ValueError("placement 'frequency' reads the routing frequency from --trace")


def _rank_main(group: RankGroup, spec: RunSpec) -> Any:
    from .engine_run import run_spec

    result = run_spec(spec)
    return result if group.is_main else None


def run_ranks(spec: RunSpec, progress: Callable[[int, int], None] | None = None) -> RunResult:
    """Run ``spec`` on ``spec.gpus`` local ranks; rank 0's result."""
    from pdflash.distributed import launch
    from pdflash.serve.build import resolve_device

    from .engine_run import synthetic_paths

    check_spec(spec)
    device = "cuda" if resolve_device(spec.device).type == "cuda" else "cpu"
    if spec.weights == "synthetic":
        # written once here, before the ranks read it (they would race to write it)
        target = synthetic_paths(spec, resolve_device(spec.device))[0]
    else:
        target = Path(spec.weights)
    if spec.host_mode != "off":
        # before any rank starts: a rank that owns no expert has nothing for
        # its host to compute (and nothing to prepare or calibrate it on)
        layers, experts = expert_grid(target)
        check_host_ranks(spec, layers, experts, spec.gpus)
    results = launch(_rank_main, spec.gpus, spec, device=device)
    result: RunResult = results[0]
    return result


def _frequency(spec: RunSpec) -> Any:
    from pdflash.distributed import frequency_from_trace

    if spec.placement != "frequency":
        return None
    assert spec.trace is not None
    return frequency_from_trace(spec.trace)


def expert_grid(target: Path) -> tuple[int, int]:
    """``(MoE layers, experts per layer)`` of a checkpoint, read from its
    config as its adapter reads them (nothing loaded)."""
    from transformers import AutoConfig

    from pdflash.models import get_adapter_class, read_model_type

    cls = get_adapter_class(read_model_type(target))
    config = AutoConfig.from_pretrained(target)
    return len(cls.moe_layer_indices(config)), int(cls.num_experts_of(config))


def check_host_ranks(spec: RunSpec, layers: int, experts: int, num_ranks: int) -> None:
    """With host experts on, every rank must own experts under ``spec``'s
    placement (a clear ``ValueError`` naming the ranks and the grid)."""
    from pdflash.distributed import check_every_rank_owns_experts, placement_for

    if spec.host_mode == "off":
        return
    placement = placement_for(spec.placement, layers, experts, num_ranks, _frequency(spec))
    check_every_rank_owns_experts(
        placement, f"{spec.baseline} with host experts ({spec.host_mode}) on {num_ranks} ranks"
    )


def placement_of(spec: RunSpec, adapter: Any, num_ranks: int) -> Any:
    from pdflash.distributed import placement_for

    return placement_for(
        spec.placement, adapter.num_layers, adapter.num_experts, num_ranks, _frequency(spec)
    )


def rank_owned_experts(spec: RunSpec, group: RankGroup) -> tuple[Any, Callable[[int, int], Any]]:
    """``load_target``'s ``owned`` for this rank: its host store packs only
    the experts :func:`placement_of` gives it (the same placement, computed
    from the same inputs), keyed by what decides that share."""
    from pdflash.distributed import owned_experts_of

    key = ("rank", group.rank, group.world_size, spec.placement, spec.trace)
    owned = owned_experts_of(spec.placement, group.rank, group.world_size, _frequency(spec))

    def checked(layers: int, experts: int) -> Any:
        # a group joined without run_ranks (torchrun): the same check, before
        # the store packs anything
        check_host_ranks(spec, layers, experts, group.world_size)
        return owned(layers, experts)

    return key, checked


class RankStack:
    """This rank's expert-parallel pieces inside one ``run_spec`` call."""

    def __init__(self, group: RankGroup, spec: RunSpec, adapter: Any, cache: Any) -> None:
        from pdflash.distributed.worker import expert_parallel_stack

        self.group = group
        self.placement = placement_of(spec, adapter, group.world_size)
        self.runtime, self.view, self.cost = expert_parallel_stack(
            adapter, cache, group, self.placement
        )
        self.batchers: list[Any] = []

    def host_share(self) -> dict[str, Any]:
        """This rank's hybrid host service's share of its host
        (:func:`pdflash.hybrid.rank_host_share`)."""
        from pdflash.hybrid import rank_host_share

        return rank_host_share(self.group.local_rank, self.group.ranks_on_host)

    def batcher(self, inner: Any, token_budget: int) -> Any:
        """``inner`` (FCFS when None) behind the group's residency sync."""
        from pdflash.distributed import ExpertParallelBatcher
        from pdflash.engine.batching import FCFSBatcher

        wrapped = ExpertParallelBatcher(
            inner or FCFSBatcher(token_budget), self.view, self.cost, self.runtime.exchange
        )
        self.batchers.append(wrapped)
        return wrapped

    def agree(self, value: int) -> int:
        """Rank 0's ``value`` on every rank (a collective): a budget derived
        from a rank's own measurement (its link, its compute) must be the same
        everywhere, or the ranks' schedules would differ."""
        import torch.distributed as dist

        box: list[Any] = [int(value)]
        dist.broadcast_object_list(box, src=0)
        return int(box[0])

    def annotate(self, row: dict[str, Any]) -> None:
        """Gather every rank's books (a collective) into ``row``."""
        import torch.distributed as dist

        mine = {
            "rank": self.group.rank,
            "link_busy_s": row.get("link_busy_s"),
            "h2d_bytes": row.get("h2d_bytes"),
            "expert_cache_hit_rate": row.get("expert_cache_hit_rate"),
            "expert_cache_landed_hit_rate": row.get("expert_cache_landed_hit_rate"),
            "owned_experts": int(self.view.owned.sum()),
            # host memory this rank packed (and pinned on CUDA): its own experts
            "host_packed_bytes": int(self.runtime.store.packed_nbytes),
            "host_packed_experts": int(self.runtime.store.num_packed),
            # PD+host: what this rank's host computed (its own experts only)
            "host_served_experts": row.get("host_served_experts"),
            "host_busy_s": row.get("host_busy_s"),
            "link_bytes_saved": row.get("link_bytes_saved"),
            "cache_slots": int(self.view.num_slots),
            "residency_syncs": self.view.syncs,
            "residency_sync_s": self.view.sync_s,
            **self.runtime.exchange.as_dict(),
        }
        reasons = dict(row.get("not_measured") or {})
        row["not_measured"] = reasons
        for name in SINGLE_CACHE_FIELDS:
            if name in row:
                row[name] = None
                reasons[name] = (
                    "a single-cache Belady replay: not defined for expert-parallel ranks, each "
                    "caching only its own experts (per-rank replay not implemented)"
                )
        ranks: list[Any] = [None] * self.group.world_size
        dist.all_gather_object(ranks, mine)
        wall = float(row.get("wall_s") or 0.0)
        nbytes = [float(r["h2d_bytes"] or 0.0) for r in ranks]
        a2a = [float(r["all_to_all_s"]) for r in ranks]
        busy = [float(r["link_busy_s"] or 0.0) for r in ranks]
        last = self.batchers[-1] if self.batchers else None
        row.update(
            {
                "gpus": self.group.world_size,
                "backend": self.group.backend,
                "placement": getattr(self.placement, "name", type(self.placement).__name__),
                "ranks": ranks,
                "rank_local_fields": list(RANK_LOCAL_FIELDS),
                "rank_local_fields_note": "these row fields are rank 0's cache and link; "
                "'ranks' holds every rank's",
                "aggregate_h2d_bytes": sum(nbytes),
                "host_packed_bytes_per_rank": [r["host_packed_bytes"] for r in ranks],
                "host_model_expert_bytes": int(self.runtime.store.total_nbytes),
                "aggregate_link_gbps": sum(nbytes) / wall / 1e9 if wall > 0 else None,
                "busiest_link_busy_s": max(busy),
                "all_to_all_s_max": max(a2a),
                "all_to_all_share": max(a2a) / wall if wall > 0 else None,
                "all_to_all_note": "wall (gloo) or CUDA-event (NCCL) time inside the MoE "
                "exchange collectives, including waits for slower ranks; share = max over "
                "ranks / wall",
                "scheduled_rank_missing_bytes": (
                    None if last is None else last.rank_missing_bytes.tolist()
                ),
                # how often the per-rank budget cut the scheduler's batch
                # (ExpertParallelBatcher: deferred requests run in carry steps)
                "rank_byte_budget": None if last is None else last.rank_byte_budget,
                "rank_budget_deferrals": None if last is None else last.rank_budget_deferrals,
                "rank_budget_repaired_steps": (
                    None if last is None else last.rank_budget_repaired_steps
                ),
                "rank_budget_carry_steps": None if last is None else last.rank_budget_carry_steps,
                "rank_budget_oversize_steps": (
                    None if last is None else last.rank_budget_oversize_steps
                ),
                "scheduled_busiest_rank_bytes_mean": (
                    float(np.mean(last.busiest_rank_bytes))
                    if last is not None and last.busiest_rank_bytes
                    else None
                ),
            }
        )
