"""The per-rank byte budget of an expert-parallel verify batch: the repair
(:func:`repair_rank_budget`) and :class:`ExpertParallelBatcher`'s carried
requests over a real deficit scheduler (a fake residency view, no processes)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdflash.distributed import (
    BusiestRankByteCost,
    ExpertParallelBatcher,
    RoundRobinPlacement,
    repair_rank_budget,
)
from pdflash.engine.batching import (
    BatchDecision,
    DeficitBatcher,
    FCFSBatcher,
    ShadowComparison,
    VerifyDemand,
)

NB = 10  # bytes per expert

# 2 ranks, one layer of 8 experts: rank 0 owns the even ids, rank 1 the odd
OWNER = np.arange(8, dtype=np.int64) % 2


def _ids(*xs: int) -> npt.NDArray[np.int64]:
    return np.array(xs, dtype=np.int64)


def _bytes(missing: Sequence[npt.NDArray[np.int64]], kept: list[int]) -> list[int]:
    sets = [missing[i] for i in kept]
    union = np.unique(np.concatenate(sets)) if sets else _ids()
    return (np.bincount(OWNER[union], minlength=2) * NB).tolist()


# ---------------------------------------------------------------- the repair


def test_a_batch_within_budget_is_unchanged() -> None:
    missing = [_ids(0, 1), _ids(2, 3), _ids(0, 3)]
    rep = repair_rank_budget(missing, OWNER, 2, NB, rank_budget=20)
    assert rep.kept == [0, 1, 2] and rep.deferred == [] and not rep.oversize
    assert rep.rank_bytes.tolist() == [20, 20]


def test_a_batch_over_budget_on_one_rank_only_is_cut_to_fit() -> None:
    # rank 0 (even ids) is asked for 0, 2, 4, 6 = 40 bytes; rank 1 for 10
    missing = [_ids(0, 1), _ids(2), _ids(4, 6), _ids(0)]
    assert _bytes(missing, [0, 1, 2, 3]) == [40, 10]
    rep = repair_rank_budget(missing, OWNER, 2, NB, rank_budget=20)
    # removing item 2 frees 20 bytes of rank 0's overflow at once
    assert rep.kept == [0, 1, 3] and rep.deferred == [2] and not rep.oversize
    assert rep.rank_bytes.tolist() == _bytes(missing, rep.kept) == [20, 10]


def test_the_first_item_is_never_deferred() -> None:
    # the first item alone fills rank 0; every other item adds to it
    missing = [_ids(0, 2), _ids(4), _ids(6), _ids(1)]
    rep = repair_rank_budget(missing, OWNER, 2, NB, rank_budget=20)
    assert rep.kept[0] == 0
    assert rep.kept == [0, 3] and rep.deferred == [1, 2]  # item 3 adds only to rank 1


def test_a_first_item_over_budget_alone_runs_alone() -> None:
    missing = [_ids(0, 2, 4), _ids(1), _ids()]
    rep = repair_rank_budget(missing, OWNER, 2, NB, rank_budget=20)
    assert rep.oversize and rep.kept == [0] and rep.deferred == [1, 2]
    assert rep.rank_bytes.tolist() == [30, 0]


def test_a_shared_expert_is_freed_by_deferring_every_item_that_needs_it() -> None:
    # items 1 and 2 share expert 4: neither removal alone frees it
    missing = [_ids(0), _ids(4), _ids(4), _ids(3)]
    rep = repair_rank_budget(missing, OWNER, 2, NB, rank_budget=10)
    assert rep.kept == [0, 3] and rep.deferred == [1, 2]


def test_greedy_over_cuts_are_added_back() -> None:
    # rank 0 is asked for 0, 4, 6 and rank 1 for 1, 7 (budget 10 each): the
    # greedy cuts item 3 first (a three-way tie, the latest wins), then items
    # 2 and 1; without items 1 and 2, item 3 fits again and is added back
    missing = [_ids(0), _ids(4, 6), _ids(1, 4), _ids(0, 7)]
    rep = repair_rank_budget(missing, OWNER, 2, NB, rank_budget=10)
    assert rep.kept == [0, 3] and rep.deferred == [1, 2]
    assert rep.rank_bytes.tolist() == [10, 10]
    for i in rep.deferred:  # maximal: no deferred item fits beside the kept ones
        assert max(_bytes(missing, sorted([*rep.kept, i]))) > 10


def test_the_repair_is_deterministic_and_checks_its_input() -> None:
    rng = np.random.default_rng(5)
    missing = [rng.choice(8, size=3, replace=False).astype(np.int64) for _ in range(6)]
    a = repair_rank_budget(missing, OWNER, 2, NB, 20)
    b = repair_rank_budget([m.copy() for m in missing], OWNER.copy(), 2, NB, 20)
    assert (a.kept, a.deferred, a.rank_bytes.tolist()) == (
        b.kept,
        b.deferred,
        b.rank_bytes.tolist(),
    )
    with pytest.raises(ValueError, match="out of range"):
        repair_rank_budget([_ids(8)], OWNER, 2, NB, 20)
    with pytest.raises(ValueError, match=">= 0"):
        repair_rank_budget([_ids(0)], OWNER, 2, NB, -1)
    with pytest.raises(ValueError, match="outside"):
        repair_rank_budget([_ids(1)], OWNER, 1, NB, 20)  # expert 1 is on rank 1


@settings(deadline=None)
@given(
    ranks=st.integers(1, 4),
    experts=st.integers(1, 12),
    budget_experts=st.integers(0, 5),
    data=st.data(),
)
def test_after_repair_every_rank_fits_unless_the_first_item_runs_alone(
    ranks: int, experts: int, budget_experts: int, data: st.DataObject
) -> None:
    owner = np.array(
        data.draw(st.lists(st.integers(0, ranks - 1), min_size=experts, max_size=experts)),
        dtype=np.int64,
    )
    n = data.draw(st.integers(1, 7))
    missing = [
        np.array(data.draw(st.lists(st.integers(0, experts - 1), max_size=6)), dtype=np.int64)
        for _ in range(n)
    ]
    budget = budget_experts * NB

    def per_rank(kept: list[int]) -> list[int]:
        sets = [missing[i] for i in kept]
        union = np.unique(np.concatenate(sets)) if sets else _ids()
        return (np.bincount(owner[union], minlength=ranks) * NB).tolist()

    rep = repair_rank_budget(missing, owner, ranks, NB, budget)
    assert rep.kept[0] == 0  # the first item always runs
    assert sorted(rep.kept + rep.deferred) == list(range(n)) and not set(rep.kept) & set(
        rep.deferred
    )
    assert rep.kept == sorted(rep.kept)  # the batch order is kept
    assert rep.rank_bytes.tolist() == per_rank(rep.kept)
    if max(per_rank(list(range(n)))) <= budget:
        assert rep.kept == list(range(n))
    if rep.kept != [0]:
        assert max(rep.rank_bytes) <= budget
    else:
        assert rep.oversize == (max(per_rank([0])) > budget)
    if not rep.oversize:  # maximal: no deferred item would fit by itself
        for i in rep.deferred:
            assert max(per_rank(sorted([*rep.kept, i]))) > budget


# ---------------------------------------------------------------- the batcher


class FakeView:
    """The group's residency, as ShardedCacheView.sync_residency returns it."""

    def __init__(self, resident: npt.NDArray[np.bool_]) -> None:
        self.resident = resident
        self.syncs = 0
        self.sync_s = 0.0

    def sync_residency(self) -> npt.NDArray[np.bool_]:
        self.syncs += 1
        return self.resident.copy()


