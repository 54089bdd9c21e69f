"""VerifyScheduler: bad input, determinism, token-only mode, the oversize
exception, the documented scan order, trimming, results, policies."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

import pdflash
from pdflash import SchedulerConfig, StepResult, VerifyScheduler
from pdflash._reference.scheduler import ReferenceScheduler
from pdflash._reference.scheduler_checks import InvariantTracker
from pdflash.scheduler import (
    MIN_WEIGHT,
    DeadlinePolicy,
    FairPolicy,
    PolicyInput,
    UnknownRequestError,
    WeightPolicy,
)

pytestmark = pytest.mark.native


def make(
    T: int = 16, M: int | None = 100, layers: int = 2, experts: int = 4, **kw: Any
) -> VerifyScheduler:
    s = VerifyScheduler(
        SchedulerConfig(
            token_budget=T, missing_byte_budget=M, num_layers=layers, num_experts=experts, **kw
        )
    )
    s.set_expert_bytes(np.full((layers, experts), 10, dtype=np.int64))
    return s


def snapshot(s: VerifyScheduler) -> tuple[Any, ...]:
    core = s._core
    return (
        s.request_ids.tolist(),
        core.deficits().tolist(),
        core.weights().tolist(),
        core.pending_tokens().tolist(),
        [core.demand_bits(i).tolist() for i in range(len(s))],
        core.lap,
        core.cursor_seq,
        core.visit_open,
        s.step_index,
    )


def run_order(s: VerifyScheduler, steps: int, drafts: int, experts: list[int]) -> list[list[int]]:
    out = []
    for _ in range(steps):
        for rid in s.request_ids.tolist():
            if s.pending_tokens(rid) == 0:
                s.update_demand(rid, drafts, experts)
        out.append(s.step().request_ids.tolist())
    return out


def test_public_exports() -> None:
    for name in ("VerifyScheduler", "SchedulerConfig", "StepResult", "NativeExtensionError"):
        assert name in pdflash.__all__ and hasattr(pdflash, name)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda s: s.update_demand(99, 3, [0]), UnknownRequestError, r"request id 99 is not live"),
        (lambda s: s.set_weight(99, 1.0), UnknownRequestError, r"request id 99 is not live"),
        (lambda s: s.clear_demand(99), UnknownRequestError, r"request id 99 is not live"),
        (lambda s: s.add_request(1), ValueError, r"request id 1 is already live"),
        (lambda s: s.add_request("a"), TypeError, r"request id must be an int, got 'a'"),
        (lambda s: s.add_request(2**63), ValueError, r"does not fit in int64"),
        (lambda s: s.add_request(5, 0.0), ValueError, r"weight must be finite and >= .*got 0\.0"),
        (lambda s: s.add_request(5, math.inf), ValueError, r"got inf"),
        (lambda s: s.set_weight(1, MIN_WEIGHT / 2), ValueError, r"weight must be finite"),
        (lambda s: s.update_demand(1, -1, [0]), ValueError, r"drafted_tokens must be >= 0, got -1"),
        (lambda s: s.update_demand(1, 2.0, [0]), TypeError, r"drafted_tokens must be an int"),
        (lambda s: s.update_demand(1, 2, [0, 8]), ValueError, r"expert id 8 out of range \[0, 8\)"),
        (lambda s: s.update_demand(1, 2, [-1]), ValueError, r"expert id -1 out of range"),
        (lambda s: s.update_demand(1, 2, [0.5]), TypeError, r"flat expert ids must be integers"),
        (
            lambda s: s.update_demand(1, 2, np.zeros((2, 5), dtype=bool)),
            ValueError,
            r"mask shape \(2, 5\) != \(2, 4\)",
        ),
        (
            lambda s: s.update_demand(1, 2, np.full((2, 4), 2)),
            ValueError,
            r"a mask must be boolean \(or 0/1\)",
        ),
        (lambda s: s.set_resident(np.zeros((1, 2, 4))), ValueError, r"got shape \(1, 2, 4\)"),
        (lambda s: s.set_resident([9]), ValueError, r"resident experts: expert id 9 out of range"),
        (
            lambda s: s.set_expert_bytes(np.array([1, 2, 3, -4, 5, 6, 7, 8])),
            ValueError,
            r"expert size must be >= 0, got -4 for flat id 3",
        ),
        (lambda s: s.set_expert_bytes(np.ones(7, dtype=np.int64)), ValueError, r"got \(7,\)"),
        (lambda s: s.set_expert_bytes(np.ones(8)), TypeError, r"integers \(bytes\), got dtype"),
    ],
)
def test_bad_input_raises_clearly_and_leaves_state_unchanged(
    call: Any, exc: type[Exception], match: str
) -> None:
    s = make(max_tokens_per_item=None)
    s.add_request(1)
    s.add_request(2, 2.0)
    s.update_demand(1, 3, [0, 1])
    s.step()
    s.update_demand(2, 5, [2])
    before = snapshot(s)
    with pytest.raises(exc, match=match):
        call(s)
    assert snapshot(s) == before


def test_max_tokens_per_item_is_enforced() -> None:
    s = make(max_tokens_per_item=4)
    s.add_request(0)
    with pytest.raises(ValueError, match=r"1 \+ drafted_tokens = 5 exceeds max_tokens_per_item=4"):
        s.update_demand(0, 4, [])
    s.update_demand(0, 3, [])


def test_step_needs_expert_sizes_when_bytes_are_budgeted() -> None:
    s = VerifyScheduler(
        SchedulerConfig(token_budget=8, missing_byte_budget=10, num_layers=1, num_experts=2)
    )
    s.add_request(0)
    s.update_demand(0, 1, [0])
    with pytest.raises(RuntimeError, match="set_expert_bytes"):
        s.step()
    assert s.step_index == 0


def test_remove_unknown_or_finished_is_a_noop_and_removed_never_reappears() -> None:
    s = make()
    assert s.remove_request(7) is False
    s.add_request(1)
    s.add_request(2)
    s.update_demand(1, 3, [0])
    s.update_demand(2, 3, [1])
    assert s.remove_request(1) is True
    before = snapshot(s)
    assert s.remove_request(1) is False
    assert s.remove_request(-5) is False
    assert snapshot(s) == before
    for _ in range(3):
        r = s.step()
        assert 1 not in r.request_ids.tolist() and 1 not in r.live_request_ids.tolist()
        s.update_demand(2, 3, [1])


def test_reentering_request_starts_at_zero_credit_at_the_ring_end() -> None:
    s = make(T=16, M=None)
    for rid in (1, 2, 3):
        s.add_request(rid)
    run_order(s, 1, 3, [])
    assert s.deficit(1) > 0  # the head kept part of its quantum
    s.remove_request(1)
    s.add_request(1)
    assert s.deficit(1) == 0.0
    assert s.request_ids.tolist() == [2, 3, 1]


# ---------------------------------------------------------------- rules


def test_scan_order_round_robin_one_item_per_step() -> None:
    # Each demand asks for the whole token budget: one item per step, so the
    # documented order is plain ring order, the cursor advancing each step.
    s = make(T=16, M=None)
    for rid in (10, 20, 30):
        s.add_request(rid)
    assert run_order(s, 7, 15, []) == [[10], [20], [30], [10], [20], [30], [10]]


def test_scan_order_weight_two_keeps_the_head_for_two_items() -> None:
    # DRR visit continuation: request 20 (w=2) gets 2 quanta worth per lap.
    s = make(T=16, M=None)
    s.add_request(10)
    s.add_request(20, 2.0)
    s.add_request(30)
    order = run_order(s, 8, 15, [])
    assert order == [[10], [20], [20], [30], [10], [20], [20], [30]]


def test_scan_order_visit_continues_while_the_head_can_pay() -> None:
    # Three 4-token items fit each step; the head (0) keeps the cursor while
    # its quantum lasts (4 items of cost 1/4), then the head role rotates.
    s = make(T=16, M=None)
    for rid in range(3):
        s.add_request(rid)
    order = run_order(s, 6, 3, [])
    assert order == [[0, 1, 2]] * 4 + [[1, 2, 0]] * 2


def test_head_served_after_others_still_continues_its_visit() -> None:
    # The documented rule: "if the head was served" (anywhere in the batch,
    # not only first) and its credit covers the cost it just paid, the next
    # step starts at the head again.
    s = make(T=4, M=30, layers=1, experts=4)
    ref = ReferenceScheduler(4, 30, 1.0, None, 4)
    ref.set_expert_bytes([10] * 4)
    for rid in (0, 1):
        s.add_request(rid)
        ref.add_request(rid)

    def demand(rid: int, drafted: int, experts: list[int]) -> None:
        s.update_demand(rid, drafted, experts)
        ref.update_demand(rid, drafted, experts)

    demand(0, 1, [2])  # cost max(2/4, 10/30) = 0.5
    demand(1, 1, [3, 0, 1])  # 30 bytes = M: does not fit beside request 0
    r = s.step()
    assert r.request_ids.tolist() == ref.step().request_ids == [0]
    assert s._core.visit_open  # 0 paid 0.5 and holds 0.5
    demand(0, 0, [3, 1])  # alone 20/30 > its 0.5 of credit
    r = s.step()
    # 0 is the head but can only pay once 1 has brought experts 3 and 1 in
    assert r.request_ids.tolist() == [1, 0] and r.costs[1] == 0.25
    assert ref.step().request_ids == [1, 0]
    assert int(s._core.cursor_seq) == ref.cursor_seq == 0  # the head's seq
    assert s._core.visit_open and ref.visit_open
    demand(0, 0, [3, 1])
    demand(1, 0, [])
    r = s.step()
    assert r.request_ids.tolist() == ref.step().request_ids == [0, 1]  # starts at the head


def test_quantum_during_a_continued_visit_ends_the_turn() -> None:
    # Weight-2 request 0 alternates a one-token item and a full block; every
    # step it cannot pay, the others open a lap. The quantum it then receives
    # ends its turn, so the head passes on (the rule that restores liveness).
    s = make(T=6, M=20, layers=1, experts=3, quantum=1.5)
    s.add_request(0, 2.0)
    s.add_request(1)
    s.update_demand(0, 0, [2])  # cost max(1/6, 10/20) = 0.5
    s.update_demand(1, 4, [1, 0])  # cost 1.0, does not fit beside 0
    r = s.step()
    assert r.request_ids.tolist() == [0] and s._core.visit_open  # D = 3 - 0.5
    heads = []
    for step in range(8):
        s.update_demand(0, 6 if step % 2 == 0 else 0, [2])
        r = s.step()
        heads.append(r.request_ids.tolist())
        if s.pending_tokens(1) == 0:
            s.update_demand(1, 4, [1, 0])
    assert any(ids[:1] == [1] for ids in heads), heads


def test_marginal_bytes_charged_in_scan_order_union_not_sum() -> None:
    s = make(T=64, M=1000)
    s.add_request(0)
    s.add_request(1)
    s.set_resident([7])
    s.update_demand(0, 3, [0, 1, 7])  # 7 is resident: never charged
    s.update_demand(1, 3, [1, 2])  # 1 is already in the batch: not charged again
    r = s.step()
    assert r.request_ids.tolist() == [0, 1]
    assert r.marginal_bytes.tolist() == [20, 10]
    assert r.union_ids.tolist() == [0, 1, 2]
    assert r.missing_bytes == 30
    assert r.union_mask.reshape(-1).nonzero()[0].tolist() == [0, 1, 2]
    assert r.costs.tolist() == [max(4 / 64, 20 / 1000), max(4 / 64, 10 / 1000)]


def test_trimming_to_fit_the_token_budget_down_to_one_token() -> None:
    s = make(T=10, M=None)
    for rid in range(3):
        s.add_request(rid)
        s.update_demand(rid, 4, [])  # 5 tokens each
    s.update_demand(2, 0, [])  # 1 token
    r = s.step()
    # 5 + 5 fill the budget; nothing is left for the third (needs >= 1)
    assert r.request_ids.tolist() == [0, 1] and r.token_grants.tolist() == [5, 5]
    s2 = make(T=9, M=None)
    for rid in range(3):
        s2.add_request(rid)
        s2.update_demand(rid, 3 if rid < 2 else 6, [])  # 4, 4, 7 tokens
    r2 = s2.step()
    assert r2.request_ids.tolist() == [0, 1, 2]
    assert r2.token_grants.tolist() == [4, 4, 1]  # a one-token prefix
    assert r2.requested_tokens.tolist() == [4, 4, 7]
    assert r2.trimmed.tolist() == [False, False, True]
    # NOTE: a trimmed item is charged for what it was granted, not asked for
    assert r2.costs[2] == 1 / 9
    assert r2.tokens == 9
    # and its demand is consumed (the engine re-drafts)
    assert s2.pending_tokens(2) == 0


def test_token_only_mode_is_baseline_b2() -> None:
    s = make(T=32, M=None)
    for rid in range(3):
        s.add_request(rid)
        s.update_demand(rid, 7, [0, 1, 2, 3, 4, 5, 6, 7])  # 80 bytes each, unbounded
    r = s.step()
    assert r.request_ids.tolist() == [0, 1, 2]
    assert r.marginal_bytes.tolist() == [80, 0, 0]  # still reported for prefetch
    assert r.costs.tolist() == [8 / 32] * 3  # but never charged
    assert not r.oversize


def test_byte_budget_limits_the_batch_and_reports_the_union() -> None:
    s = make(T=64, M=30)
    for rid, ids in enumerate([[0, 1], [2, 3], [0, 1, 4]]):
        s.add_request(rid)
        s.update_demand(rid, 1, ids)
    r = s.step()
    # 0 costs 20 bytes, 1 would add 20 (> 10 left), 2 adds only expert 4 (10)
    assert r.request_ids.tolist() == [0, 2]
    assert r.marginal_bytes.tolist() == [20, 10]
    assert r.missing_bytes == 30
    r2 = s.step()
    assert r2.request_ids.tolist() == [1]


def test_oversize_item_runs_alone_then_others_proceed() -> None:
    s = make(T=64, M=25)
    s.add_request(0)
    s.add_request(1)
    s.update_demand(0, 1, [0, 1, 2, 3])  # 40 bytes > M: oversize
    s.update_demand(1, 1, [4])
    steps: list[StepResult] = []
    for _ in range(4):
        steps.append(s.step())
        if s.pending_tokens(1) == 0:
            s.update_demand(1, 1, [4])
    over = [r for r in steps if r.oversize]
    assert len(over) == 1
    assert over[0].request_ids.tolist() == [0] and over[0].missing_bytes == 40
    assert over[0].costs[0] == 40 / 25  # it pays its full dominant cost
    assert all(len(r) >= 1 for r in steps)
    assert all(r.missing_bytes <= 25 for r in steps if not r.oversize)


def test_request_cap() -> None:
    s = make(T=64, M=None, max_requests_per_step=2)
    for rid in range(4):
        s.add_request(rid)
        s.update_demand(rid, 0, [])
    r = s.step()
    assert len(r) == 2 and r.cap_reached


def test_idle_request_keeps_its_credit_and_gets_no_quantum() -> None:
    s = make(T=16, M=None)
    s.add_request(0)
    s.add_request(1)
    s.update_demand(0, 3, [])
    r = s.step()
    assert r.quanta.tolist() == [1.0, 0.0]
    d0 = s.deficit(0)
    for _ in range(3):
        r = s.step()  # nothing pending: empty steps, ledger untouched
        assert len(r) == 0 and r.quanta.tolist() == [0.0, 0.0]
    assert s.deficit(0) == d0


def test_determinism_same_events_same_schedule() -> None:
    def trace() -> list[tuple[Any, ...]]:
        rng = np.random.default_rng(7)
        s = make(T=24, M=60, layers=3, experts=8)
        s.set_expert_bytes(rng.integers(0, 20, size=(3, 8)))
        out = []
        for rid in (5, 3, 9, 1):
            s.add_request(rid, float(rng.choice([0.5, 1.0, 2.0])))
        for step in range(30):
            if step == 10:
                s.remove_request(3)
                s.add_request(3)
            for rid in s.request_ids.tolist():
                if s.pending_tokens(rid) == 0:
                    s.update_demand(
                        rid, int(rng.integers(0, 12)), rng.choice(24, size=5, replace=False)
                    )
            r = s.step()
            out.append(
                (
                    r.request_ids.tolist(),
                    r.token_grants.tolist(),
                    r.costs.tolist(),
                    r.deficits.tolist(),
                )
            )
        return out

    assert trace() == trace()


def test_union_results_are_read_only_views_until_the_next_step() -> None:
    s = make(T=64, M=1000)
    s.add_request(0)
    s.update_demand(0, 1, [0, 1])
    r = s.step()
    ids = r.union_ids
    assert ids.tolist() == [0, 1]
    with pytest.raises(ValueError):
        ids[0] = 5
    kept = ids.copy()
    s.update_demand(0, 1, [3])
    s.step()
    assert kept.tolist() == [0, 1]
    assert ids.tolist() == [3, 1][: len(ids)]  # the view now shows the new step's buffer


def test_demand_encodings_agree_and_an_empty_demand_clears_the_set() -> None:
    """Flat ids (any int dtype, repeats), a boolean mask and a 0/1 mask set
    the same bits, past the grid's 64-bit word boundary; an empty demand
    after a set one clears it (the empty set is one shared zero bitset)."""
    layers, experts = 3, 30  # 90 flat ids: two words
    s = make(T=64, M=10_000, layers=layers, experts=experts)
    s.add_request(0)
    ids = [0, 63, 64, 89, 64]
    mask = np.zeros((layers, experts), dtype=np.bool_)
    mask.reshape(-1)[ids] = True

    def demand_ids() -> list[int]:
        words = np.asarray(s._core.demand_bits(0), dtype="<u8")
        return np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")).tolist()

    seen = []
    for demand in (ids, np.array(ids, dtype=np.uint16), mask, mask.astype(np.int8)):
        s.update_demand(0, 1, demand)
        seen.append(demand_ids())
    assert seen == [[0, 63, 64, 89]] * 4
    s.update_demand(0, 1, [])
    assert demand_ids() == []
    s.update_demand(0, 1, [5])
    assert s.step().union_ids.tolist() == [5]
    s.update_demand(0, 1, np.zeros(0, dtype=np.int64))
    assert s.step().union_ids.tolist() == []
    # no experts named (None, the default): the empty set, after a set one too
    s.update_demand(0, 1, [5])
    s.update_demand(0, 2)
    assert demand_ids() == [] and s.pending_tokens(0) == 3
    assert s.step().union_ids.tolist() == []


def test_invariant_tracker_accepts_a_long_random_trace() -> None:
    rng = np.random.default_rng(3)
    cfg = SchedulerConfig(
        token_budget=40, missing_byte_budget=200, quantum=1.5, num_layers=4, num_experts=8
    )
    s = VerifyScheduler(cfg)
    tr = InvariantTracker(cfg)
    sizes = rng.integers(0, 50, size=32)
    s.set_expert_bytes(sizes)
    tr.set_sizes(sizes.tolist())
    for rid in range(12):
        w = float(rng.choice([0.5, 1.0, 2.0]))
        s.add_request(rid, w)
        tr.add(rid, w)
    for _ in range(200):
        for rid in s.request_ids.tolist():
            if s.pending_tokens(rid) == 0 and rng.random() < 0.8:
                d, ids = (
                    int(rng.integers(0, 16)),
                    rng.choice(32, size=int(rng.integers(0, 12)), replace=False),
                )
                s.update_demand(rid, d, ids)
                tr.update(rid, d, ids.tolist())
        tr.check_step(s.step())
    assert tr.steps == 200 and tr.max_wait_seen >= 1


# ---------------------------------------------------------------- policies


class CountingPolicy:
    def __init__(self) -> None:
        self.calls: list[PolicyInput] = []

    def weights(self, view: PolicyInput) -> npt.NDArray[np.float64]:
        self.calls.append(view)
        return view.base_weights * 2.0


def test_policy_is_called_once_per_step_with_arrays() -> None:
    policy = CountingPolicy()
    assert isinstance(policy, WeightPolicy)
    s = VerifyScheduler(SchedulerConfig(token_budget=16, num_layers=1, num_experts=2), policy)
    for rid in range(3):
        s.add_request(rid, 1.0 + rid)
        s.update_demand(rid, 3, [])
    r = s.step()
    assert len(policy.calls) == 1
    view = policy.calls[0]
    assert view.request_ids.tolist() == [0, 1, 2]
    assert view.base_weights.tolist() == [1.0, 2.0, 3.0]
    assert view.pending_tokens.tolist() == [4, 4, 4]
    assert view.steps_since_served.tolist() == [-1, -1, -1]
    assert r.quanta.tolist() == [2.0, 4.0, 6.0]  # the policy's weights were used
    s.step()
    assert len(policy.calls) == 2 and policy.calls[1].steps_since_served.tolist() == [1, 1, 1]


def test_bad_policy_output_raises_and_changes_nothing() -> None:
    class Bad:
        def weights(self, view: PolicyInput) -> npt.NDArray[np.float64]:
            return np.array([1.0, -1.0])

    s = VerifyScheduler(SchedulerConfig(token_budget=16, num_layers=1, num_experts=2), Bad())
    s.add_request(0)
    s.add_request(1)
    s.update_demand(0, 3, [])
    before = snapshot(s)
    with pytest.raises(ValueError, match=r"policy weight -1\.0 for request 1"):
        s.step()
    assert snapshot(s) == before


def test_fair_policy_is_the_identity() -> None:
    view = PolicyInput(
        0,
        np.array([1, 2]),
        np.array([1.0, 3.0]),
        np.zeros(2),
        np.zeros(2, np.int64),
        np.zeros(2, np.int64),
    )
    assert FairPolicy().weights(view).tolist() == [1.0, 3.0]


def test_deadline_policy_boosts_urgent_requests() -> None:
    policy = DeadlinePolicy(horizon=4, max_boost=3.0)
    policy.set_deadlines({1: 2, 2: 100})
    view = PolicyInput(
        step_index=2,
        request_ids=np.array([1, 2, 3]),
        base_weights=np.array([1.0, 1.0, 1.0]),
        deficits=np.zeros(3),
        pending_tokens=np.ones(3, dtype=np.int64),
        steps_since_served=np.zeros(3, dtype=np.int64),
    )
    assert policy.weights(view).tolist() == [3.0, 1.0, 1.0]
    view2 = PolicyInput(
        0, np.array([1]), np.array([1.0]), np.zeros(1), np.ones(1, np.int64), np.zeros(1, np.int64)
    )
    assert policy.weights(view2).tolist() == [2.0]  # halfway into the horizon
    policy.forget(1)
    assert policy.weights(view).tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="horizon"):
        DeadlinePolicy(horizon=0)


def test_deadline_policy_serves_the_urgent_request_more() -> None:
    def served(policy: WeightPolicy | None) -> int:
        s = VerifyScheduler(SchedulerConfig(token_budget=16, num_layers=1, num_experts=2), policy)
        for rid in range(4):
            s.add_request(rid)
        count = 0
        for _ in range(12):
            for rid in range(4):
                if s.pending_tokens(rid) == 0:
                    s.update_demand(rid, 15, [])
            count += int(3 in s.step().request_ids.tolist())
        return count

    policy = DeadlinePolicy(horizon=4, max_boost=4.0)
    policy.set_deadline(3, 0)  # already due: weight x4 from the start
    assert served(None) == 3
    assert served(policy) > served(None)


def test_expert_sizes_must_not_overflow_int64_sums() -> None:
    s = make()
    before = snapshot(s)
    with pytest.raises(ValueError, match=r"add up to more than 2\*\*62 bytes"):
        s.set_expert_bytes(np.full(8, 2**60, dtype=np.int64))
    with pytest.raises(ValueError, match="fit in int64"):
        s.set_expert_bytes(np.full(8, 2**63, dtype=np.uint64))
    assert snapshot(s) == before


def test_native_kernel_selection_is_reported() -> None:
    s = make()
    assert s._core.size_path() == "uniform"
    s.set_expert_bytes(np.array([[1, 1, 1, 1], [2, 2, 2, 2]]))  # one word: mixed sizes
    assert s._core.size_path() == "per_expert"


def test_only_integer_ids_name_requests() -> None:
    # True and 1.0 hash like 1: they must not reach request 1.
    sched = VerifyScheduler(SchedulerConfig(token_budget=64, num_layers=2, num_experts=4))
    sched.add_request(1)
    assert sched.remove_request(True) is False  # type: ignore[arg-type]
    assert sched.remove_request(1.0) is False  # type: ignore[arg-type]
    with pytest.raises(UnknownRequestError):
        sched.update_demand(True, 3, [0])  # type: ignore[arg-type]
    assert 1 in sched and sched.pending_tokens(1) == 0


def test_removed_request_leaves_the_policy_too() -> None:
    policy = DeadlinePolicy(horizon=4)
    cfg = SchedulerConfig(token_budget=64, num_layers=2, num_experts=4)
    sched = VerifyScheduler(cfg, policy=policy)
    sched.add_request(7)
    policy.set_deadline(7, 2)
    assert sched.remove_request(7) is True
    assert 7 not in policy.deadlines  # a reused id 7 must not inherit the deadline


def test_deadline_policy_rejects_infinite_boost() -> None:
    with pytest.raises(ValueError, match="finite"):
        DeadlinePolicy(max_boost=math.inf)


@pytest.mark.parametrize("with_policy", [False, True], ids=["fair", "deadline"])
def test_step_grants_decides_and_leaves_the_state_as_step(with_policy: bool) -> None:
    """``step_grants()`` and ``step()`` in lockstep on the same demands (a
    weight policy consulted each step, an invariant-checked core): the same
    batch, grants and missing union, and the same scheduler state after
    every step."""
    rng = np.random.default_rng(3)
    scheds = []
    for _ in range(2):
        policy = DeadlinePolicy(horizon=4, max_boost=3.0) if with_policy else None
        s = VerifyScheduler(
            SchedulerConfig(token_budget=24, missing_byte_budget=60, num_layers=2, num_experts=4),
            policy=policy,
        )
        s.set_expert_bytes(np.full((2, 4), 10, dtype=np.int64))
        for rid in range(5):
            s.add_request(rid, weight=1.0 + rid % 2)
        if policy is not None:
            policy.set_deadline(3, 2)
        scheds.append(s)
    full, lean = scheds
    served = 0
    for step in range(60):
        resident = (rng.random(8) < 0.4).reshape(2, 4)
        for s in scheds:
            s.set_resident(resident)
        for rid in full.request_ids.tolist():
            if full.pending_tokens(rid) == 0:
                drafted = int(rng.integers(0, 12))
                experts = np.flatnonzero(rng.random(8) < 0.3)
                for s in scheds:
                    s.update_demand(rid, drafted, experts)
        a, b = full.step(), lean.step_grants()
        assert b.request_ids == a.request_ids.tolist(), step
        assert b.token_grants == a.token_grants.tolist()
        assert b.union_ids.tolist() == a.union_ids.tolist()
        assert snapshot(lean) == snapshot(full)
        served += len(b.request_ids)
    assert served > 60
