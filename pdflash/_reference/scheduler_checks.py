"""Independent recomputation of the scheduler's invariants, step by step.

:class:`InvariantTracker` mirrors the events given to a scheduler (it keeps
its own copy of live requests, demands, resident set, sizes and ledger) and
:meth:`InvariantTracker.check_step` verifies one :class:`StepResult` from
scratch. Used by the hypothesis stateful tests and the unit tests.

Numbering follows the invariants of ``docs/scheduler.md``. Where the batch setting needs a precise
reading, it is stated here (and in :mod:`pdflash.scheduler`):

* 6 (fairness) is checked as (a) at most one quantum per request per DRR
  lap, everywhere, and (b) the proved weighted-service bound
  (:func:`pdflash.scheduler.bounds.fairness_bound`) over every interval in
  which two requests are both backlogged, in the regime where a step holds
  one item (see ``tests/scheduler/test_scheduler_stateful.py``); when
  several items share a step, an item that does not fit the *residual*
  budget waits for the head position while smaller items are packed around
  it (work conservation wins there), and that wait is bounded by 7.
* 2 (bytes) under the marginal rule (``fixed_step_bytes`` ``F`` set): every
  item that passed the bytes left was normal (``mb <= M``) and raised the
  modelled rate of the batch before it (``g * (F + B) > tokens * mb``), and
  the batch's missing bytes stay below ``T * (F + max(M, mb_1)) - F``
  (2c; ``mb_1`` the first item's, above ``M`` only when it is oversize).
* 9 (work conservation) reads "fits" as "is admissible": fits the residual
  tokens and either the residual bytes or the marginal rule.
* 7 (no starvation): a request with pending demand is served within
  :func:`pdflash.scheduler.bounds.liveness_bound` steps (proof in
  ``docs/scheduler.md``), evaluated from the config, the number of requests
  live during its wait, their weights and the largest item cost seen.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from pdflash.scheduler import SchedulerConfig, StepResult
from pdflash.scheduler.bounds import liveness_bound

EPS = 1e-9


@dataclass
class _Req:
    seq: int
    weight: float
    tokens: int | None = None
    experts: frozenset[int] = frozenset()
    deficit: float = 0.0
    q_max: float = 0.0
    quanta_count: int = 0
    lap_joined: int = 0
    waiting: int = 0  # consecutive steps with demand and no service
    arrivals_while_waiting: int = 0
    live_while_waiting: int = 0


@dataclass
class InvariantTracker:
    config: SchedulerConfig
    live: dict[int, _Req] = field(default_factory=dict)
    removed: set[int] = field(default_factory=set)
    resident: frozenset[int] = frozenset()
    sizes: list[int] = field(default_factory=list)
    next_seq: int = 0
    lap: int = 0
    c_max: float = 0.0
    steps: int = 0
    max_wait_seen: int = 0
    max_wait_ratio: float = 0.0  # largest wait / its bound seen
    w_min: float = math.inf  # smallest weight any request has had
    q_ever: float = 0.0  # largest w * Q any request has had
    fixed_step_bytes: int | None = None  # F of the marginal rule now in force
    marginal_admissions: int = 0  # items admitted past M by the marginal rule

    def __post_init__(self) -> None:
        if not self.sizes:
            self.sizes = [0] * self.config.num_flat
        if self.config.marginal_rule:
            self.fixed_step_bytes = self.config.fixed_step_bytes

    def _raises_rate(self, grant: int, mb: int, tokens: int, missing: int) -> bool:
        M = self.config.byte_budget
        F = self.fixed_step_bytes
        if F is None or M is None or mb > M:
            return False
        return grant * (F + missing) > tokens * mb

    # ------------------------------------------------------------ events
    def add(self, rid: int, weight: float = 1.0) -> None:
        self._note_weight(weight)
        self.live[rid] = _Req(
            seq=self.next_seq,
            weight=weight,
            q_max=weight * self.config.quantum,
            lap_joined=self.lap,
        )
        self.next_seq += 1
        self.removed.discard(rid)
        for req in self.live.values():
            if req.tokens is not None:
                req.arrivals_while_waiting += 1

    def remove(self, rid: int) -> None:
        if self.live.pop(rid, None) is not None:
            self.removed.add(rid)

    def update(self, rid: int, drafted: int, experts: Iterable[int]) -> None:
        req = self.live[rid]
        if req.tokens is None:
            req.waiting = 0
            req.arrivals_while_waiting = 0
            req.live_while_waiting = len(self.live)
        req.tokens = 1 + drafted
        req.experts = frozenset(int(g) for g in experts)

    def clear(self, rid: int) -> None:
        self.live[rid].tokens = None

    def _note_weight(self, weight: float) -> None:
        self.w_min = min(self.w_min, weight)
        self.q_ever = max(self.q_ever, weight * self.config.quantum)

    def set_weight(self, rid: int, weight: float) -> None:
        self._note_weight(weight)
        req = self.live[rid]
        req.weight = weight
        req.q_max = max(req.q_max, weight * self.config.quantum)

    def set_resident(self, experts: Iterable[int]) -> None:
        self.resident = frozenset(int(g) for g in experts)

    def set_fixed_step_bytes(self, fixed_step_bytes: int | None) -> None:
        self.fixed_step_bytes = fixed_step_bytes if self.config.byte_budget is not None else None

    def set_sizes(self, sizes: Iterable[int]) -> None:
        self.sizes = [int(b) for b in sizes]

    # ------------------------------------------------------------ helpers
    def _bytes(self, experts: Iterable[int]) -> int:
        return sum(self.sizes[g] for g in experts)

    def _cost(self, grant: int, marginal: int) -> float:
        budget = self.config.byte_budget
        if budget is None:
            return grant / self.config.token_budget
        return max(grant / self.config.token_budget, marginal / budget)

    def starvation_bound(self, rid: int) -> int:
        """Steps within which a waiting request must be served: the proved
        :func:`~pdflash.scheduler.bounds.liveness_bound`, with ``N`` the
        requests live at some time during its wait and the weights every
        request has ever had (a deficit may still hold a quantum granted
        under an earlier weight)."""
        req = self.live[rid]
        n = req.live_while_waiting + req.arrivals_while_waiting
        q = self.config.quantum
        return liveness_bound(
            self.config,
            n=max(n, 1),
            c_max=max(self.c_max, 1.0 / self.config.token_budget),
            w_min=self.w_min,
            w_max=self.q_ever / q,
        )

    # ------------------------------------------------------------ the check
    def check_step(self, r: StepResult) -> None:
        cfg = self.config
        T = cfg.token_budget
        M = cfg.byte_budget
        live_order = sorted(self.live, key=lambda rid: self.live[rid].seq)
        pending = {rid: q for rid, q in self.live.items() if q.tokens is not None}
        for q in pending.values():
            assert q.tokens is not None
            self.c_max = max(
                self.c_max,
                self._cost(min(q.tokens, T), self._bytes(q.experts - self.resident)),
            )
        ids = [int(x) for x in r.request_ids]

        # 11. only live requests; removed ones never reappear
        assert [int(x) for x in r.live_request_ids] == live_order, "live set/order differs"
        assert not set(ids) & self.removed, "a removed request was scheduled"
        # 3. each at most once, only with demand, 1 <= grant <= 1 + drafts
        assert len(set(ids)) == len(ids), "request scheduled twice in one step"
        assert set(ids) <= set(pending), "request without demand scheduled"
        # 8. progress
        assert ids or not pending, "empty step with live work"
        # 1. tokens; trimming takes exactly what is left (a prefix, >= 1)
        tokens_left = T
        covered = set(self.resident)
        union: set[int] = set()
        charged: dict[int, float] = {}
        batch_bytes = 0
        for k, rid in enumerate(ids):
            q = pending[rid]
            assert q.tokens is not None
            g = int(r.token_grants[k])
            assert int(r.requested_tokens[k]) == q.tokens, "requested tokens differ"
            assert 1 <= g <= q.tokens, f"grant {g} outside [1, {q.tokens}]"
            assert g == min(q.tokens, tokens_left), "grant is not min(t, tokens left)"
            tokens_left -= g
            # 2. marginal bytes charged in service order, from scratch
            missing = q.experts - covered
            mb = self._bytes(missing)
            assert int(r.marginal_bytes[k]) == mb, f"marginal bytes {r.marginal_bytes[k]} != {mb}"
            if M is not None and k > 0 and batch_bytes + mb > M:
                # 2a. past the bytes left only by the marginal rule
                assert self._raises_rate(g, mb, T - tokens_left - g, batch_bytes), (
                    f"item {rid} ({g} tokens, {mb} B) passed M without raising the rate"
                )
                self.marginal_admissions += 1
            batch_bytes += mb
            c = self._cost(g, mb)
            assert float(r.costs[k]) == c, f"cost {r.costs[k]} != {c}"
            charged[rid] = c
            union |= missing
            covered |= q.experts
        assert tokens_left >= 0, "token budget exceeded"
        assert sorted(union) == [int(x) for x in r.union_ids], "union ids differ"
        mask = np.zeros(cfg.num_flat, dtype=bool)
        mask[sorted(union)] = True
        assert (r.union_mask.reshape(-1) == mask).all(), "union mask differs"
        total = self._bytes(union)
        assert total == r.missing_bytes
        F = self.fixed_step_bytes
        first_mb = int(r.marginal_bytes[0]) if ids else 0
        oversize = M is not None and first_mb > M
        assert r.oversize == oversize, "oversize flag wrong"
        assert not oversize or F is not None or len(ids) == 1, "oversize item not alone"
        assert M is None or total <= M or oversize or F is not None, "byte budget exceeded"
        if M is not None and F is not None and ids:
            # 2c. (F + B) / tokens only falls under marginal admissions and is
            # at most F + max(M, mb of the first item) after any other
            assert total <= T * (F + max(M, first_mb)) - F, f"{total} B > T (F + M') - F"
        cap = cfg.max_requests_per_step
        assert cap is None or len(ids) <= cap
        # 9. work conservation: nothing left is admissible (fits the residual
        # tokens and the residual bytes or the marginal rule)
        if not (r.oversize and F is None) and not r.cap_reached:
            bytes_left = None if M is None else M - total
            for rid, q in pending.items():
                if rid in charged or tokens_left < 1:
                    continue
                mb = self._bytes(q.experts - covered)
                g = min(q.tokens or 0, tokens_left)
                assert bytes_left is not None and mb > bytes_left, (
                    f"request {rid} fits the residual budgets but was not scheduled"
                )
                assert not ids or not self._raises_rate(g, mb, T - tokens_left, total), (
                    f"request {rid} raises the step's modelled rate but was not scheduled"
                )
        if r.cap_reached:
            assert cap is not None and len(ids) == cap
        # 4, 5, 6a. ledger, bounds, one quantum per lap
        for k, rid in enumerate(live_order):
            q = self.live[rid]
            new = float(r.deficits[k])
            quanta = float(r.quanta[k])
            expected = q.deficit + quanta - charged.get(rid, 0.0)
            assert abs(new - expected) <= EPS * max(1.0, abs(expected)), (
                f"ledger broken for {rid}: {q.deficit} + {quanta} - {charged.get(rid, 0.0)} != {new}"
            )
            assert new >= 0.0, f"negative deficit {new} for {rid}"
            assert new < self.c_max + q.q_max + EPS, (
                f"deficit {new} of {rid} >= c_max {self.c_max} + Q_i {q.q_max}"
            )
            unit = q.weight * cfg.quantum
            count = quanta / unit
            assert abs(count - round(count)) < 1e-6, "quanta not whole quanta"
            q.quanta_count += round(count)
            assert q.quanta_count <= r.lap - q.lap_joined + 1, (
                f"{rid} got {q.quanta_count} quanta in laps {q.lap_joined}..{r.lap}"
            )
            q.deficit = new
        assert r.lap >= self.lap, "lap went backwards"
        self.lap = r.lap
        # consume demands; 7. starvation
        for rid in ids:
            self.live[rid].tokens = None
            self.live[rid].experts = frozenset()
            self.live[rid].waiting = 0
        for rid, q in pending.items():
            if rid in charged:
                continue
            q.waiting += 1
            self.max_wait_seen = max(self.max_wait_seen, q.waiting)
            bound = self.starvation_bound(rid)
            self.max_wait_ratio = max(self.max_wait_ratio, q.waiting / bound)
            assert q.waiting <= bound, f"{rid} waited {q.waiting} steps > proved bound {bound}"
        self.steps += 1
