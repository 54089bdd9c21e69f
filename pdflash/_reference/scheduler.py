"""Pure-Python reference of the 2-D deficit verify scheduler (docs/design.md §4).

Written from the rules in :mod:`pdflash.scheduler` (module docstring), not
from the Cython code: expert sets are Python ``frozenset``s of flat ids,
the ring is a sorted list, budgets are plain ints. Differential tests drive
it and :class:`pdflash.VerifyScheduler` with the same events and require
identical results, floats included (both use IEEE float64 with the same
formulas: ``cost = max(g / T, mb / M)``, ``D += w * Q``, ``D -= cost``).

Inputs are taken already normalised (flat ids, ints, floats); the public
class does the validation. Used only by tests and ``pdflash-bench sched``.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class _Request:
    rid: int
    seq: int
    weight: float
    deficit: float = 0.0
    credit_lap: int = -1
    tokens: int | None = None  # 1 + drafted tokens; None = no pending demand
    experts: frozenset[int] = frozenset()


@dataclass
class ReferenceStep:
    request_ids: list[int]
    requested_tokens: list[int]
    token_grants: list[int]
    marginal_bytes: list[int]
    costs: list[float]
    union_ids: list[int]
    oversize: bool
    cap_reached: bool
    live_request_ids: list[int]
    deficits: list[float]
    quanta: list[float]
    lap: int
    next_cursor_seq: int
    next_visit_open: bool
    missing_bytes: int = field(default=0)
    tokens: int = field(default=0)


class ReferenceScheduler:
    """Same rules as :class:`pdflash.VerifyScheduler`, in plain Python."""

    def __init__(
        self,
        token_budget: int,
        missing_byte_budget: int | None,
        quantum: float,
        max_requests_per_step: int | None,
        num_flat: int,
        fixed_step_bytes: int | None = None,
    ) -> None:
        self.T = token_budget
        self.M = missing_byte_budget  # None: token-only mode (B2)
        self.Q = quantum
        self.cap = max_requests_per_step
        # F: the link's bytes in a step's fixed time; None: M is hard
        self.F = fixed_step_bytes if missing_byte_budget is not None else None
        self.num_flat = num_flat
        self.expert_bytes: list[int] = [0] * num_flat
        self.resident: frozenset[int] = frozenset()
        self.requests: dict[int, _Request] = {}
        self.ring: list[tuple[int, int]] = []  # sorted (seq, rid)
        self.next_seq = 0
        self.cursor_seq = 0
        self.visit_open = False  # the request at cursor_seq continues its visit
        self.lap = 0

    # ------------------------------------------------------------ events
    def add_request(self, rid: int, weight: float = 1.0) -> None:
        assert rid not in self.requests
        req = _Request(rid=rid, seq=self.next_seq, weight=weight)
        self.next_seq += 1
        self.requests[rid] = req
        bisect.insort(self.ring, (req.seq, rid))

    def remove_request(self, rid: int) -> None:
        req = self.requests.pop(rid, None)
        if req is None:
            return
        self.ring.remove((req.seq, rid))

    def update_demand(
        self, rid: int, drafted_tokens: int, experts: Iterable[int] | None = None
    ) -> None:
        req = self.requests[rid]
        if req.tokens is None:
            # backlogged from the current lap on: owed nothing for earlier laps
            req.credit_lap = max(req.credit_lap, self.lap - 1)
        req.tokens = 1 + drafted_tokens
        req.experts = frozenset(() if experts is None else (int(g) for g in experts))

    def clear_demand(self, rid: int) -> None:
        self.requests[rid].tokens = None
        self.requests[rid].experts = frozenset()

    def set_weight(self, rid: int, weight: float) -> None:
        self.requests[rid].weight = weight

    def set_resident(self, experts: Iterable[int]) -> None:
        self.resident = frozenset(int(g) for g in experts)

    def set_expert_bytes(self, sizes: Iterable[int]) -> None:
        self.expert_bytes = [int(b) for b in sizes]

    def set_fixed_step_bytes(self, fixed_step_bytes: int | None) -> None:
        self.F = fixed_step_bytes if self.M is not None else None

    def raises_rate(self, grant: int, marginal: int, tokens: int, missing: int) -> bool:
        """The marginal rule: adding ``(grant, marginal)`` to a batch of
        ``tokens`` tokens and ``missing`` bytes raises its modelled tokens
        per second, ``tokens / (t_fixed + t_tok * tokens + bytes / link)``.
        With ``F = t_fixed * link`` that is ``grant * (F + missing) > tokens
        * marginal`` (the per-token compute cancels); only normal items
        (``marginal <= M``), only with ``F`` set."""
        if self.F is None or self.M is None or marginal > self.M:
            return False
        return grant * (self.F + missing) > tokens * marginal

    # ------------------------------------------------------------ step
    def _bytes(self, experts: Iterable[int]) -> int:
        return sum(self.expert_bytes[g] for g in experts)

    def _cost(self, grant: int, marginal: int) -> float:
        if self.M is None:
            return grant / self.T
        return max(grant / self.T, marginal / self.M)

    def step(self) -> ReferenceStep:
        live = [rid for _, rid in self.ring]
        start = bisect.bisect_left([s for s, _ in self.ring], self.cursor_seq)
        if start == len(live):
            start = 0
        order = live[start:] + live[:start]
        candidates = [rid for rid in order if self.requests[rid].tokens is not None]
        quanta = dict.fromkeys(live, 0.0)
        # the head continues its visit only if the cursor still names it
        continuing = (
            bool(candidates)
            and self.visit_open
            and self.requests[candidates[0]].seq == self.cursor_seq
        )

        served: list[int] = []
        grants: list[int] = []
        marginals: list[int] = []
        costs: list[float] = []
        union: set[int] = set()
        covered: set[int] = set(self.resident)
        tokens_left = self.T
        bytes_left = self.M
        lap = self.lap
        oversize = False
        cap_reached = False
        stopped = False
        is_served: set[int] = set()

        while candidates:
            progressed = False
            credit_limited_fit = False
            for rid in candidates:
                if rid in is_served:
                    continue
                if self.cap is not None and len(served) >= self.cap:
                    cap_reached = stopped = True
                    break
                if tokens_left == 0:
                    stopped = True
                    break
                req = self.requests[rid]
                assert req.tokens is not None
                grant = min(req.tokens, tokens_left)
                missing = req.experts - covered
                marginal = self._bytes(missing)
                batch_empty = not served
                if (
                    bytes_left is not None
                    and marginal > bytes_left
                    and not batch_empty
                    and not self.raises_rate(grant, marginal, self.T - tokens_left, sum(marginals))
                ):
                    # neither fits the residual bytes nor raises the step's
                    # modelled rate: no credit decision
                    continue
                cost = self._cost(grant, marginal)
                # one quantum, for the current lap, if it cannot pay and was
                # not credited in this lap yet (earlier laps are not banked)
                if req.deficit < cost and req.credit_lap < lap:
                    quantum = req.weight * self.Q
                    req.deficit += quantum
                    quanta[rid] += quantum
                    req.credit_lap = lap
                if req.deficit < cost:
                    credit_limited_fit = True
                    continue
                req.deficit -= cost
                served.append(rid)
                is_served.add(rid)
                grants.append(grant)
                marginals.append(marginal)
                costs.append(cost)
                union |= missing
                covered |= req.experts
                tokens_left -= grant
                if bytes_left is not None:
                    bytes_left -= marginal
                progressed = True
                if self.M is not None and marginal > self.M:
                    # the oversize exception: it runs alone, or under the
                    # marginal rule with only the items that rule admits
                    oversize = True
                    if self.F is None:
                        stopped = True
                        break
            if stopped:
                break
            if progressed:
                continue
            if credit_limited_fit:
                lap += 1
                continue
            break

        requested = [self.requests[rid].tokens or 0 for rid in served]
        # the served demands are consumed
        for rid in served:
            self.requests[rid].tokens = None
            self.requests[rid].experts = frozenset()
        self.lap = lap
        if candidates:
            head = self.requests[candidates[0]]
            head_served = head.rid in is_served
            head_cost = costs[served.index(head.rid)] if head_served else 0.0
            if (
                head_served
                and head.deficit >= head_cost
                and not (continuing and quanta[head.rid] > 0)
            ):
                # its visit continues (a quantum during a continued visit ends it)
                self.cursor_seq = head.seq
                self.visit_open = True
            elif not head_served and not continuing:
                # the head waits for credit and keeps the head position
                self.cursor_seq = head.seq
                self.visit_open = False
            else:
                # its turn is over: the first unserved candidate after it, or
                # the head's ring successor when everyone was served
                self.visit_open = False
                after = [rid for rid in candidates[1:] if rid not in is_served]
                self.cursor_seq = self.requests[after[0]].seq if after else head.seq + 1
        return ReferenceStep(
            request_ids=served,
            requested_tokens=requested,
            token_grants=grants,
            marginal_bytes=marginals,
            costs=costs,
            union_ids=sorted(union),
            oversize=oversize,
            cap_reached=cap_reached,
            live_request_ids=live,
            deficits=[self.requests[rid].deficit for rid in live],
            quanta=[quanta[rid] for rid in live],
            lap=lap,
            next_cursor_seq=self.cursor_seq,
            next_visit_open=self.visit_open,
            missing_bytes=sum(marginals),
            tokens=sum(grants),
        )
