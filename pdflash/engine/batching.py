"""Choosing each step's verify batch.

:class:`VerifyBatcher` is the seam: FCFS under a token budget (B0, B1, B3)
is built in; the deficit scheduler of :mod:`pdflash.scheduler` (B2 in
token-only mode, PD in 2-D mode) plugs in through :class:`DeficitBatcher`.
A batcher that hands each step's choice to another (expert-parallel ranks'
:class:`~pdflash.distributed.ExpertParallelBatcher`) is a
:class:`DelegatingBatcher`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from pdflash.scheduler import VerifyScheduler


@dataclass
class VerifyDemand:
    """A request waiting for verify: ``tokens`` = 1 + drafts (trimmable to 1)."""

    request_id: int
    tokens: int
    predicted: npt.NDArray[np.int64] | None = None  # flat expert ids


@dataclass
class BatchDecision:
    grants: list[tuple[int, int]]  # (request_id, tokens), in execution order
    missing: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    scheduler_us: float = 0.0
    #: granted whole without consulting a scheduler (an uncontended step of
    #: :class:`DeficitBatcher`)
    uncontended: bool = False


class VerifyBatcher(Protocol):
    name: str

    def add(self, request_id: int, weight: float = 1.0) -> None: ...

    def remove(self, request_id: int) -> None: ...

    def select(
        self, demands: Sequence[VerifyDemand], resident: npt.NDArray[np.bool_] | None
    ) -> BatchDecision: ...


@runtime_checkable
class PausableBatcher(VerifyBatcher, Protocol):
    """A :class:`VerifyBatcher` whose steps can be batched elsewhere for a
    while (first-come at the PD controller's rest:
    :mod:`pdflash.engine.pd_controller`, "Rest")."""

    def pause(self) -> None:
        """The steps until the next :meth:`select` are batched elsewhere;
        what it holds of earlier demands must not outlive them."""
        ...


@runtime_checkable
class DelegatingBatcher(VerifyBatcher, Protocol):
    """A :class:`VerifyBatcher` that hands each step's choice to an
    ``inner`` batcher (and may cut or book what it chooses), e.g.
    expert-parallel ranks' :class:`~pdflash.distributed.ExpertParallelBatcher`.
    Its :attr:`name` is its inner batcher's."""

    @property
    def inner(self) -> VerifyBatcher: ...

    def with_inner(self, inner: VerifyBatcher) -> DelegatingBatcher:
        """This batcher handing its choice to ``inner`` from now on (its
        :attr:`name` becomes ``inner``'s). Before its first step only."""
        ...


def first_come_grants(demands: Sequence[VerifyDemand], token_budget: int) -> list[tuple[int, int]]:
    """Grants in the demands' order while the token budget lasts, the last
    one trimmed to fit (B1's rule over demands already in arrival order)."""
    left = token_budget
    grants: list[tuple[int, int]] = []
    for d in demands:
        if left <= 0:
            break
        g = min(d.tokens, left)
        grants.append((d.request_id, g))
        left -= g
    return grants


class FCFSBatcher:
    """Arrival order under a token budget; the last request is trimmed to fit."""

    name = "fcfs"

    def __init__(self, token_budget: int) -> None:
        if token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {token_budget}")
        self.token_budget = token_budget
        self._order: dict[int, int] = {}
        self._seq = 0

    def add(self, request_id: int, weight: float = 1.0) -> None:
        if request_id not in self._order:
            self._order[request_id] = self._seq
            self._seq += 1

    def remove(self, request_id: int) -> None:
        self._order.pop(request_id, None)

    def select(
        self, demands: Sequence[VerifyDemand], resident: npt.NDArray[np.bool_] | None
    ) -> BatchDecision:
        order = self._order
        ordered = sorted(demands, key=lambda d: (order.get(d.request_id, 1 << 62), d.request_id))
        return BatchDecision(grants=first_come_grants(ordered, self.token_budget))


