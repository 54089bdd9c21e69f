"""The marginal rule (docs/scheduler.md rule 4.4): with ``fixed_step_bytes``
``F`` set, ``M`` is soft against shared experts.

Deterministic cases built on the schedprobe finding (requests that share
most of their experts: a split re-copies the shared ones and pays another
step's fixed time), a request with unique heavy experts beside them (it
must still be served within the proved liveness bound), and a
hypothesis test with periodic shared demand. Every step is checked against
the reference (10) and by the from-scratch :class:`InvariantTracker`.
"""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings, target
from hypothesis_budget import scaled
from scheduler_helpers import reference_for

from pdflash import SchedulerConfig, VerifyScheduler
from pdflash._reference.scheduler import ReferenceScheduler, ReferenceStep
from pdflash._reference.scheduler_checks import InvariantTracker
from pdflash.scheduler import StepResult
from pdflash.scheduler.bounds import liveness_bound

pytestmark = pytest.mark.native

# the schedprobe's shape: 8 requests, each missing the 9 shared experts and
# one of 3 more (one request alone: 9-10 experts; all 8 together: 12)
EXPERT_BYTES = 6000
SHARED = list(range(9))
OWN = [9, 10, 11]
M_PROBE = 60_000  # below the full batch's 72 000 missing bytes
F_PROBE = 150_000  # t_fixed 15 ms x 10 MB/s


def assert_same(native: StepResult, ref: ReferenceStep, core: Any) -> None:
    """Invariant 10: the native step equals the reference, floats included."""
    assert native.request_ids.tolist() == ref.request_ids
    assert native.token_grants.tolist() == ref.token_grants
    assert native.marginal_bytes.tolist() == ref.marginal_bytes
    assert native.costs.tolist() == ref.costs
    assert native.union_ids.tolist() == ref.union_ids
    assert native.deficits.tolist() == ref.deficits
    assert native.quanta.tolist() == ref.quanta
    assert (native.lap, native.oversize, native.cap_reached) == (
        ref.lap,
        ref.oversize,
        ref.cap_reached,
    )
    assert (int(core.cursor_seq), bool(core.visit_open)) == (
        ref.next_cursor_seq,
        ref.next_visit_open,
    )


class Driver:
    """One scheduler, its reference and its invariant tracker, same events."""

    def __init__(self, cfg: SchedulerConfig, expert_bytes: int = EXPERT_BYTES) -> None:
        self.cfg = cfg
        self.sched = VerifyScheduler(cfg)
        self.ref = reference_for(cfg)
        self.tracker = InvariantTracker(cfg)
        sizes = [expert_bytes] * cfg.num_flat
        self.sched.set_expert_bytes(np.array(sizes, dtype=np.int64))
        self.ref.set_expert_bytes(sizes)
        self.tracker.set_sizes(sizes)

    def add(self, rid: int, weight: float = 1.0) -> None:
        self.sched.add_request(rid, weight)
        self.ref.add_request(rid, weight)
        self.tracker.add(rid, weight)

    def demand(self, rid: int, drafted: int, ids: list[int]) -> None:
        self.sched.update_demand(rid, drafted, np.array(ids, dtype=np.int64))
        self.ref.update_demand(rid, drafted, ids)
        self.tracker.update(rid, drafted, ids)

    def step(self) -> StepResult:
        result = self.sched.step()
        assert_same(result, self.ref.step(), self.sched._core)
        self.tracker.check_step(result)
        return result


def _probe_config(fixed: int | None, byte_budget: int | None = M_PROBE) -> SchedulerConfig:
    return SchedulerConfig(
        token_budget=64,
        missing_byte_budget=byte_budget,
        num_layers=1,
        num_experts=32,
        fixed_step_bytes=fixed,
    )


def _shared_demand(rid: int) -> list[int]:
    return sorted({*SHARED, OWN[rid % len(OWN)]})


def _run_probe(fixed: int | None, byte_budget: int | None, steps: int) -> list[list[int]]:
    """Eight always-backlogged requests of 7 tokens on the shared demand."""
    d = Driver(_probe_config(fixed, byte_budget))
    for rid in range(8):
        d.add(rid)
    batches = []
    for _ in range(steps):
        for rid in range(8):
            if d.sched.pending_tokens(rid) == 0:
                d.demand(rid, 6, _shared_demand(rid))
        batches.append(sorted(d.step().request_ids.tolist()))
    return batches


