"""Expert-parallel offload: each rank owns a share of the experts.

Attention and dense parts are replicated: every rank runs the same forward
over the same tokens (replicated control: same requests, same seeds, so the
same scheduling decisions). Per MoE layer, :class:`ExpertParallelMoE`:

1. splits the layer's tokens into ``N`` contiguous shards; rank ``r``
   dispatches the routed rows of shard ``r``;
2. sends each row to the rank owning its expert (:mod:`.placement`) with
   ``all_to_all_single`` (the per-rank row counts are exchanged first);
3. the owner computes the rows it received with its own offloaded block
   (:class:`pdflash.models.offload.OffloadedMoE` over its own
   :class:`~pdflash.cache.ExpertCache`, H2D issuer and bands, which only ever
   hold its experts);
4. a second ``all_to_all_single`` returns the results, the source rank
   combines its shard with the routing weights (as the single-process block
   does), and an ``all_gather`` gives every rank the whole layer output.

Rows reach their owner in token order (shards are contiguous and arrive in
rank order), so each expert sees the same rows in the same order as in one
process: the greedy tokens match the single-process engine's.

:class:`ShardedCacheView` is the engine's view of the group's experts: the
residency every rank agrees on (all-gathered once per step as bitsets, by
:meth:`ShardedCacheView.sync_residency`), and copies restricted to this
rank's experts. :class:`ExpertParallelBatcher` syncs it before each verify
schedule, holds the chosen batch to the per-rank byte budget
(:mod:`.rank_budget`) and records each rank's missing bytes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist

from pdflash.cache.expert_cache import ExpertCache
from pdflash.engine.batching import BatchDecision, VerifyBatcher, VerifyDemand
from pdflash.models.offload import ExpertFn, GroupedExperts, OffloadedMoE
from pdflash.protocols import Band, CopyIssuer, checked_flat_ids

from .group import RankGroup
from .placement import ExpertPlacement, owned_mask
from .rank_budget import repair_rank_budget

if TYPE_CHECKING:
    from pdflash.engine.batching import DelegatingBatcher
    from pdflash.models.store import ExpertStore
    from pdflash.protocols import ExpertCacheView


def shard_bounds(num_tokens: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous token shard ``[lo, hi)`` (the first
    ``num_tokens % world_size`` shards hold one more token)."""
    base, extra = divmod(num_tokens, world_size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


@dataclass
class ExchangeStats:
    """What one rank's exchanges cost: collective calls, rows sent to and
    received from other ranks, and the time spent in the collectives (host
    wall time on gloo; CUDA events on NCCL, read by :meth:`seconds`)."""

    layers: int = 0
    rows_sent: int = 0
    rows_received: int = 0
    rows_remote: int = 0  # rows this rank dispatched to another rank's experts
    host_s: float = 0.0
    _events: list[tuple[Any, Any]] = field(default_factory=list)

    def seconds(self) -> float:
        """Time in the exchange collectives (syncs CUDA once to read events)."""
        if self._events:
            torch.cuda.synchronize()
            self.host_s += sum(a.elapsed_time(b) for a, b in self._events) / 1e3
            self._events.clear()
        return self.host_s

    def as_dict(self) -> dict[str, Any]:
        return {
            "moe_layers_exchanged": self.layers,
            "rows_sent": self.rows_sent,
            "rows_received": self.rows_received,
            "rows_remote": self.rows_remote,
            "all_to_all_s": self.seconds(),
        }

    def reset(self) -> None:
        self.seconds()
        self.layers = self.rows_sent = self.rows_received = self.rows_remote = 0
        self.host_s = 0.0


class _Timed:
    """Times a block of collectives (CUDA events on CUDA, wall time else)."""

    def __init__(self, stats: ExchangeStats, device: torch.device) -> None:
        self.stats = stats
        self.cuda = device.type == "cuda"

    def __enter__(self) -> None:
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            self.start.record()
        else:
            self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end.record()
            self.stats._events.append((self.start, end))
        else:
            self.stats.host_s += time.perf_counter() - self.t0


class ExpertParallelMoE(OffloadedMoE):
    """An :class:`OffloadedMoE` whose experts are partitioned across ranks
    (module doc). ``cache`` holds only this rank's experts; the layer output
    is the same on every rank.

    Args:
        store, cache, expert_fn, grouped: as :class:`OffloadedMoE` (this
            rank's cache).
        placement: who owns each expert.
        group: this rank (its collectives run on ``group.device``).
    """

    def __init__(
        self,
        store: ExpertStore,
        cache: ExpertCache,
        expert_fn: ExpertFn,
        grouped: GroupedExperts | None = None,
        *,
        placement: ExpertPlacement,
        group: RankGroup,
    ) -> None:
        super().__init__(store, cache, expert_fn, grouped)
        if placement.num_ranks != group.world_size:
            raise ValueError(
                f"placement is for {placement.num_ranks} ranks, the group has {group.world_size}"
            )
        table = placement.owner_table()
        if table.shape != (store.num_layers, store.num_experts):
            raise ValueError(
                f"placement covers {table.shape}, the model has "
                f"({store.num_layers}, {store.num_experts}) experts"
            )
        self.placement = placement
        self.group = group
        self._owner = torch.from_numpy(table.reshape(-1).copy()).to(cache.slab.device)
        self.exchange = ExchangeStats()

    def forward_routed(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        for hook in self.route_hooks:
            hook(layer, topk_ids)
        num_tokens, k = topk_ids.shape
        if num_tokens == 0:  # the same on every rank (replicated forward): no collective
            return torch.zeros_like(x)
        world, rank = self.group.world_size, self.group.rank
        lo, hi = shard_bounds(num_tokens, world, rank)
        flat = topk_ids[lo:hi].reshape(-1).long()
        dest = self._owner[layer * self.num_experts + flat]
        order = torch.argsort(dest, stable=True)
        send_counts = torch.bincount(dest, minlength=world)
        timed = _Timed(self.exchange, x.device)
        with timed:
            recv_counts = torch.empty_like(send_counts)
            dist.all_to_all_single(recv_counts, send_counts)
        send_split = send_counts.tolist()
        recv_split = recv_counts.tolist()
        n_recv = int(sum(recv_split))
        send_x = x[lo:hi][order // k]
        send_e = flat[order]
        with timed:
            recv_x = x.new_empty((n_recv, x.shape[1]))
            dist.all_to_all_single(recv_x, send_x, recv_split, send_split)
            recv_e = flat.new_empty((n_recv,))
            dist.all_to_all_single(recv_e, send_e, recv_split, send_split)
        if n_recv:
            ones = torch.ones((n_recv, 1), dtype=topk_weights.dtype, device=x.device)
            # k = 1 with weight 1: the block's weighted sum is the expert output
            # itself (the route hooks already saw this layer's routing above)
            local = self._forward_grouped if self.grouped is not None else self._forward_loop
            y_recv = local(layer, recv_x, recv_e.view(-1, 1), ones)
        else:
            y_recv = recv_x
        with timed:
            back = x.new_empty((int(send_e.numel()), x.shape[1]))
            dist.all_to_all_single(back, y_recv.contiguous(), send_split, recv_split)
        y_flat = torch.empty_like(back)
        y_flat[order] = back
        # the single-process block's combine: one reduction over the k rows
        # in the routing weights' precision, rounded to x's dtype once
        weighted = y_flat.view(hi - lo, k, x.shape[1]) * topk_weights[lo:hi].unsqueeze(-1)
        shard_out = weighted.sum(dim=1).to(x.dtype)
        width = shard_bounds(num_tokens, world, 0)[1]  # the largest shard
        padded = x.new_zeros((width, x.shape[1]))
        padded[: hi - lo] = shard_out
        with timed:
            parts = [torch.empty_like(padded) for _ in range(world)]
            dist.all_gather(parts, padded)
        out = torch.cat(
            [
                p[: b - a]
                for r, p in enumerate(parts)
                for a, b in [shard_bounds(num_tokens, world, r)]
            ]
        )
        self.exchange.layers += 1
        self.exchange.rows_sent += int(send_e.numel())
        self.exchange.rows_received += n_recv
        self.exchange.rows_remote += int(send_e.numel()) - int(send_split[rank])
        return out


def _all_gather_bits(bits: npt.NDArray[np.uint8], group: RankGroup) -> list[npt.NDArray[np.uint8]]:
    t = torch.from_numpy(bits.copy()).to(group.device)
    parts = [torch.empty_like(t) for _ in range(group.world_size)]
    dist.all_gather(parts, t)
    return [p.cpu().numpy() for p in parts]


class ShardedCacheView:
    """The engine's :class:`~pdflash.protocols.ExpertCacheView` of a group's
    experts (module doc), over this rank's ``local`` cache.

    * :meth:`resident_mask`: the group's residency (each expert resident on
      its owner), as of the last :meth:`sync_residency` (a collective: every
      rank calls it at the same point, once per step); identical on every
      rank, so schedules are.
    * :meth:`is_resident`: this rank's truth for its own experts and True for
      the others' (nothing for this rank to copy), so route-ahead and the
      streaming prefetcher copy only this rank's experts.
    * :meth:`prefetch`: this rank's experts among the ids (-1 for others).
    * the slots, tickets, issuer, capacity: this rank's cache (its own link
      and bands). Anything else is read from ``local``.
    """

    def __init__(self, local: ExpertCache, placement: ExpertPlacement, group: RankGroup) -> None:
        self.local = local
        self.placement = placement
        self.group = group
        self.owned = owned_mask(placement, group.rank)
        self._owned_flat = self.owned.reshape(-1)
        self.num_layers, self.num_experts = self.owned.shape
        self._owner_flat = placement.owner_table().reshape(-1)
        self._resident = np.zeros_like(self.owned)
        self.syncs = 0
        self.sync_s = 0.0
        self.sync_residency()

    # -- the group's residency -------------------------------------------------

    def sync_residency(self) -> npt.NDArray[np.bool_]:
        """All-gather every rank's residency of its own experts (one packed
        bitset per rank) and return the group's ``[layers, experts]`` mask.
        A collective: every rank must call it at the same point."""
        t0 = time.perf_counter()
        mine = np.asarray(self.local.resident_mask(), dtype=np.bool_) & self.owned
        parts = _all_gather_bits(np.packbits(mine.reshape(-1)), self.group)
        n = mine.size
        union = np.zeros(n, dtype=np.bool_)
        for r, p in enumerate(parts):
            union |= np.unpackbits(p, count=n).astype(np.bool_) & (self._owner_flat == r)
        self._resident = union.reshape(mine.shape)
        self.syncs += 1
        self.sync_s += time.perf_counter() - t0
        result: npt.NDArray[np.bool_] = self._resident.copy()
        return result

    def resident_mask(self) -> npt.NDArray[np.bool_]:
        result: npt.NDArray[np.bool_] = self._resident.copy()
        return result

    # -- this rank's experts ---------------------------------------------------

    def is_resident(self, flat_ids: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        ids = checked_flat_ids(flat_ids, self._owned_flat.size)
        out = np.ones(ids.shape, dtype=np.bool_)
        mine = self._owned_flat[ids]
        if mine.any():
            out[mine] = np.asarray(self.local.is_resident(ids[mine]), dtype=np.bool_)
        return out

    def prefetch(
        self,
        flat_ids: npt.ArrayLike,
        band: Band = Band.ROUTE_AHEAD,
        *,
        protect: npt.ArrayLike | None = None,
    ) -> npt.NDArray[np.int64]:
        ids = checked_flat_ids(flat_ids, self._owned_flat.size)
        out = np.full(ids.shape, -1, dtype=np.int64)
        mine = self._owned_flat[ids]
        keep = None
        if protect is not None:
            p = checked_flat_ids(protect, self._owned_flat.size)
            keep = p[self._owned_flat[p]]
        if mine.any():
            out[mine] = self.local.prefetch(ids[mine], band, protect=keep)
        return out

    def set_predicted(self, flat_ids: npt.ArrayLike) -> None:
        ids = checked_flat_ids(flat_ids, self._owned_flat.size)
        self.local.set_predicted(ids[self._owned_flat[ids]])

    def free_capacity(self, protect: npt.ArrayLike | None = None) -> int:
        return int(self.local.free_capacity(protect))

    @property
    def expert_nbytes(self) -> int:
        return int(self.local.expert_nbytes)

    @property
    def num_slots(self) -> int:
        return int(self.local.num_slots)

    @property
    def issuer(self) -> CopyIssuer:
        issuer: CopyIssuer = self.local.issuer
        return issuer

    @property
    def single_band(self) -> Band | None:
        return self.local.single_band

    @property
    def ticket(self) -> npt.NDArray[np.int64]:
        return self.local.ticket

    @property
    def band(self) -> npt.NDArray[np.int64]:
        return self.local.band

    @property
    def expert_of(self) -> npt.NDArray[np.int64]:
        return self.local.expert_of

    def __getattr__(self, name: str) -> Any:
        # stats(), policy, pins, ...: this rank's cache
        return getattr(self.local, name)


class BusiestRankByteCost:
    """A batch's missing bytes per rank: the step waits for its busiest link,
    so the cost of a set of missing experts is the max over ranks of the
    bytes each owner must copy, not the total."""

    def __init__(self, placement: ExpertPlacement, expert_nbytes: int) -> None:
        if expert_nbytes < 0:
            raise ValueError(f"expert_nbytes must be >= 0, got {expert_nbytes}")
        self.num_ranks = placement.num_ranks
        self.owner = placement.owner_table().reshape(-1).astype(np.int64)
        self.expert_nbytes = int(expert_nbytes)

    def per_rank(self, flat_ids: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """``[ranks]``: bytes each rank copies for the distinct ``flat_ids``."""
        ids = np.unique(checked_flat_ids(flat_ids, self.owner.size))
        counts = np.bincount(self.owner[ids], minlength=self.num_ranks)
        return counts.astype(np.int64) * self.expert_nbytes

    def cost(self, flat_ids: npt.ArrayLike) -> int:
        """Bytes on the busiest rank."""
        return int(self.per_rank(flat_ids).max(initial=0))


class ExpertParallelBatcher:
    """A :class:`~pdflash.engine.batching.VerifyBatcher` for expert-parallel
    ranks: before each choice it syncs the group's residency (the one
    collective of a step's scheduling) and hands it to ``inner``; then it
    holds the chosen batch to the per-rank byte budget ``M`` and records
    each rank's missing bytes (:attr:`rank_missing_bytes`, summed over
    steps; :attr:`busiest_rank_bytes` and :attr:`batch_sizes`, per step).

    The budgets. ``inner`` (the deficit scheduler) charges the union of a
    batch's missing bytes against its byte budget, built as ``N x M`` (each
    rank's link carries ``M`` per step). Within that total one rank can still
    be asked for more than ``M``, and the step waits for its busiest link, so
    this batcher cuts the batch with
    :func:`~pdflash.distributed.rank_budget.repair_rank_budget`: every rank's
    missing bytes (the kept requests' predicted experts that rank owns and
    does not hold) end within ``M``, except when the first-granted request
    alone is over ``M`` on some rank, which then runs alone (the per-rank
    oversize exception). ``M`` is ``rank_byte_budget`` when given, else the
    executed wrapped batcher's byte budget divided by the ranks (read every
    step, so a ``set_byte_budget`` between workloads carries over); a batcher
    with no byte budget (FCFS, token-only) is not cut.

    Deferred requests and the scheduler's books. The native scheduler has
    already charged every request it served (credit spent, demand consumed,
    cursor moved); it has no call to take a charge back, and its rules are
    not changed here. So a deferred request is *carried*: it keeps the grant
    it paid for and runs in a later step without going back through the
    scheduler. While carried requests wait, a step serves only them (the
    wrapped batcher is not consulted, so nothing new is charged), cut to the
    per-rank budget the same way with the oldest carried request protected.
    Every charge therefore buys exactly one verify of the granted tokens, a
    step or more later: the deficit ledger, the DRR laps and the fairness
    and liveness bounds of ``docs/scheduler.md`` hold in the steps that
    consult the scheduler, and each of those is followed by fewer carry
    steps than it had requests (the protected request always runs, so the
    carried list shrinks every step). A carried request that leaves (finish,
    abort) is dropped from the list; one not waiting for verify any more is
    dropped too (its demand was consumed; the engine re-drafts it).

    Every input is replicated (the demands, the all-gathered residency, the
    batch order), so every rank makes the same cut and carries the same
    requests.
    """

    def __init__(
        self,
        inner: VerifyBatcher,
        view: ShardedCacheView,
        cost: BusiestRankByteCost,
        exchange: ExchangeStats | None = None,
        *,
        rank_byte_budget: int | None = None,
    ) -> None:
        if rank_byte_budget is not None and rank_byte_budget < 0:
            raise ValueError(f"rank_byte_budget must be >= 0, got {rank_byte_budget}")
        self.inner = inner
        self.view = view
        self.cost = cost
        self.exchange = exchange
        self.name = inner.name
        self._rank_byte_budget = rank_byte_budget
        self._carried: list[tuple[int, int]] = []
        self.rank_missing_bytes = np.zeros(cost.num_ranks, dtype=np.int64)
        self.busiest_rank_bytes: list[int] = []
        self.batch_sizes: list[int] = []
        #: requests the per-rank repair deferred (a request deferred twice counts twice)
        self.rank_budget_deferrals = 0
        #: steps whose batch the per-rank repair changed
        self.rank_budget_repaired_steps = 0
        #: steps that served only carried (already charged) requests
        self.rank_budget_carry_steps = 0
        #: steps cut to their first request because it alone was over ``M`` on a rank
        self.rank_budget_oversize_steps = 0

    @property
    def rank_byte_budget(self) -> int | None:
        """``M`` for this step (class doc); None: no per-rank cut."""
        if self._rank_byte_budget is not None:
            return self._rank_byte_budget
        executed: Any = self.inner
        if hasattr(executed, "primary") and hasattr(executed, "execute_shadow"):
            # a ShadowComparison runs one of its two batchers' decisions
            executed = executed.shadow if executed.execute_shadow else executed.primary
        total = getattr(executed, "byte_budget", None)
        return None if total is None else int(total) // self.cost.num_ranks

    def with_inner(self, inner: VerifyBatcher) -> ExpertParallelBatcher:
        """This batcher (the same object: its books stay where its caller
        reads them) handing each step's choice to ``inner`` from now on,
        named as ``inner`` (:class:`~pdflash.engine.batching.DelegatingBatcher`).
        Before its first step: raises RuntimeError once it has carried a
        request (the old inner batcher charged it)."""
        if self._carried or self.batch_sizes:
            raise RuntimeError("with_inner after a step: the inner batcher's books would split")
        self.inner = inner
        self.name = inner.name
        return self

    @property
    def carried(self) -> list[tuple[int, int]]:
        """Deferred ``(request_id, tokens)`` waiting for a carry step."""
        return list(self._carried)

    def reset_rank_books(self) -> None:
        """Start the measurement over: this batcher's books, the view's sync
        counters and the runtime's exchange counters (when given)."""
        self.rank_missing_bytes[:] = 0
        self.busiest_rank_bytes.clear()
        self.batch_sizes.clear()
        self.rank_budget_deferrals = 0
        self.rank_budget_repaired_steps = 0
        self.rank_budget_carry_steps = 0
        self.rank_budget_oversize_steps = 0
        self.view.syncs = 0
        self.view.sync_s = 0.0
        if self.exchange is not None:
            self.exchange.reset()

    def rank_books(self) -> dict[str, Any]:
        """The per-rank scheduling books, for a row."""
        return {
            "scheduled_rank_missing_bytes": self.rank_missing_bytes.tolist(),
            "rank_byte_budget": self.rank_byte_budget,
            "rank_budget_deferrals": self.rank_budget_deferrals,
            "rank_budget_repaired_steps": self.rank_budget_repaired_steps,
            "rank_budget_carry_steps": self.rank_budget_carry_steps,
            "rank_budget_oversize_steps": self.rank_budget_oversize_steps,
        }

    def add(self, request_id: int, weight: float = 1.0) -> None:
        self.inner.add(request_id, weight)

    def remove(self, request_id: int) -> None:
        self._carried = [(r, g) for r, g in self._carried if r != request_id]
        self.inner.remove(request_id)

    def select(
        self, demands: Sequence[VerifyDemand], resident: npt.NDArray[np.bool_] | None
    ) -> BatchDecision:
        # NOTE: ``resident`` is the snapshot the engine read before this call;
        # the group's residency is refreshed here, once per step, so every
        # rank decides from the same, current view
        group_resident = self.view.sync_residency()
        by_id = {d.request_id: d for d in demands}
        self._carried = [(r, min(g, by_id[r].tokens)) for r, g in self._carried if r in by_id]
        decision: BatchDecision | None = None
        if self._carried:
            grants = self._carried
            self._carried = []
            self.rank_budget_carry_steps += 1
        else:
            decision = self.inner.select(demands, group_resident)
            grants = decision.grants
        not_resident = ~group_resident.reshape(-1)
        empty = np.zeros(0, dtype=np.int64)
        missing_sets = []
        for rid, _ in grants:
            pred = by_id[rid].predicted if rid in by_id else None
            ids = empty if pred is None else np.asarray(pred, dtype=np.int64).reshape(-1)
            missing_sets.append(ids[not_resident[ids]])
        budget = self.rank_byte_budget
        kept = grants
        if budget is not None and len(grants) > 1:
            repair = repair_rank_budget(
                missing_sets, self.cost.owner, self.cost.num_ranks, self.cost.expert_nbytes, budget
            )
            self.rank_budget_oversize_steps += int(repair.oversize)
            if repair.deferred:
                kept = [grants[i] for i in repair.kept]
                self._carried = [grants[i] for i in repair.deferred]
                missing_sets = [missing_sets[i] for i in repair.kept]
                self.rank_budget_deferrals += len(repair.deferred)
                self.rank_budget_repaired_steps += 1
        union = np.unique(np.concatenate(missing_sets)) if missing_sets else empty
        per_rank = self.cost.per_rank(union)
        self.rank_missing_bytes += per_rank
        self.busiest_rank_bytes.append(int(per_rank.max(initial=0)))
        self.batch_sizes.append(len(kept))
        if decision is not None and kept is decision.grants:
            return decision
        # the kept requests' missing experts (the scheduler's union for the
        # batch it would have run), which the engine prefetches
        return BatchDecision(
            grants=list(kept),
            missing=union,
            scheduler_us=0.0 if decision is None else decision.scheduler_us,
        )


def install_expert_parallel(
    adapter: Any, cache: ExpertCache, placement: ExpertPlacement, group: RankGroup
) -> tuple[ExpertParallelMoE, ShardedCacheView]:
    """Attach this rank's ``cache`` to an offloaded adapter
    (:class:`pdflash.models.MoEAdapterBase`) as an expert-parallel runtime.

    Returns the runtime (the adapter's blocks now run it) and the engine's
    view of the group's experts (pass it as the engine's ``expert_cache``).
    The adapter's host store may pack only this rank's experts
    (``load_adapter(owned_experts=owned_experts_of(...))``, what every
    caller in the package does) or all of them; one that lacks an expert
    this rank owns is refused (nothing changed)."""
    owned = owned_mask(placement, group.rank)
    packed = getattr(adapter.store, "owned", None)
    if packed is not None and (owned & ~packed).any():
        layer, expert = (int(i[0]) for i in np.nonzero(owned & ~packed))
        raise ValueError(
            f"rank {group.rank} owns expert {expert} of layer {layer}, which its host store "
            "did not pack: load the adapter with this placement's owned_experts"
        )
    # the cache holds only this rank's experts: refuses others, and a layer is
    # resident (no host sync in the block) once the rank's own experts are
    cache.restrict_to(owned)
    adapter.attach_cache(cache)  # checks the shapes and registers the store with the issuer
    runtime = ExpertParallelMoE(
        adapter.store,
        cache,
        adapter.expert_forward,
        adapter.grouped_experts(),
        placement=placement,
        group=group,
    )
    adapter.runtime = runtime
    for block in adapter.blocks:
        block.runtime = runtime
    return runtime, ShardedCacheView(cache, placement, group)


if TYPE_CHECKING:

    def _is_cache_view(view: ShardedCacheView) -> ExpertCacheView:
        return view

    def _is_batcher(batcher: ExpertParallelBatcher) -> DelegatingBatcher:
        return batcher
