"""The deficit batcher's uncontended steps (``DeficitBatcher`` docstring):
a step whose demands fit the token budget together and name no predicted
expert is granted whole without the scheduler. Checked here: the scheduler
itself (native and reference) grants such a step whole after any history,
so the batcher's answer is the scheduler's; the scheduler's state is left
alone; demands it still holds from before are withdrawn before it runs
again; a contended step, a predicted expert or bad input reaches it."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis_budget import scaled

from pdflash import SchedulerConfig, VerifyScheduler
from pdflash._reference.scheduler import ReferenceScheduler
from pdflash.engine.batching import DeficitBatcher, VerifyDemand
from pdflash.scheduler.core import UnknownRequestError

pytestmark = pytest.mark.native

LAYERS, EXPERTS, NBYTES = 2, 8, 100


def _batcher(token_budget: int, byte_budget: int | None = None) -> DeficitBatcher:
    return DeficitBatcher(
        token_budget=token_budget,
        byte_budget=byte_budget,
        num_layers=LAYERS,
        num_experts=EXPERTS,
        expert_nbytes=NBYTES,
    )


@settings(max_examples=scaled(60), deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 6),
    token_budget=st.integers(4, 40),
    two_d=st.booleans(),
    history=st.integers(0, 12),
)
def test_the_scheduler_grants_an_uncontended_step_whole(
    seed: int, n: int, token_budget: int, two_d: bool, history: int
) -> None:
    """After any history of contended steps (random weights, demands and
    predicted experts), a step whose demanding requests fit ``T`` together
    with no predicted expert is served whole by the native scheduler and the
    reference alike: the set the batcher grants without them."""
    rng = np.random.default_rng(seed)
    byte_budget = 3 * NBYTES if two_d else None
    cfg = SchedulerConfig(
        token_budget=token_budget,
        missing_byte_budget=byte_budget,
        num_layers=LAYERS,
        num_experts=EXPERTS,
    )
    native = VerifyScheduler(cfg)
    ref = ReferenceScheduler(token_budget, cfg.byte_budget, cfg.quantum, None, cfg.num_flat)
    native.set_expert_bytes(np.full((LAYERS, EXPERTS), NBYTES, dtype=np.int64))
    ref.set_expert_bytes([NBYTES] * cfg.num_flat)
    for rid in range(n):
        w = float(rng.choice([0.25, 1.0, 3.0]))
        native.add_request(rid, w)
        ref.add_request(rid, w)
    for _ in range(history):
        for rid in range(n):
            if rng.random() < 0.8:
                drafted = int(rng.integers(0, token_budget))
                pred = rng.choice(cfg.num_flat, size=int(rng.integers(0, 5)), replace=False)
                native.update_demand(rid, drafted, pred)
                ref.update_demand(rid, drafted, pred.tolist())
        native.step()
        ref.step()
    # the uncontended step: a subset demands, the others hold no demand
    demanding = [rid for rid in range(n) if rng.random() < 0.7] or [0]
    left = token_budget
    want = {}
    for rid in demanding:
        tokens = int(rng.integers(1, max(2, left // len(demanding) + 1)))
        tokens = min(tokens, left)
        if tokens < 1:
            break
        want[rid] = tokens
        left -= tokens
    for rid in range(n):
        if rid in want:
            native.update_demand(rid, want[rid] - 1)
            ref.update_demand(rid, want[rid] - 1)
        else:
            native.clear_demand(rid)
            ref.clear_demand(rid)
    got_native = native.step()
    got_ref = ref.step()
    assert (
        dict(zip(got_native.request_ids.tolist(), got_native.token_grants.tolist(), strict=True))
        == want
    )
    assert dict(zip(got_ref.request_ids, got_ref.token_grants, strict=True)) == want


def test_an_uncontended_step_leaves_the_scheduler_alone() -> None:
    b = _batcher(token_budget=32, byte_budget=4 * NBYTES)
    for rid in (7, 3, 5):
        b.add(rid)
    deficits = [b.scheduler.deficit(rid) for rid in (7, 3, 5)]
    steps = b.scheduler.step_index
    decision = b.select(
        [VerifyDemand(7, 9), VerifyDemand(3, 16), VerifyDemand(5, 4)], resident=None
    )
    assert decision.grants == [(7, 9), (3, 16), (5, 4)]  # whole, in the demands' order
    assert decision.missing.size == 0
    assert b.uncontended_steps == 1
    assert b.scheduler.step_index == steps
    assert [b.scheduler.deficit(rid) for rid in (7, 3, 5)] == deficits


def test_a_contended_step_reaches_the_scheduler_and_trims() -> None:
    b = _batcher(token_budget=10)
    for rid in (1, 2):
        b.add(rid)
    decision = b.select([VerifyDemand(1, 6), VerifyDemand(2, 6)], resident=None)
    assert b.uncontended_steps == 0
    assert b.scheduler.step_index == 1
    assert sum(g for _, g in decision.grants) == 10
    assert sorted(rid for rid, _ in decision.grants) == [1, 2]


def test_a_predicted_expert_reaches_the_scheduler() -> None:
    b = _batcher(token_budget=64, byte_budget=4 * NBYTES)
    b.add(1)
    pred = np.array([0, 9], dtype=np.int64)
    decision = b.select([VerifyDemand(1, 4, pred)], resident=None)
    assert b.uncontended_steps == 0
    assert b.scheduler.step_index == 1
    assert decision.grants == [(1, 4)]
    assert decision.missing.tolist() == [0, 9]  # the scheduler's missing union
    # an empty prediction names nothing: uncontended again
    b.select([VerifyDemand(1, 4, np.zeros(0, dtype=np.int64))], resident=None)
    assert b.uncontended_steps == 1


def test_demands_served_since_are_withdrawn_before_the_scheduler_runs() -> None:
    """A demand the scheduler left pending (no tokens left for it) and an
    uncontended step then served must not be granted by the next contended
    step that does not name it."""
    b = _batcher(token_budget=10)
    for rid in (1, 2, 3):
        b.add(rid)
    first = b.select([VerifyDemand(1, 6), VerifyDemand(2, 4), VerifyDemand(3, 5)], None)
    left_out = {1, 2, 3} - {rid for rid, _ in first.grants}
    assert left_out, "the first step must leave a demand pending"
    b.select([VerifyDemand(1, 3), VerifyDemand(2, 3), VerifyDemand(3, 3)], None)
    assert b.uncontended_steps == 1
    (stale,) = left_out
    others = [rid for rid in (1, 2, 3) if rid != stale]
    third = b.select([VerifyDemand(rid, 7) for rid in others], None)
    assert {rid for rid, _ in third.grants} <= set(others)
    assert b.scheduler.pending_tokens(stale) == 0


def test_a_held_demand_not_renewed_reaches_the_scheduler() -> None:
    """A demand the scheduler holds (not granted) is pending: a step that
    does not renew it is the scheduler's, which serves it."""
    b = _batcher(token_budget=10)
    for rid in (1, 2, 3):
        b.add(rid)
    first = b.select([VerifyDemand(1, 6), VerifyDemand(2, 4), VerifyDemand(3, 5)], None)
    (held,) = {1, 2, 3} - {rid for rid, _ in first.grants}
    others = [rid for rid in (1, 2, 3) if rid != held]
    second = b.select([VerifyDemand(rid, 2) for rid in others], None)
    assert b.uncontended_steps == 0
    assert held in {rid for rid, _ in second.grants}


def test_input_the_scheduler_rejects_is_still_rejected() -> None:
    b = _batcher(token_budget=32)
    b.add(1)
    with pytest.raises(UnknownRequestError):
        b.select([VerifyDemand(2, 3)], None)
    with pytest.raises(ValueError):
        b.select([VerifyDemand(1, 0)], None)
    assert b.uncontended_steps == 0
    capped = DeficitBatcher(
        token_budget=32,
        byte_budget=None,
        num_layers=LAYERS,
        num_experts=EXPERTS,
        expert_nbytes=NBYTES,
        max_tokens_per_item=4,
    )
    capped.add(1)
    with pytest.raises(ValueError, match="max_tokens_per_item"):
        capped.select([VerifyDemand(1, 5)], None)