def test_shared_experts_are_not_split_under_the_marginal_rule() -> None:
    token_only = _run_probe(None, None, 30)
    hard = _run_probe(None, M_PROBE, 30)
    marginal = _run_probe(F_PROBE, M_PROBE, 30)
    assert all(len(b) == 8 for b in token_only)
    # the finding: a hard M below the union serves only requests with the
    # same own expert together (at most 3 of the 8)
    assert max(len(b) for b in hard) <= 3
    # the marginal rule admits the rest: each adds <= 6000 B for 7 tokens,
    # far below the batch's (F + B) / tokens, so the step is the token-only one
    assert marginal == token_only


def test_marginal_rule_with_no_fixed_time_still_admits_cheaper_items() -> None:
    """``F = 0``: an item joins past ``M`` iff its bytes per token are below
    the batch's; the shared demand's later items (one expert for 7 tokens)
    are, so the batch is still whole."""
    assert _run_probe(0, M_PROBE, 10) == _run_probe(None, None, 10)


def test_rate_test_is_the_modelled_tokens_per_second() -> None:
    """``g (F + B) > tokens mb`` is exactly ``(tok + g) / t(tok + g, B + mb)
    > tok / t(tok, B)`` under ``t = t_fixed + t_tok tok + bytes / link``,
    for any ``t_tok``: checked against the rates on a grid (exact
    rationals)."""
    from fractions import Fraction

    ref = ReferenceScheduler(64, 1000, 1.0, None, 4, 300)
    link = Fraction(7)
    t_fixed = Fraction(300) / link
    for t_tok in (Fraction(0), Fraction(1, 3), Fraction(5)):
        for tok in (1, 7, 30):
            for missing in (0, 200, 900):
                for g in (1, 5):
                    for mb in (0, 50, 400, 1000, 1001):
                        before = tok / (t_fixed + t_tok * tok + missing / link)
                        after = (tok + g) / (t_fixed + t_tok * (tok + g) + (missing + mb) / link)
                        expect = after > before and mb <= 1000
                        assert ref.raises_rate(g, mb, tok, missing) == expect


def test_heavy_unique_request_is_served_within_the_liveness_bound() -> None:
    """Request 8 needs 10 experts no other request routes to (60 000 B, a
    normal item): beside the shared batch its 7 tokens do not pay for
    their bytes, so the marginal rule never admits it there. It waits for
    the head position and its credit (one quantum per lap) and is served
    alone, within the proved bound, every time."""
    cfg = SchedulerConfig(
        token_budget=64,
        missing_byte_budget=M_PROBE,
        num_layers=1,
        num_experts=32,
        fixed_step_bytes=F_PROBE,
    )
    heavy = list(range(12, 22))
    d = Driver(cfg)
    for rid in range(9):
        d.add(rid)
    served_heavy = []
    waits = []
    waiting = 0
    for step in range(300):
        for rid in range(9):
            if d.sched.pending_tokens(rid) == 0:
                d.demand(rid, 6, heavy if rid == 8 else _shared_demand(rid))
        result = d.step()
        ids = result.request_ids.tolist()
        if 8 in ids:
            served_heavy.append(step)
            waits.append(waiting)
            waiting = 0
        else:
            waiting += 1
    bound = liveness_bound(cfg, n=9, c_max=1.0, w_min=1.0, w_max=1.0)
    assert len(served_heavy) >= 10, served_heavy
    assert max(waits) <= bound
    # it is served at its turn of the ring: about once per nine steps
    assert max(waits) <= 2 * 9, waits
    assert d.tracker.marginal_admissions > 0
    assert d.tracker.max_wait_ratio <= 1.0


def test_config_and_setter_validation_leave_state_unchanged() -> None:
    with pytest.raises(ValueError, match="fixed_step_bytes must be None or an int >= 0"):
        _probe_config(-1)
    with pytest.raises(ValueError, match="fixed_step_bytes must be None or an int >= 0"):
        _probe_config(True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="exceeds 2\\*\\*62"):
        _probe_config(2**60)
    assert not _probe_config(100, None).marginal_rule
    assert _probe_config(0).marginal_rule
    sched = VerifyScheduler(_probe_config(None))
    sched.set_expert_bytes(np.full(32, EXPERT_BYTES, dtype=np.int64))
    with pytest.raises(ValueError, match="exceeds 2\\*\\*62"):
        sched.set_fixed_step_bytes(2**57)
    assert sched.fixed_step_bytes is None
    assert int(sched._core.fixed_bytes) == -1
    sched.set_fixed_step_bytes(F_PROBE)
    assert sched.fixed_step_bytes == F_PROBE
    with pytest.raises(ValueError, match="exceeds 2\\*\\*62"):
        sched.set_expert_bytes(np.full(32, 2**56, dtype=np.int64))
    assert sched.fixed_step_bytes == F_PROBE
    token_only = VerifyScheduler(_probe_config(F_PROBE, None))
    assert token_only.fixed_step_bytes is None
    with pytest.raises(ValueError, match="token-only"):
        token_only.set_fixed_step_bytes(F_PROBE)