class Recording:
    """A batcher that records the grants its wrapped batcher decided."""

    def __init__(self, inner: DeficitBatcher) -> None:
        self.inner = inner
        self.name = inner.name
        self.granted: Counter[tuple[int, int]] = Counter()
        self.calls = 0

    @property
    def byte_budget(self) -> int | None:
        return self.inner.byte_budget

    def add(self, request_id: int, weight: float = 1.0) -> None:
        self.inner.add(request_id, weight)

    def remove(self, request_id: int) -> None:
        self.inner.remove(request_id)

    def select(
        self, demands: Sequence[VerifyDemand], resident: npt.NDArray[np.bool_] | None
    ) -> BatchDecision:
        self.calls += 1
        decision = self.inner.select(demands, resident)
        self.granted.update(decision.grants)
        return decision


LAYERS, EXPERTS, RANKS = 2, 8, 2


def _deficit(rank_budget_experts: int, token_budget: int = 64) -> DeficitBatcher:
    return DeficitBatcher(
        token_budget=token_budget,
        byte_budget=rank_budget_experts * NB * RANKS,
        num_layers=LAYERS,
        num_experts=EXPERTS,
        expert_nbytes=NB,
    )


def _batcher(inner: Any, resident: npt.NDArray[np.bool_] | None = None) -> ExpertParallelBatcher:
    placement = RoundRobinPlacement(LAYERS, EXPERTS, RANKS)
    view = FakeView(np.zeros((LAYERS, EXPERTS), dtype=np.bool_) if resident is None else resident)
    return ExpertParallelBatcher(inner, view, BusiestRankByteCost(placement, NB))  # type: ignore[arg-type]


