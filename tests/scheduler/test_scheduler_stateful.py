"""Stateful hypothesis tests of the verify scheduler (docs/design.md §4).

Every generated trace drives three things with the same events: the native
:class:`pdflash.VerifyScheduler`, the pure-Python reference, and an
:class:`InvariantTracker` that recomputes every invariant from scratch after
each step, the proved liveness bound (7) included. Native and reference must
agree exactly on every step (10).

Besides random events, the traces carry adversarial demand: periodic
programs (period 1..4 alternations of empty and non-empty drafts, of expert
sets and of byte costs), demand chosen to make the head's item as costly as
possible, and bursts of small items that form large batches. Under the
marginal rule (``fixed_step_bytes`` set: ``M`` soft against shared experts)
they add demand where shared experts make splitting a batch costly (every
request routes to a common set plus a little of its own) beside a request
with unique heavy experts that the rule must not starve.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import event, example, given, settings, target
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from hypothesis_budget import scaled
from scheduler_helpers import reference_for

from pdflash import SchedulerConfig, VerifyScheduler
from pdflash._reference.scheduler import ReferenceScheduler, ReferenceStep
from pdflash._reference.scheduler_checks import InvariantTracker
from pdflash.scheduler import StepResult, UnknownRequestError
from pdflash.scheduler.bounds import fairness_bound, visit_bound

pytestmark = [pytest.mark.native, pytest.mark.property]

RIDS = st.integers(0, 6)
WEIGHTS = st.sampled_from([0.25, 0.5, 1.0, 2.0, 3.0])


@st.composite
def configs(draw: Any) -> SchedulerConfig:
    layers = draw(st.integers(1, 3))
    experts = draw(st.integers(2, 8))
    return SchedulerConfig(
        token_budget=draw(st.integers(1, 40)),
        missing_byte_budget=draw(st.one_of(st.none(), st.integers(1, 300))),
        quantum=draw(st.sampled_from([1.0, 1.5, 3.0])),
        max_requests_per_step=draw(st.one_of(st.none(), st.integers(1, 4))),
        num_layers=layers,
        num_experts=experts,
        fixed_step_bytes=draw(st.one_of(st.none(), st.integers(0, 600))),
    )


Demand = tuple[int, tuple[int, ...]]  # (drafted tokens, predicted flat ids)


@st.composite
def demand_programs(draw: Any, num_flat: int, token_budget: int) -> list[Demand]:
    """A periodic demand sequence (period 1..4) of one of the adversarial
    shapes: drafts alternating between empty and non-empty, alternating
    expert sets, alternating byte cost (none / everything), or free form."""
    period = draw(st.integers(1, 4))
    kind = draw(st.sampled_from(["drafts", "experts", "bytes", "shared", "free"]))
    experts = st.lists(st.integers(0, num_flat - 1), max_size=num_flat, unique=True)
    big = max(0, token_budget - 1)
    base = tuple(sorted(draw(experts)))
    program: list[Demand] = []
    for k in range(period):
        if kind == "shared":  # the common set (the first half) plus one expert of its own
            common = tuple(range(max(1, num_flat // 2)))
            own = draw(st.integers(0, num_flat - 1))
            program.append((draw(st.integers(0, big)), tuple(sorted({*common, own}))))
            continue
        if kind == "drafts":  # empty, non-empty, empty, ...
            program.append((0 if k % 2 == 0 else draw(st.integers(1, big + 8)), base))
        elif kind == "experts":
            program.append((draw(st.integers(0, big)), tuple(sorted(draw(experts)))))
        elif kind == "bytes":  # nothing missing, then everything
            program.append(
                (draw(st.integers(0, big)), () if k % 2 == 0 else tuple(range(num_flat)))
            )
        else:
            program.append((draw(st.integers(0, big + 8)), tuple(sorted(draw(experts)))))
    return program


def assert_same(native: StepResult, ref: ReferenceStep, core: Any) -> None:
    """Invariant 10: the native result equals the reference, floats included."""
    assert native.request_ids.tolist() == ref.request_ids
    assert native.requested_tokens.tolist() == ref.requested_tokens
    assert native.token_grants.tolist() == ref.token_grants
    assert native.marginal_bytes.tolist() == ref.marginal_bytes
    assert native.costs.tolist() == ref.costs
    assert native.union_ids.tolist() == ref.union_ids
    assert native.live_request_ids.tolist() == ref.live_request_ids
    assert native.deficits.tolist() == ref.deficits
    assert native.quanta.tolist() == ref.quanta
    assert native.lap == ref.lap
    assert native.oversize == ref.oversize
    assert native.cap_reached == ref.cap_reached
    assert int(core.cursor_seq) == ref.next_cursor_seq
    assert bool(core.visit_open) == ref.next_visit_open


class SchedulerMachine(RuleBasedStateMachine):
    sched: VerifyScheduler
    ref: ReferenceScheduler
    tracker: InvariantTracker

    @initialize(cfg=configs(), data=st.data())
    def setup(self, cfg: SchedulerConfig, data: st.DataObject) -> None:
        self.cfg = cfg
        self.sched = VerifyScheduler(cfg)
        self.ref = reference_for(cfg)
        self.tracker = InvariantTracker(cfg)
        self.programs: dict[int, list[Demand]] = {}
        self.phase = 0
        self.max_batch = 0
        self.visit_head: int | None = None
        self.visit_run = 0
        sizes = data.draw(
            st.lists(st.integers(0, 60), min_size=cfg.num_flat, max_size=cfg.num_flat)
        )
        if data.draw(st.booleans()):  # uniform sizes take the popcount path
            sizes = [sizes[0]] * cfg.num_flat
        self.sched.set_expert_bytes(np.array(sizes, dtype=np.int64).reshape(cfg.num_layers, -1))
        self.ref.set_expert_bytes(sizes)
        self.tracker.set_sizes(sizes)
        self.steps = 0
        for rid in range(data.draw(st.integers(0, 4))):
            weight = data.draw(WEIGHTS)
            self.sched.add_request(rid, weight)
            self.ref.add_request(rid, weight)
            self.tracker.add(rid, weight)

    def _set_demand(self, rid: int, drafted: int, ids: list[int]) -> None:
        self.sched.update_demand(rid, drafted, np.array(ids, dtype=np.int64))
        self.ref.update_demand(rid, drafted, ids)
        self.tracker.update(rid, drafted, ids)

    def _scan_head(self) -> int | None:
        """The next step's head: the first request with demand at or after
        the cursor, in ring order (wrapping)."""
        core = self.sched._core
        rids = self.sched.request_ids.tolist()
        seqs = core.seqs().tolist()
        pending = core.pending_tokens().tolist()
        order = [k for k, q in enumerate(seqs) if q >= core.cursor_seq]
        order += [k for k, q in enumerate(seqs) if q < core.cursor_seq]
        return next((rids[k] for k in order if pending[k] > 0), None)

    def _head(self) -> int | None:
        """The request the cursor names (the next step's head if it has demand)."""
        core = self.sched._core
        seqs = core.seqs().tolist()
        if not seqs:
            return None
        k = next((i for i, q in enumerate(seqs) if q >= core.cursor_seq), 0)
        return int(self.sched.request_ids[k])

    def _experts(self, data: st.DataObject) -> list[int]:
        n = self.cfg.num_flat
        return data.draw(st.lists(st.integers(0, n - 1), max_size=2 * n, unique=True))

    def _as_input(self, ids: list[int], as_mask: bool) -> Any:
        if not as_mask:
            return np.array(ids, dtype=np.int64)
        mask = np.zeros(self.cfg.num_flat, dtype=bool)
        mask[ids] = True
        return mask.reshape(self.cfg.num_layers, self.cfg.num_experts)

    def _snapshot(self) -> tuple[Any, ...]:
        core = self.sched._core
        return (
            self.sched.request_ids.tolist(),
            core.deficits().tolist(),
            core.pending_tokens().tolist(),
            core.weights().tolist(),
            [core.demand_bits(i).tolist() for i in range(len(self.sched))],
            core.lap,
            core.cursor_seq,
            core.visit_open,
        )

    # ------------------------------------------------------------ events
    @rule(rid=RIDS, weight=WEIGHTS)
    def add(self, rid: int, weight: float) -> None:
        if rid in self.sched:
            before = self._snapshot()
            with pytest.raises(ValueError, match="already live"):
                self.sched.add_request(rid, weight)
            assert self._snapshot() == before
            return
        self.sched.add_request(rid, weight)
        self.ref.add_request(rid, weight)
        self.tracker.add(rid, weight)

    @rule(rid=RIDS, drafted=st.integers(0, 24), as_mask=st.booleans(), data=st.data())
    def update(self, rid: int, drafted: int, as_mask: bool, data: st.DataObject) -> None:
        ids = self._experts(data)
        if rid not in self.sched:
            before = self._snapshot()
            with pytest.raises(UnknownRequestError, match=str(rid)):
                self.sched.update_demand(rid, drafted, self._as_input(ids, as_mask))
            assert self._snapshot() == before
            return
        self.sched.update_demand(rid, drafted, self._as_input(ids, as_mask))
        self.ref.update_demand(rid, drafted, ids)
        self.tracker.update(rid, drafted, ids)

    @rule(data=st.data())
    def refill(self, data: st.DataObject) -> None:
        """Every live request without demand drafts a new block (the usual
        engine loop between two steps)."""
        for rid in self.sched.request_ids.tolist():
            if self.sched.pending_tokens(rid) == 0:
                drafted = data.draw(st.integers(0, 24))
                ids = self._experts(data)
                self.sched.update_demand(rid, drafted, np.array(ids, dtype=np.int64))
                self.ref.update_demand(rid, drafted, ids)
                self.tracker.update(rid, drafted, ids)

    @precondition(lambda self: len(self.sched) > 0)
    @rule(data=st.data())
    def give_program(self, data: st.DataObject) -> None:
        """A live request gets a periodic demand program."""
        rid = data.draw(st.sampled_from(self.sched.request_ids.tolist()))
        self.programs[rid] = data.draw(demand_programs(self.cfg.num_flat, self.cfg.token_budget))

    @precondition(lambda self: len(self.programs) > 0)
    @rule(steps=st.integers(1, 12), replace=st.booleans())
    def run_programs(self, steps: int, replace: bool) -> None:
        """Steps in which every request with a program re-drafts from it (each
        step when ``replace``: the pending demand changes even while unserved;
        else only after it was served), the others from a refill."""
        for _ in range(steps):
            for rid in self.sched.request_ids.tolist():
                program = self.programs.get(rid)
                if program is None:
                    if self.sched.pending_tokens(rid) == 0:
                        self._set_demand(rid, 3, [])
                    continue
                if replace or self.sched.pending_tokens(rid) == 0:
                    drafted, ids = program[self.phase % len(program)]
                    self._set_demand(rid, drafted, list(ids))
            self.phase += 1
            self.step()

    @precondition(lambda self: len(self.sched) > 0)
    @rule(steps=st.integers(1, 8))
    def costly_head(self, steps: int) -> None:
        """Each step the request the cursor names asks for the whole token
        budget and every non-resident expert: the dearest item it can pose."""
        every = list(range(self.cfg.num_flat))
        for _ in range(steps):
            head = self._head()
            if head is None:
                return
            self._set_demand(head, self.cfg.token_budget + 2, every)
            for rid in self.sched.request_ids.tolist():
                if self.sched.pending_tokens(rid) == 0:
                    self._set_demand(rid, 0, [])
            self.step()

    @precondition(lambda self: len(self.sched) > 1)
    @rule(steps=st.integers(1, 8), heavy=st.booleans())
    def shared_experts(self, steps: int, heavy: bool) -> None:
        """Every request with no demand routes to the common set (the
        first half of the grid) plus one expert of its own (the concave
        union: a split re-copies the common set); with ``heavy`` the first
        live request instead asks for every expert outside the common set
        (unique and heavy: the marginal rule must not let the others
        starve it, nor it them)."""
        n = self.cfg.num_flat
        M = self.cfg.byte_budget
        # the common set: missing experts in id order while their bytes fit M
        # (so a batch of it plus a few own experts passes M by little)
        common: list[int] = []
        nbytes = 0
        for g in range(n):
            size = 0 if g in self.tracker.resident else self.tracker.sizes[g]
            if M is not None and common and nbytes + size > M:
                break
            common.append(g)
            nbytes += size
            if M is None and len(common) >= max(1, n // 2):
                break
        rest = [g for g in range(n) if g not in common] or common
        for step in range(steps):
            live = self.sched.request_ids.tolist()
            for k, rid in enumerate(live):
                if self.sched.pending_tokens(rid) != 0:
                    continue
                if heavy and k == 0:
                    self._set_demand(rid, self.cfg.token_budget // 2, rest)
                else:
                    own = rest[(k + step) % len(rest)]
                    self._set_demand(rid, 1 + k % 3, sorted({*common, own}))
            self.step()

    @rule(fixed=st.one_of(st.none(), st.integers(0, 600)))
    def change_fixed_step_bytes(self, fixed: int | None) -> None:
        """The engine may re-estimate ``F`` between steps; a token-only
        scheduler refuses one (state unchanged)."""
        if self.cfg.token_only and fixed is not None:
            before = self._snapshot()
            with pytest.raises(ValueError, match="token-only"):
                self.sched.set_fixed_step_bytes(fixed)
            assert self._snapshot() == before
            return
        self.sched.set_fixed_step_bytes(fixed)
        self.ref.set_fixed_step_bytes(fixed)
        self.tracker.set_fixed_step_bytes(fixed)

    @rule(count=st.integers(3, 7))
    def burst(self, count: int) -> None:
        """Requests arrive together and every live one poses a one-token item
        with no missing bytes: all fit, so the step takes as many as the
        token budget and the request cap allow."""
        for rid in range(7):
            if len(self.sched) >= count:
                break
            if rid not in self.sched:
                self.sched.add_request(rid, 1.0)
                self.ref.add_request(rid, 1.0)
                self.tracker.add(rid, 1.0)
        for rid in self.sched.request_ids.tolist():
            self._set_demand(rid, 0, [])
        self.step()

    @precondition(lambda self: len(self.sched) > 0)
    @rule(data=st.data())
    def clear(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self.sched.request_ids.tolist()))
        self.sched.clear_demand(rid)
        self.ref.clear_demand(rid)
        self.tracker.clear(rid)

    @rule(rid=RIDS)
    def remove(self, rid: int) -> None:
        # 11. removing an unknown or finished request is a no-op
        was_live = rid in self.sched
        before = self._snapshot()
        assert self.sched.remove_request(rid) == was_live
        if not was_live:
            assert self._snapshot() == before
        self.ref.remove_request(rid)
        self.tracker.remove(rid)
        self.programs.pop(rid, None)
        assert rid not in self.sched

    @rule(data=st.data(), as_mask=st.booleans())
    def change_resident(self, data: st.DataObject, as_mask: bool) -> None:
        ids = self._experts(data)
        self.sched.set_resident(self._as_input(ids, as_mask))
        self.ref.set_resident(ids)
        self.tracker.set_resident(ids)

    @precondition(lambda self: len(self.sched) > 0)
    @rule(data=st.data(), weight=WEIGHTS)
    def change_weight(self, data: st.DataObject, weight: float) -> None:
        rid = data.draw(st.sampled_from(self.sched.request_ids.tolist()))
        self.sched.set_weight(rid, weight)
        self.ref.set_weight(rid, weight)
        self.tracker.set_weight(rid, weight)

    @rule(kind=st.sampled_from(["id_range", "negative_drafts", "mask_shape", "sizes", "weight"]))
    def bad_input(self, kind: str) -> None:
        """Bad input raises a clear error and leaves the state unchanged."""
        before = self._snapshot()
        live = self.sched.request_ids.tolist()
        rid = live[0] if live else 0
        n = self.cfg.num_flat
        if kind == "id_range" and live:
            with pytest.raises(ValueError, match=f"expert id {n} out of range"):
                self.sched.update_demand(rid, 1, np.array([0, n]))
        elif kind == "negative_drafts" and live:
            with pytest.raises(ValueError, match="drafted_tokens must be >= 0"):
                self.sched.update_demand(rid, -1, np.array([0]))
        elif kind == "mask_shape":
            with pytest.raises(ValueError, match="mask shape"):
                self.sched.set_resident(np.zeros((self.cfg.num_layers + 1, 2), dtype=bool))
        elif kind == "sizes":
            bad = np.zeros(n, dtype=np.int64)
            bad[-1] = -5
            with pytest.raises(ValueError, match="expert size must be >= 0, got -5"):
                self.sched.set_expert_bytes(bad)
        elif kind == "weight" and live:
            with pytest.raises(ValueError, match="weight must be finite"):
                self.sched.set_weight(rid, math.nan)
        assert self._snapshot() == before

    @rule()
    def step(self) -> None:
        head = self._scan_head()
        result = self.sched.step()
        ref = self.ref.step()
        assert_same(result, ref, self.sched._core)
        self.tracker.check_step(result)
        self.steps += 1
        # Lemma (d) of the liveness proof (docs/scheduler.md): a request that
        # is the head, is served and keeps the head position does so for at
        # most visit_bound steps in a row (one DRR visit).
        core = self.sched._core
        stays = head is not None and head in result.request_ids.tolist()
        stays = stays and int(core.seqs()[self.sched._index(head)]) == core.cursor_seq
        self.visit_run = self.visit_run + 1 if stays and head == self.visit_head else int(stays)
        self.visit_head = head if stays else None
        if self.visit_run:
            c_max = max(self.tracker.c_max, 1.0 / self.cfg.token_budget)
            limit = visit_bound(self.cfg, c_max, self.tracker.q_ever / self.cfg.quantum)
            assert self.visit_run <= limit, (
                f"request {head} kept the head for {self.visit_run} served steps > {limit}"
            )
        BATCH_SIZES[len(result)] += 1
        self.max_batch = max(self.max_batch, len(result))
        event(f"batch size {min(len(result), 3)}")
        if result.oversize:
            event("oversize step")
        if result.trimmed.any():
            event("trimmed grant")
        if result.cap_reached:
            event("cap reached")
        M = self.cfg.byte_budget
        if M is not None and result.missing_bytes > M and not result.oversize:
            event("batch past M by the marginal rule")

    def teardown(self) -> None:
        if hasattr(self, "tracker"):
            # steer generation toward large batches and long waits
            target(float(self.max_batch), label="largest batch")
            target(self.tracker.max_wait_ratio, label="longest wait / proved bound")

    @invariant()
    def same_ledger(self) -> None:
        if not hasattr(self, "sched"):
            return
        live = [rid for _, rid in self.ref.ring]
        assert self.sched.request_ids.tolist() == live
        assert self.sched._core.deficits().tolist() == [
            self.ref.requests[rid].deficit for rid in live
        ]


BATCH_SIZES: Counter[int] = Counter()


def test_scheduler_stateful() -> None:
    BATCH_SIZES.clear()
    run_state_machine_as_test(SchedulerMachine, settings=settings(stateful_step_count=40))
    # the generated traces must exercise real batching, not only 1-2 items
    assert max(BATCH_SIZES) >= 3, f"batch sizes seen: {dict(BATCH_SIZES)}"


# --------------------------------------------------------------------------
# 6 (fairness) in the regime where every step holds exactly one item, and 7
# (no starvation) under steady load: long runs, every request always
# backlogged (its demand is refreshed as soon as it is served).
# --------------------------------------------------------------------------


@st.composite
def backlogged_runs(draw: Any) -> dict[str, Any]:
    layers, experts = 2, draw(st.integers(2, 8))
    n_flat = layers * experts
    one_item = draw(st.booleans())
    T = draw(st.integers(1, 24))
    cfg = SchedulerConfig(
        token_budget=T,
        missing_byte_budget=draw(st.one_of(st.none(), st.integers(1, 300))),
        quantum=draw(st.sampled_from([1.0, 1.5, 2.0])),
        num_layers=layers,
        num_experts=experts,
        fixed_step_bytes=draw(st.one_of(st.none(), st.integers(0, 600))),
    )
    n_req = draw(st.integers(2, 6))
    weights = draw(st.lists(st.sampled_from([1.0, 2.0, 3.0]), min_size=n_req, max_size=n_req))
    sizes = draw(st.lists(st.integers(0, 60), min_size=n_flat, max_size=n_flat))
    resident = draw(st.lists(st.integers(0, n_flat - 1), max_size=n_flat, unique=True))
    seed = draw(st.integers(0, 2**32 - 1))
    return {
        "cfg": cfg,
        "weights": weights,
        "sizes": sizes,
        "resident": resident,
        "seed": seed,
        # one_item: every demand asks for >= T tokens, so the head takes the
        # whole token budget and each step is exactly one item
        "min_drafts": T - 1 if one_item else 0,
        "one_item": one_item,
    }


@settings(max_examples=scaled(40))
@given(run=backlogged_runs())
def test_fairness_and_no_starvation_backlogged(run: dict[str, Any]) -> None:
    cfg: SchedulerConfig = run["cfg"]
    rng = np.random.default_rng(run["seed"])
    sched = VerifyScheduler(cfg)
    tracker = InvariantTracker(cfg)
    sched.set_expert_bytes(np.array(run["sizes"], dtype=np.int64))
    tracker.set_sizes(run["sizes"])
    sched.set_resident(np.array(run["resident"], dtype=np.int64))
    tracker.set_resident(run["resident"])
    weights = run["weights"]
    n = len(weights)
    for rid, w in enumerate(weights):
        sched.add_request(rid, w)
        tracker.add(rid, w)
    service = np.zeros(n)
    history = [service.copy()]
    for _ in range(60):
        for rid in range(n):
            if sched.pending_tokens(rid) == 0:
                drafted = run["min_drafts"] + int(rng.integers(0, 4))
                k = int(rng.integers(0, cfg.num_flat + 1))
                ids = rng.choice(cfg.num_flat, size=k, replace=False)
                sched.update_demand(rid, drafted, ids)
                tracker.update(rid, drafted, ids.tolist())
        result = sched.step()
        tracker.check_step(result)
        if run["one_item"]:
            assert len(result) == 1
        for rid, c in zip(result.request_ids.tolist(), result.costs.tolist(), strict=True):
            service[rid] += c
        history.append(service.copy())
    if not run["one_item"]:
        return
    # 6. DRR fairness: over every interval (all requests are continuously
    # backlogged here), weighted service differs by less than the proved
    # bound 3Q + c_max/w_a + c_max/w_b (docs/scheduler.md); the largest
    # spread is reached by some pair, whose bound is at most the one for two
    # requests of the smallest weight.
    # NOTE: the earlier assertion c_max + Q + max(c_max, Q) was never proved
    # and is false once an oversize item costs more than Q: random seeds find
    # runs that break it on the code before issue 12 as well (e.g. T=12,
    # M=121, Q=1, c_max=1.86: gap 4.96 > 4.72).
    hist = np.array(history) / np.array(weights)
    w_min = min(weights)
    bound = fairness_bound(cfg, max(tracker.c_max, 1.0 / cfg.token_budget), w_min, w_min)
    for a in range(len(hist)):
        spread = hist[a + 1 :] - hist[a]
        if len(spread):
            gap = float((spread.max(axis=1) - spread.min(axis=1)).max())
            assert gap < bound + 1e-9, f"weighted service gap {gap} >= proved bound {bound}"


# --------------------------------------------------------------------------
# 6 (fairness) over ANY interval in which two requests are both backlogged,
# under adversarial demand: periodic programs, late arrivals, idle spells.
# --------------------------------------------------------------------------


@st.composite
def adversarial_one_item_runs(draw: Any) -> dict[str, Any]:
    layers, experts = 1, draw(st.integers(2, 8))
    n_flat = layers * experts
    T = draw(st.integers(1, 24))
    by_cap = draw(st.booleans())  # one item per step by the cap, or by tokens
    cfg = SchedulerConfig(
        token_budget=T,
        missing_byte_budget=draw(st.one_of(st.none(), st.integers(1, 300))),
        quantum=draw(st.sampled_from([1.0, 1.5, 2.0])),
        max_requests_per_step=1 if by_cap else None,
        num_layers=layers,
        num_experts=experts,
        # one item per step: the marginal rule never applies, the bound holds with it
        fixed_step_bytes=draw(st.one_of(st.none(), st.integers(0, 600))),
    )
    n_req = draw(st.integers(2, 5))
    requests = []
    for _ in range(n_req):
        program = draw(demand_programs(n_flat, T))
        if not by_cap:  # every item asks for the whole token budget
            program = [(max(d, T - 1), ids) for d, ids in program]
        requests.append(
            {
                "weight": draw(st.sampled_from([0.5, 1.0, 2.0, 3.0])),
                "program": program,
                "arrive": draw(st.integers(0, 20)),
                "idle": draw(st.lists(st.integers(0, 79), max_size=6, unique=True)),
                "replace": draw(st.booleans()),
            }
        )
    sizes = draw(st.lists(st.integers(0, 60), min_size=n_flat, max_size=n_flat))
    resident = draw(st.lists(st.integers(0, n_flat - 1), max_size=n_flat, unique=True))
    return {"cfg": cfg, "requests": requests, "sizes": sizes, "resident": resident}


def _check_intervals(
    served: np.ndarray, backlog: np.ndarray, weights: list[float], bound_of: Any
) -> float:
    """Largest |S_a/w_a - S_b/w_b| / bound over every interval of steps in
    which both a and b are backlogged at every step; asserts it is < 1."""
    steps, n = served.shape
    cum = np.vstack([np.zeros(n), np.cumsum(served, axis=0)])  # cum[s] = before step s
    worst = 0.0
    for a in range(n):
        for b in range(a + 1, n):
            both = backlog[:, a] & backlog[:, b]
            s = 0
            while s < steps:
                if not both[s]:
                    s += 1
                    continue
                e = s
                while e < steps and both[e]:
                    e += 1
                # every sub-interval [i, j) of the run [s, e)
                wa = cum[s : e + 1, a] / weights[a]
                wb = cum[s : e + 1, b] / weights[b]
                d = wa - wb
                gap = float(np.max(d[:, None] - d[None, :]))
                bound = bound_of(weights[a], weights[b])
                assert gap < bound + 1e-9, (
                    f"requests {a},{b}: weighted service gap {gap} >= proved bound {bound} "
                    f"over steps [{s}, {e})"
                )
                worst = max(worst, gap / bound)
                s = e
    return worst


@settings(max_examples=scaled(40))
@given(run=adversarial_one_item_runs())
def test_fairness_any_interval_adversarial(run: dict[str, Any]) -> None:
    cfg: SchedulerConfig = run["cfg"]
    sched = VerifyScheduler(cfg)
    ref = reference_for(cfg)
    tracker = InvariantTracker(cfg)
    sched.set_expert_bytes(np.array(run["sizes"], dtype=np.int64))
    ref.set_expert_bytes(run["sizes"])
    tracker.set_sizes(run["sizes"])
    sched.set_resident(np.array(run["resident"], dtype=np.int64))
    ref.set_resident(run["resident"])
    tracker.set_resident(run["resident"])
    reqs = run["requests"]
    n = len(reqs)
    steps = 80
    served = np.zeros((steps, n))
    backlog = np.zeros((steps, n), dtype=bool)
    for step in range(steps):
        for rid, spec in enumerate(reqs):
            if step < spec["arrive"]:
                continue
            if rid not in sched:
                sched.add_request(rid, spec["weight"])
                ref.add_request(rid, spec["weight"])
                tracker.add(rid, spec["weight"])
            if step in spec["idle"]:
                sched.clear_demand(rid)
                ref.clear_demand(rid)
                tracker.clear(rid)
            elif spec["replace"] or sched.pending_tokens(rid) == 0:
                drafted, ids = spec["program"][step % len(spec["program"])]
                sched.update_demand(rid, drafted, np.array(ids, dtype=np.int64))
                ref.update_demand(rid, drafted, list(ids))
                tracker.update(rid, drafted, list(ids))
            backlog[step, rid] = sched.pending_tokens(rid) > 0
        result = sched.step()
        assert_same(result, ref.step(), sched._core)
        tracker.check_step(result)
        assert len(result) == (1 if backlog[step].any() else 0)
        for rid, c in zip(result.request_ids.tolist(), result.costs.tolist(), strict=True):
            served[step, rid] += c
    weights = [spec["weight"] for spec in reqs]
    c_max = max(tracker.c_max, 1.0 / cfg.token_budget)
    worst = _check_intervals(
        served, backlog, weights, lambda wa, wb: fairness_bound(cfg, c_max, wa, wb)
    )
    target(worst, label="fairness gap / proved bound")


# --------------------------------------------------------------------------
# 7 (liveness) under periodic demand on small budgets, long runs: every
# request re-drafts from a periodic program every step, so a head whose
# demand alternates keeps trying to hold the head position.
# --------------------------------------------------------------------------


@st.composite
def periodic_runs(draw: Any) -> dict[str, Any]:
    experts = draw(st.integers(2, 6))
    T = draw(st.integers(1, 8))
    cfg = SchedulerConfig(
        token_budget=T,
        missing_byte_budget=draw(st.one_of(st.none(), st.integers(5, 60))),
        quantum=draw(st.sampled_from([1.0, 1.5, 2.0])),
        max_requests_per_step=draw(st.sampled_from([None, None, 2, 3])),
        num_layers=1,
        num_experts=experts,
        fixed_step_bytes=draw(st.one_of(st.none(), st.integers(0, 200))),
    )
    n_req = draw(st.integers(2, 4))
    weights = draw(st.lists(WEIGHTS, min_size=n_req, max_size=n_req))
    programs = [draw(demand_programs(experts, T)) for _ in range(n_req)]
    if draw(st.integers(0, 2)) > 0:
        # a would-be head hog: a heavier request alternating an empty and a
        # full draft block over a fixed expert set, the others steady
        weights[0] = draw(st.sampled_from([2.0, 3.0]))
        hog_set = tuple(draw(st.lists(st.integers(0, experts - 1), max_size=2, unique=True)))
        programs[0] = [(0, hog_set), (draw(st.integers(T - 1, T + 2)), hog_set)]
        # steady others that need many experts: they rarely fit beside it
        programs[1:] = [
            [(draw(st.integers(0, T)), tuple(range(draw(st.integers(1, experts)))))]
            for _ in programs[1:]
        ]
    return {
        "cfg": cfg,
        "weights": weights,
        "programs": programs,
        "size": draw(st.integers(1, 20)),
    }


REPRO = {  # tests/scheduler/test_scheduler_liveness.py: starved request 1 before the fix
    "cfg": SchedulerConfig(
        token_budget=6, missing_byte_budget=20, quantum=1.5, num_layers=1, num_experts=3
    ),
    "weights": [2.0, 1.0, 1.0],
    "programs": [[(0, (2,)), (6, (2,))], [(4, (0, 1))], [(5, (0, 2))]],
    "size": 10,
}


@settings(max_examples=scaled(120))
@given(run=periodic_runs())
@example(run=REPRO)
def test_liveness_periodic_demand(run: dict[str, Any]) -> None:
    cfg: SchedulerConfig = run["cfg"]
    sched = VerifyScheduler(cfg)
    ref = reference_for(cfg)
    tracker = InvariantTracker(cfg)
    sizes = [run["size"]] * cfg.num_flat
    sched.set_expert_bytes(np.array(sizes, dtype=np.int64))
    ref.set_expert_bytes(sizes)
    tracker.set_sizes(sizes)
    for rid, w in enumerate(run["weights"]):
        sched.add_request(rid, w)
        ref.add_request(rid, w)
        tracker.add(rid, w)
    visit_head, visit_run, longest_visit = None, 0, 0
    for step in range(300):
        for rid, program in enumerate(run["programs"]):
            drafted, ids = program[step % len(program)]
            sched.update_demand(rid, drafted, np.array(ids, dtype=np.int64))
            ref.update_demand(rid, drafted, list(ids))
            tracker.update(rid, drafted, list(ids))
        cursor = int(sched._core.cursor_seq)
        seqs = sched._core.seqs().tolist()
        head = next((k for k, q in enumerate(seqs) if q >= cursor), 0)  # all have demand
        result = sched.step()
        assert_same(result, ref.step(), sched._core)
        tracker.check_step(result)  # 7: every wait <= liveness_bound
        stays = head in result.request_ids.tolist() and seqs[head] == sched._core.cursor_seq
        visit_run = visit_run + 1 if stays and head == visit_head else int(stays)
        visit_head = head if stays else None
        longest_visit = max(longest_visit, visit_run)
    c_max = max(tracker.c_max, 1.0 / cfg.token_budget)
    limit = visit_bound(cfg, c_max, max(run["weights"]))
    assert longest_visit <= limit, f"a head kept its position {longest_visit} steps > {limit}"
    target(longest_visit / limit, label="longest visit / proved bound")
    target(tracker.max_wait_ratio, label="longest wait / proved liveness bound")
