"""Liveness of the verify scheduler under demand that changes with a short
period (issue 12, item 5), against the public API and the reference.

The trace below starved request 1 forever under the earlier rules: request 0
(weight 2) alternates between an empty and a full draft block, so it stayed
the head, received a fresh quantum whenever another request opened a lap,
and request 1 (which never fits beside it) was never the head again.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdflash import SchedulerConfig, VerifyScheduler
from pdflash._reference.scheduler import ReferenceScheduler
from pdflash.scheduler.bounds import fairness_bound, liveness_bound, turn_bound, visit_bound

pytestmark = pytest.mark.native

STEPS = 1200

# (drafted tokens, predicted flat expert ids); request 0 alternates per step
ALTERNATING = [(0, [2]), (6, [2])]
STEADY = {1: (4, [1, 0]), 2: (5, [2, 0])}
WEIGHTS = [2.0, 1.0, 1.0]
CONFIG = SchedulerConfig(
    token_budget=6, missing_byte_budget=20, quantum=1.5, num_layers=1, num_experts=3
)


def _demand(rid: int, step: int) -> tuple[int, list[int]]:
    return ALTERNATING[step % 2] if rid == 0 else STEADY[rid]


def _waits(served_at: list[list[int]]) -> list[int]:
    """Longest run of steps each request went unserved (all are always backlogged)."""
    longest = [0] * len(WEIGHTS)
    last = [-1] * len(WEIGHTS)
    for step, ids in enumerate(served_at):
        for rid in ids:
            last[rid] = step
        for rid in range(len(WEIGHTS)):
            longest[rid] = max(longest[rid], step - last[rid])
    return longest


def test_alternating_empty_drafts_cannot_starve_another_request() -> None:
    sched = VerifyScheduler(CONFIG)
    ref = ReferenceScheduler(6, 20, 1.5, None, 3)
    sched.set_expert_bytes(np.full((1, 3), 10, dtype=np.int64))
    ref.set_expert_bytes([10, 10, 10])
    for rid, w in enumerate(WEIGHTS):
        sched.add_request(rid, w)
        ref.add_request(rid, w)
    native_served: list[list[int]] = []
    ref_served: list[list[int]] = []
    for step in range(STEPS):
        for rid in range(len(WEIGHTS)):  # every request re-drafts every step
            drafted, experts = _demand(rid, step)
            sched.update_demand(rid, drafted, np.array(experts, dtype=np.int64))
            ref.update_demand(rid, drafted, experts)
        native_served.append(sched.step().request_ids.tolist())
        ref_served.append(ref.step().request_ids)
    assert native_served == ref_served
    # the largest cost is 1.0 (a full token budget, or exactly M bytes)
    bound = liveness_bound(CONFIG, n=3, c_max=1.0, w_min=1.0, w_max=2.0)
    assert bound < STEPS
    waits = _waits(native_served)
    assert max(waits) <= bound, f"longest waits {waits} exceed the proved bound {bound}"
    counts = [sum(rid in ids for ids in native_served) for rid in range(len(WEIGHTS))]
    # every request keeps being served through the whole trace
    assert all(sum(rid in ids for ids in native_served[-bound:]) > 0 for rid in range(3)), counts


def test_bound_formulas_by_hand() -> None:
    # W = ceil(6 * 3 * (1 + 2 * 2 * 1.5)) = 126, k = ceil(1 / 1.5) = 1,
    # visit = ceil(6 * (1 + 2 * 1.5)) + 2 = 26, L = 1 * 127 + 26 = 153
    assert visit_bound(CONFIG, 1.0, 2.0) == 26
    assert turn_bound(CONFIG, 3, 1.0, 1.0, 2.0) == 153
    assert liveness_bound(CONFIG, n=3, c_max=1.0, w_min=1.0, w_max=2.0) == 3 * 153 + 1
    assert fairness_bound(CONFIG, 1.0, 1.0, 2.0) == 3 * 1.5 + 1.0 + 0.5
    with pytest.raises(ValueError, match="n must be >= 1"):
        liveness_bound(CONFIG, n=0, c_max=1.0, w_min=1.0, w_max=1.0)
    with pytest.raises(ValueError, match="c_max must be finite and > 0"):
        fairness_bound(CONFIG, math.inf, 1.0, 1.0)
    with pytest.raises(ValueError, match="w_min <= w_max"):
        turn_bound(CONFIG, 2, 1.0, 2.0, 1.0)