def _owner() -> npt.NDArray[np.int64]:
    return RoundRobinPlacement(LAYERS, EXPERTS, RANKS).owner_table().reshape(-1)


def test_the_per_rank_budget_is_the_wrapped_schedulers_over_the_ranks() -> None:
    assert _batcher(_deficit(3)).rank_byte_budget == 3 * NB
    shadow = ShadowComparison(_deficit(2), FCFSBatcher(8), NB)
    ep = _batcher(shadow)
    assert ep.rank_byte_budget == 2 * NB
    shadow.execute_shadow = True  # the token-only decision runs: no byte budget
    assert ep.rank_byte_budget is None
    assert _batcher(FCFSBatcher(8)).rank_byte_budget is None
    placement = RoundRobinPlacement(LAYERS, EXPERTS, RANKS)
    explicit = ExpertParallelBatcher(
        FCFSBatcher(8),
        FakeView(np.zeros((LAYERS, EXPERTS), np.bool_)),  # type: ignore[arg-type]
        BusiestRankByteCost(placement, NB),
        rank_byte_budget=7,
    )
    assert explicit.rank_byte_budget == 7
    with pytest.raises(ValueError, match="rank_byte_budget"):
        ExpertParallelBatcher(
            FCFSBatcher(8),
            FakeView(np.zeros((LAYERS, EXPERTS), np.bool_)),  # type: ignore[arg-type]
            BusiestRankByteCost(placement, NB),
            rank_byte_budget=-1,
        )


def test_a_batch_within_the_per_rank_budget_is_the_schedulers_decision() -> None:
    inner = _deficit(4)
    ep = _batcher(inner)
    for rid in (1, 2):
        ep.add(rid)
    demands = [VerifyDemand(1, 2, _ids(0, 1)), VerifyDemand(2, 2, _ids(2, 3))]
    decision = ep.select(demands, None)
    assert sorted(r for r, _ in decision.grants) == [1, 2]
    assert ep.rank_budget_deferrals == 0 and ep.carried == []
    assert ep.rank_missing_bytes.tolist() == [20, 20]


def test_fcfs_is_never_cut() -> None:
    ep = _batcher(FCFSBatcher(8))
    for rid in (1, 2):
        ep.add(rid)
    demands = [VerifyDemand(1, 2, _ids(0, 2, 4, 6)), VerifyDemand(2, 2, _ids(8, 10, 12))]
    decision = ep.select(demands, None)
    assert [r for r, _ in decision.grants] == [1, 2] and ep.rank_budget_deferrals == 0