class DeficitBatcher:
    """The docs/design.md §4 deficit verify scheduler behind :class:`VerifyBatcher`.

    ``byte_budget=None`` is token-only mode (baseline B2); an int is the 2-D
    mode (PD), charging each item the marginal bytes of its predicted experts
    that are not resident; ``fixed_step_bytes`` turns on the marginal rule
    (docs/scheduler.md rule 4.4). The scheduler's union of the batch's missing
    experts comes back in :attr:`BatchDecision.missing` so the engine
    prefetches exactly that.

    **Uncontended steps.** A step whose demands all fit the token budget
    together and name no predicted expert is granted whole, in the demands'
    order, without consulting the scheduler (:attr:`uncontended_steps`
    counts them): there is nothing to share, and the scheduler would grant
    the same (every backlogged request is served in a step while the
    budget lasts: docs/scheduler.md rule 4, work conservation). A request
    whose earlier demand the scheduler still holds (not granted) must
    demand anew in the step, or the scheduler decides (it would serve that
    demand too). Such a step charges no credit and opens no lap, like
    expert-parallel carry steps (docs/design.md section 7): the deficit
    ledger and the bounds hold over the steps that consult the scheduler.
    The demands it still held of requests an uncontended step served are
    withdrawn before it runs again (served, they are no longer pending).
    Later contended steps can therefore choose otherwise than a scheduler
    consulted every step would (its credit and cursor moved in the
    uncontended steps). ``grant_uncontended=False`` consults it every step.
    """

    def __init__(
        self,
        *,
        token_budget: int,
        byte_budget: int | None,
        num_layers: int,
        num_experts: int,
        expert_nbytes: int,
        max_tokens_per_item: int | None = None,
        fixed_step_bytes: int | None = None,
        grant_uncontended: bool = True,
    ) -> None:
        self.name = "deficit_tokens" if byte_budget is None else "deficit_2d"
        #: grant uncontended steps whole without the scheduler (class docstring)
        self.grant_uncontended = grant_uncontended
        self._shape = (token_budget, num_layers, num_experts, expert_nbytes, max_tokens_per_item)
        self.scheduler = self._build(byte_budget, fixed_step_bytes)
        self._live: set[int] = set()
        # live requests whose latest demand named predicted experts (a
        # superset of the scheduler's pending demands that do)
        self._predicting: set[int] = set()
        #: steps granted whole without the scheduler (class docstring)
        self.uncontended_steps = 0
        # live requests whose demand the scheduler holds, not yet granted
        self._held: set[int] = set()
        # of those, the ones an uncontended step served since: their
        # demands are withdrawn before the scheduler's next step
        self._served_held: set[int] = set()

    def _build(
        self, byte_budget: int | None, fixed_step_bytes: int | None = None
    ) -> VerifyScheduler:
        from pdflash.scheduler import SchedulerConfig, VerifyScheduler

        token_budget, num_layers, num_experts, expert_nbytes, max_tokens_per_item = self._shape
        scheduler = VerifyScheduler(
            SchedulerConfig(
                token_budget=token_budget,
                missing_byte_budget=byte_budget,
                num_layers=num_layers,
                num_experts=num_experts,
                max_tokens_per_item=max_tokens_per_item,
                fixed_step_bytes=fixed_step_bytes,
            )
        )
        scheduler.set_expert_bytes(
            np.full((num_layers, num_experts), expert_nbytes, dtype=np.int64)
        )
        return scheduler

    @property
    def byte_budget(self) -> int | None:
        return self.scheduler.config.byte_budget

    def set_byte_budget(self, byte_budget: int, fixed_step_bytes: int | None = None) -> None:
        """Start over with a new missing-byte budget ``M`` (2-D mode only)
        and ``F``, the bytes the link moves in a step's fixed time (set: the
        marginal rule makes ``M`` soft against shared experts; ``None``: ``M``
        is hard). Only between workloads: with no live request there is no
        deficit or round-robin position to lose."""
        if self.name != "deficit_2d":
            raise ValueError("a token-only batcher has no byte budget to set")
        if self._live:
            raise RuntimeError(
                f"set_byte_budget with {len(self._live)} live requests would drop their credit"
            )
        self.scheduler = self._build(byte_budget, fixed_step_bytes)
        self._held.clear()
        self._served_held.clear()

    @property
    def fixed_step_bytes(self) -> int | None:
        """``F`` of the marginal rule in force (``None``: ``M`` is hard)."""
        return self.scheduler.fixed_step_bytes

    def set_fixed_step_bytes(self, fixed_step_bytes: int) -> None:
        """Change ``F`` between steps (:class:`pdflash.engine.fixed_step.FixedStepFeed`
        follows the engine's step-time fit); credit and ring order are kept.
        Raises ValueError (``F`` unchanged) where the rule is off or ``F`` is
        out of the scheduler's range."""
        if self.scheduler.fixed_step_bytes is None:
            raise ValueError("the marginal rule is off (set_byte_budget without F): no F to change")
        self.scheduler.set_fixed_step_bytes(fixed_step_bytes)

    def add(self, request_id: int, weight: float = 1.0) -> None:
        if request_id not in self._live:
            self.scheduler.add_request(request_id, weight)
            self._live.add(request_id)

    def remove(self, request_id: int) -> None:
        if request_id in self._live:
            self.scheduler.remove_request(request_id)
            self._live.discard(request_id)
            self._predicting.discard(request_id)
            self._held.discard(request_id)
            self._served_held.discard(request_id)

    def pause(self) -> None:
        """The steps until the next :meth:`select` are batched elsewhere (the
        PD controller's rest): the demands the scheduler holds now are
        withdrawn before it runs again (served meanwhile, or renewed)."""
        if self._held:
            self._served_held |= self._held
            self._held.clear()

    def _whole_grants(self, demands: Sequence[VerifyDemand]) -> list[tuple[int, int]] | None:
        """Every demand granted whole where the step is uncontended (class
        docstring); None where the scheduler decides (contended, a predicted
        expert named, or a demand the scheduler would reject: it raises)."""
        scheduler = self.scheduler
        config = scheduler.config
        if not self.grant_uncontended or scheduler.policy is not None:
            return None  # off, or a weight policy keeps books of every step
        cap = config.max_requests_per_step
        if not demands or (cap is not None and len(demands) > cap):
            return None
        left = config.token_budget
        item_limit = config.max_tokens_per_item
        live = self._live
        grants: list[tuple[int, int]] = []
        for d in demands:
            rid, tokens, pred = d.request_id, d.tokens, d.predicted
            if (
                type(rid) is not int
                or rid not in live
                or type(tokens) is not int
                or not 1 <= tokens <= left
                or (item_limit is not None and tokens > item_limit)
                or (pred is not None and pred.size)
            ):
                return None
            left -= tokens
            grants.append((rid, tokens))
        if len(grants) > 1 or self._held:
            ids = {rid for rid, _ in grants}
            if len(ids) != len(grants):
                return None  # a repeated request: the scheduler keeps its latest demand
            if not self._held <= ids:
                return None  # a held demand not renewed: the scheduler would serve it too
        return grants

    def select(
        self, demands: Sequence[VerifyDemand], resident: npt.NDArray[np.bool_] | None
    ) -> BatchDecision:
        whole = self._whole_grants(demands)
        if whole is not None:
            self.uncontended_steps += 1
            self.pause()  # its held demands are served in this step
            if self._predicting:
                self._predicting.difference_update(rid for rid, _ in whole)
            return BatchDecision(grants=whole, uncontended=True)
        scheduler, predicting = self.scheduler, self._predicting
        if self._served_held:
            for rid in self._served_held:
                scheduler.clear_demand(rid)
                predicting.discard(rid)
            self._served_held.clear()
        for d in demands:
            pred = d.predicted
            if pred is None or not pred.size:
                scheduler.update_demand(d.request_id, d.tokens - 1)
                predicting.discard(d.request_id)
            else:
                scheduler.update_demand(d.request_id, d.tokens - 1, pred)
                predicting.add(d.request_id)
        # the resident set only discounts predicted experts: while no pending
        # demand names one, every marginal byte count and the missing union
        # are empty whatever it holds (a demand with predictions has it sent
        # anew before its step)
        if resident is not None and self._predicting:
            self.scheduler.set_resident(resident)
        result = self.scheduler.step_grants()
        grants = list(zip(result.request_ids, result.token_grants, strict=True))
        held = self._held
        held.update(d.request_id for d in demands)
        held.difference_update(result.request_ids)
        return BatchDecision(grants=grants, missing=result.union_ids)