def test_setter_switches_the_rule_between_steps() -> None:
    """``set_fixed_step_bytes`` takes effect at the next step, on the same
    ledger: None makes M hard again."""
    d = Driver(_probe_config(F_PROBE))
    for rid in range(8):
        d.add(rid)
    sizes = []
    for step in range(12):
        if step == 6:
            d.sched.set_fixed_step_bytes(None)
            d.ref.set_fixed_step_bytes(None)
            d.tracker.set_fixed_step_bytes(None)
        for rid in range(8):
            if d.sched.pending_tokens(rid) == 0:
                d.demand(rid, 6, _shared_demand(rid))
        sizes.append(len(d.step()))
    assert sizes[:6] == [8] * 6
    assert max(sizes[6:]) <= 3


@st.composite
def shared_runs(draw: Any) -> dict[str, Any]:
    experts = draw(st.integers(4, 12))
    T = draw(st.integers(2, 40))
    size = draw(st.integers(1, 30))
    common = draw(st.integers(1, experts - 1))
    return {
        "cfg": SchedulerConfig(
            token_budget=T,
            missing_byte_budget=draw(st.integers(1, (common + 1) * size)),
            quantum=draw(st.sampled_from([1.0, 1.5, 2.0])),
            max_requests_per_step=draw(st.sampled_from([None, None, 3])),
            num_layers=1,
            num_experts=experts,
            fixed_step_bytes=draw(st.integers(0, 40 * size)),
        ),
        "size": size,
        "common": common,
        "n": draw(st.integers(2, 6)),
        "weights": draw(st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=6, max_size=6)),
        "period": draw(st.integers(1, 4)),
        "heavy": draw(st.booleans()),
        "drafts": draw(st.lists(st.integers(0, T + 2), min_size=4, max_size=4)),
        "replace": draw(st.booleans()),
    }


@settings(max_examples=scaled(40))
@given(run=shared_runs())
def test_periodic_shared_demand_keeps_every_invariant(run: dict[str, Any]) -> None:
    """Periodic demand over a common expert set plus one own expert each
    (the own expert rotates with the period), optionally beside a request
    asking for every other expert; all requests backlogged. Native ==
    reference, the tracker's invariants (2a/2b under the rule, 4, 5, 7, 9)
    every step, and the longest wait against the proved bound."""
    cfg: SchedulerConfig = run["cfg"]
    d = Driver(cfg, run["size"])
    n, common = run["n"], list(range(run["common"]))
    rest = list(range(run["common"], cfg.num_flat))
    for rid in range(n):
        d.add(rid, run["weights"][rid])
    for step in range(120):
        phase = step % run["period"]
        for rid in range(n):
            if run["replace"] or d.sched.pending_tokens(rid) == 0:
                drafted = run["drafts"][phase]
                if run["heavy"] and rid == 0:
                    d.demand(rid, drafted, rest)
                else:
                    own = rest[(rid + phase) % len(rest)]
                    d.demand(rid, drafted, sorted({*common, own}))
        d.step()
    target(d.tracker.max_wait_ratio, label="longest wait / proved bound")
    target(float(d.tracker.marginal_admissions), label="marginal admissions")


def test_an_oversize_head_takes_the_requests_that_share_its_experts() -> None:
    """``M`` below one request's own missing bytes (54-60 KB here): a hard
    ``M`` runs every head alone (the oversize exception), one request a
    step; under the marginal rule the others join it (each adds at most one
    expert for 7 tokens), so the step is the token-only one."""
    small_m = 50_000
    hard = _run_probe(None, small_m, 12)
    assert all(len(b) == 1 for b in hard)
    marginal = _run_probe(F_PROBE, small_m, 12)
    assert marginal == _run_probe(None, None, 12)
    d = Driver(_probe_config(F_PROBE, small_m))
    for rid in range(8):
        d.add(rid)
        d.demand(rid, 6, _shared_demand(rid))
    result = d.step()
    assert result.oversize and len(result) == 8
    assert result.marginal_bytes[0] > small_m