def test_a_deferred_request_is_carried_and_runs_without_a_second_charge() -> None:
    # rank 0 owns the even ids of layer 0: the total budget (4 experts) takes
    # all three requests (4 distinct experts), rank 0's budget (2) does not
    inner = Recording(_deficit(2))
    ep = _batcher(inner)
    for rid in (1, 2, 3):
        ep.add(rid)
    demands = [
        VerifyDemand(1, 2, _ids(0, 2)),
        VerifyDemand(2, 2, _ids(4)),
        VerifyDemand(3, 2, _ids(1)),
    ]
    first = ep.select(demands, None)
    chosen = sorted(r for r, _ in inner.granted)
    assert chosen == [1, 2, 3]  # the scheduler fit them in N x M
    assert [r for r, _ in first.grants] == [1, 3]  # rank 0 would carry 30 > 20
    assert ep.carried == [(2, 2)]
    assert first.missing.tolist() == [0, 1, 2]
    assert ep.rank_budget_deferrals == 1 and ep.rank_budget_repaired_steps == 1
    # the carried request runs next, alone, and the scheduler is not asked
    second = ep.select([VerifyDemand(2, 2, _ids(4))], None)
    assert second.grants == [(2, 2)] and inner.calls == 1
    assert second.missing.tolist() == [4]
    assert ep.rank_budget_carry_steps == 1 and ep.carried == []
    assert ep.batch_sizes == [2, 1] and ep.busiest_rank_bytes == [20, 10]


def test_a_carried_request_that_leaves_is_dropped() -> None:
    inner = Recording(_deficit(1))
    ep = _batcher(inner)
    for rid in (1, 2):
        ep.add(rid)
    demands = [VerifyDemand(1, 1, _ids(0)), VerifyDemand(2, 1, _ids(2))]
    assert [r for r, _ in ep.select(demands, None).grants] == [1]
    assert ep.carried == [(2, 1)]
    ep.remove(2)
    assert ep.carried == []
    ep.add(3)
    ep.select([VerifyDemand(1, 1, _ids(0)), VerifyDemand(3, 1, _ids(1))], None)
    assert inner.calls == 2  # nothing carried: the scheduler chose


def _simulate(seed: int, steps: int = 60) -> tuple[list[list[tuple[int, int]]], dict[str, Any]]:
    """A serving loop: every live request waits for verify; a verified one
    re-drafts (new predicted experts). Returns the executed batches."""
    rng = np.random.default_rng(seed)
    inner = Recording(_deficit(2, token_budget=12))
    ep = _batcher(inner)
    owner = _owner()
    live: dict[int, VerifyDemand] = {}
    next_id = 0
    executed: Counter[tuple[int, int]] = Counter()
    batches: list[list[tuple[int, int]]] = []

    def draft(rid: int) -> VerifyDemand:
        ids = rng.choice(LAYERS * EXPERTS, size=int(rng.integers(0, 4)), replace=False)
        return VerifyDemand(rid, int(rng.integers(1, 5)), np.sort(ids).astype(np.int64))

    for step in range(steps):
        while len(live) < 5:
            ep.add(next_id)
            live[next_id] = draft(next_id)
            next_id += 1
        decision = ep.select(list(live.values()), None)
        batches.append(decision.grants)
        executed.update(decision.grants)
        union = np.unique(
            np.concatenate([live[r].predicted for r, _ in decision.grants])  # type: ignore[misc]
        )
        per_rank = np.bincount(owner[union], minlength=RANKS) * NB
        assert len(decision.grants) == 1 or per_rank.max() <= 2 * NB, step
        for rid, _ in decision.grants:
            if rng.random() < 0.2:
                ep.remove(rid)
                del live[rid]
            else:
                live[rid] = draft(rid)
    # drain the carried requests: every charge of the scheduler buys one verify
    while ep.carried:
        decision = ep.select(list(live.values()), None)
        executed.update(decision.grants)
    books = {"granted": inner.granted, "executed": executed, **ep.rank_books()}
    return batches, books


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_every_scheduler_grant_runs_exactly_once_and_ranks_agree(seed: int) -> None:
    batches, books = _simulate(seed)
    assert books["rank_budget_deferrals"] > 0  # the per-rank budget bound
    assert books["rank_budget_carry_steps"] > 0
    # the deficit books stay true: what the scheduler charged is what ran
    # (a request that left while carried is the only exception: none here
    # is removed before it runs, since removal follows execution)
    assert books["executed"] == books["granted"]
    # replicated control: the same inputs give the same batches on every rank
    again, books_again = _simulate(seed)
    assert again == batches and books_again == books