class ShadowComparison:
    """A :class:`VerifyBatcher` that runs ``primary`` and, on the same
    demands, a ``shadow`` batcher whose choice is only recorded.

    It answers "how often did the 2-D scheduler choose a different batch than
    the token-only one would have, and how many predicted-missing bytes did
    each choice carry": the primary's decision is executed; the shadow keeps
    its own round-robin state, fed the same demand and resident set every
    step. (The shadow's later choices therefore follow the primary's
    history of demands, not a history it would have made itself; the
    executed difference is what the token-only ablation row measures.)

    With :attr:`execute_shadow` set (the PD controller's token-only mode,
    :mod:`pdflash.engine.pd_controller`) the shadow's decision is executed
    instead; both keep being run and compared.

    With :attr:`compare` cleared (the PD controller at rest: no demand
    names a predicted expert) only the executed batcher runs; the other
    misses those steps (its round-robin state stays as it was), and
    :attr:`steps` counts the compared steps only (:attr:`uncompared_steps`
    the others).
    """

    def __init__(self, primary: VerifyBatcher, shadow: VerifyBatcher, expert_nbytes: int) -> None:
        self.primary = primary
        self.shadow = shadow
        self.name = primary.name
        self.expert_nbytes = int(expert_nbytes)
        self.steps = 0
        self.differing_steps = 0
        self.primary_missing_bytes = 0
        self.shadow_missing_bytes = 0
        #: execute the shadow's decision instead of the primary's
        self.execute_shadow = False
        self.shadow_executed_steps = 0
        #: run and compare both batchers (else only the executed one)
        self.compare = True
        self.uncompared_steps = 0

    def add(self, request_id: int, weight: float = 1.0) -> None:
        self.primary.add(request_id, weight)
        self.shadow.add(request_id, weight)

    def pause(self) -> None:
        """:meth:`PausableBatcher.pause` of both batchers that have it."""
        for batcher in (self.primary, self.shadow):
            if isinstance(batcher, PausableBatcher):
                batcher.pause()

    def remove(self, request_id: int) -> None:
        self.primary.remove(request_id)
        self.shadow.remove(request_id)

    def _missing_bytes(
        self,
        grants: list[tuple[int, int]],
        demands: Sequence[VerifyDemand],
        resident: npt.NDArray[np.bool_] | None,
    ) -> int:
        chosen = {rid for rid, _ in grants}
        sets = [d.predicted for d in demands if d.request_id in chosen and d.predicted is not None]
        if not sets:
            return 0
        union = np.unique(np.concatenate(sets))
        if resident is not None:
            union = union[~resident.reshape(-1)[union]]
        return int(union.size) * self.expert_nbytes

    def select(
        self, demands: Sequence[VerifyDemand], resident: npt.NDArray[np.bool_] | None
    ) -> BatchDecision:
        if not self.compare:
            self.uncompared_steps += 1
            if self.execute_shadow:
                self.shadow_executed_steps += 1
                return self.shadow.select(demands, resident)
            return self.primary.select(demands, resident)
        decision = self.primary.select(demands, resident)
        shadow = self.shadow.select(demands, resident)
        self.steps += 1
        if sorted(decision.grants) != sorted(shadow.grants):
            self.differing_steps += 1
        self.primary_missing_bytes += self._missing_bytes(decision.grants, demands, resident)
        self.shadow_missing_bytes += self._missing_bytes(shadow.grants, demands, resident)
        if self.execute_shadow:
            self.shadow_executed_steps += 1
            return shadow
        return decision
