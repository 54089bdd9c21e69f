"""The per-rank byte budget of an expert-parallel verify batch.

With experts partitioned across ranks, a step waits for its busiest link:
each rank copies the missing experts it owns, over its own link, before the
verify can finish. The deficit scheduler (:mod:`pdflash.scheduler`) charges a
batch the *total* of its missing bytes against ``N x M``; a batch within that
total can still put more than ``M`` on one rank. :func:`repair_rank_budget`
cuts such a batch down so that every rank's missing bytes are within ``M``.

The rule (deterministic, from the batch order and the residency only, so every
rank computes the same answer):

1. The *protected* item, the batch's first (the scheduler's first-granted
   request), is never deferred: a batch always makes progress, as in the
   single-GPU rules. If the protected item *alone* puts more than ``M`` on
   some rank, the batch is that item alone (the per-rank oversize exception,
   mirroring the scheduler's rule 4h: an oversize item runs alone).
2. Otherwise, while some rank's bytes exceed ``M``, defer the item whose
   removal most reduces the *overflow* ``sum_r max(0, bytes_r - M)`` (the
   bytes the busiest links carry beyond their budget); ties go to the item
   latest in the batch order (the scheduler ranked it lowest). Removing an
   item frees only the experts no other kept item needs, so a removal may
   free nothing on its own (two items sharing one over-budget expert); it is
   still made, and the loop ends because the protected item alone fits.
3. Add back, in batch order, every deferred item that fits now (greedy
   removal can over-cut: a later removal may make an earlier one needless),
   so no deferred item could have joined the repaired batch by itself.

Why overflow and not "the busiest rank's bytes": with several ranks over
budget the maximum only moves when the busiest one does, so it cannot tell a
removal that helps a second over-budget rank from one that helps nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True)
class RankRepair:
    """Which items of a batch (indices in batch order) run and which wait.

    ``rank_bytes`` are the kept batch's missing bytes per rank; ``oversize``
    says the protected item alone was over the budget on some rank (then
    ``kept == [0]``)."""

    kept: list[int]
    deferred: list[int]
    rank_bytes: npt.NDArray[np.int64]
    oversize: bool


def repair_rank_budget(
    missing: Sequence[npt.NDArray[np.int64]],
    owner: npt.NDArray[np.int64],
    num_ranks: int,
    expert_nbytes: int,
    rank_budget: int,
) -> RankRepair:
    """Cut a batch to the per-rank budget (module doc).

    Args:
        missing: per item, in batch order, the flat ids of its experts that
            are not resident (any order, repeats allowed).
        owner: ``[layers * experts]`` rank of each flat expert id.
        num_ranks: ranks in the group.
        expert_nbytes: bytes of one expert.
        rank_budget: ``M``, missing bytes each rank's link may carry.
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if expert_nbytes < 0 or rank_budget < 0:
        raise ValueError(
            f"expert_nbytes and rank_budget must be >= 0, got {expert_nbytes}, {rank_budget}"
        )
    n = len(missing)
    if n == 0:
        return RankRepair([], [], np.zeros(num_ranks, dtype=np.int64), False)
    flat = owner.reshape(-1)
    sets = [np.unique(np.asarray(m, dtype=np.int64).reshape(-1)) for m in missing]
    for s in sets:
        if s.size and (s[0] < 0 or s[-1] >= flat.size):
            raise ValueError(f"expert id out of range [0, {flat.size})")
    allids = np.concatenate(sets)
    uniq, inverse = np.unique(allids, return_inverse=True)
    bounds = np.cumsum([0] + [s.size for s in sets])
    items = [inverse[bounds[i] : bounds[i + 1]] for i in range(n)]  # compact ids
    rank_of = flat[uniq].astype(np.int64)
    if rank_of.size and (rank_of.min() < 0 or rank_of.max() >= num_ranks):
        raise ValueError(f"owner table names a rank outside [0, {num_ranks})")
    nbytes = int(expert_nbytes)

    def rank_bytes(ids: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        counts: npt.NDArray[np.int64] = np.bincount(rank_of[ids], minlength=num_ranks).astype(
            np.int64
        )
        return counts * nbytes

    def overflow(per_rank: npt.NDArray[np.int64]) -> int:
        return int(np.maximum(per_rank - rank_budget, 0).sum())

    users = np.zeros(uniq.size, dtype=np.int64)  # kept items needing each expert
    for ids in items:
        users[ids] += 1

    def current() -> npt.NDArray[np.int64]:
        return rank_bytes(np.flatnonzero(users > 0))

    per_rank = current()
    if overflow(per_rank) == 0:
        return RankRepair(list(range(n)), [], per_rank, False)
    if overflow(rank_bytes(items[0])) > 0:
        return RankRepair([0], list(range(1, n)), rank_bytes(items[0]), True)
    kept = list(range(n))
    deferred: list[int] = []
    while overflow(per_rank) > 0:
        over = overflow(per_rank)
        best, best_gain = -1, -1
        for i in kept[1:]:
            freed = items[i][users[items[i]] == 1]
            gain = over - overflow(per_rank - rank_bytes(freed))
            if gain >= best_gain:  # >=: the latest item wins a tie
                best, best_gain = i, gain
        kept.remove(best)
        deferred.append(best)
        users[items[best]] -= 1
        per_rank = current()
    for i in sorted(deferred):
        users[items[i]] += 1
        trial = current()
        if overflow(trial) == 0:
            kept.append(i)
            per_rank = trial
        else:
            users[items[i]] -= 1
    kept.sort()
    return RankRepair(kept, sorted(set(deferred) - set(kept)), per_rank, False)
