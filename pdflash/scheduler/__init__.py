"""The 2-D {tokens, missing-expert-bytes} deficit verify scheduler (docs/design.md §4).

Each step picks which live requests' verify blocks run together under a token
budget ``T`` and a budget ``M`` of *missing* expert bytes (bytes of the union
of the batch's predicted experts that are not resident). Fairness is deficit
round robin over one scalar, dominant-cost deficit.

Embedding it in a serving loop::

    from pdflash import SchedulerConfig, VerifyScheduler

    sched = VerifyScheduler(SchedulerConfig(
        token_budget=1024, missing_byte_budget=550_000_000,  # ~10 ms of PCIe
        num_layers=48, num_experts=128))
    sched.set_expert_bytes(expert_nbytes)        # (layers, experts) ints
    sched.add_request(rid, weight=1.0)           # on arrival
    while serving:
        sched.set_resident(cache.resident_mask())
        for rid, block in newly_drafted():       # after each draft
            sched.update_demand(rid, len(block.drafts), predicted_mask(block))
        batch = sched.step()
        prefetch(batch.union_ids)                # exactly the missing experts
        verify(zip(batch.request_ids, batch.token_grants))
        for rid in finished_or_aborted():
            sched.remove_request(rid)

``sched.step_grants()`` is the same step returning only the decision
(request ids, token grants, the missing union: a :class:`StepGrants`)
without :class:`StepResult`'s per-step diagnostic copies (deficits, quanta,
marginal bytes), for an engine that reads nothing else.

The rules (the native core and ``pdflash._reference.scheduler`` both
implement exactly these; ``docs/scheduler.md`` is the full specification,
with the invariants and the proofs of the liveness and fairness bounds):

1. **Ring.** Live requests are kept in arrival order (a sequence number
   given by ``add_request``). A request re-added after removal gets a new
   sequence number and zero credit.
2. **Demand.** ``update_demand`` sets ``t = 1 + drafts`` tokens and the
   predicted set ``X`` (none given: the empty set). A step that serves a
   request *consumes* its demand: it has none until the next
   ``update_demand`` (the engine drafts again). A request without demand is
   skipped, keeps its credit (bounded) and is owed no quanta for the laps it
   sat out (on becoming backlogged,
   ``credit_lap = max(credit_lap, lap - 1)``).
3. **Scan order.** A step scans the live requests with demand in ring order,
   starting at the first whose sequence number is >= the saved cursor
   (wrapping). The first of them is the *head*. The step *continues a
   visit* if the previous step left the visit open and the head is the
   request the cursor names.
4. **Passes.** For each not-yet-served candidate, in scan order:

   a. the step closes if it already holds ``max_requests_per_step`` items or
      no tokens are left;
   b. grant ``g = min(t, tokens left)`` (token trimming: a prefix of the
      drafts, never below 1 token);
   c. marginal bytes ``mb = bytes(X minus R minus the experts of the items
      already in the batch)``: charged in scan order, so a batch pays for the
      union of its missing experts, not the sum;
   d. if the batch is not empty and ``mb`` exceeds the bytes left, the item
      does not fit. Under the *marginal rule* (``fixed_step_bytes`` ``F``
      set) it is still admitted when it is normal (``mb <= M``) and raises
      the step's modelled tokens per second, ``g * (F + B) > tokens * mb``
      (``B``, ``tokens``: the batch's missing bytes and tokens so far; the
      step time ``t_fixed + t_tok * tokens + bytes / link`` with ``F =
      t_fixed * link``). Otherwise skip it, no credit change (an empty batch
      takes anything: that is how an oversize item runs);
   e. cost ``c = max(g / T, mb / M)`` (token-only mode: ``g / T``), the
      dominant share of the step's budgets;
   f. credit: if ``D < c`` and the request was not credited in the current
      lap, it receives one quantum ``w * Q`` for this lap (at most one
      quantum per lap, DRR; quanta of laps it was not credited in are not
      banked);
   g. if still ``D < c`` the request is credit-limited: skip it;
   h. serve it: ``D -= c``, record ``(g, mb, c)``; if ``mb > M`` it is the
      oversize exception and the step closes with it alone (under the
      marginal rule only items that rule admits join it).

   A pass that served something is followed by another (marginal costs only
   fall as the union grows). A pass that served nothing while some fitting
   candidate was credit-limited starts a new lap (``lap += 1``) and passes
   again (work conservation: no live item that fits both residual budgets,
   or the tokens and the marginal rule, is left out). Otherwise the step closes. A step with live work therefore
   never comes back empty: with an empty batch everything fits, and laps
   are opened until someone can pay.
5. **Cursor (the head's turn).**

   * If the head was served (anywhere in the batch) and its credit still
     covers the cost it just paid, its DRR visit continues: the next step
     starts at the head again -- *unless* the step continued its visit and
     the head received a quantum in it, which ends the visit. (Without
     continuation, a step that fits one item would be plain round robin and
     weights would not matter; without the exception, a head whose demand
     alternates is refilled by every lap the others open and never gives
     up the head position.)
   * If the head was not served and the step did not continue its visit,
     it waits for credit: the next step starts at it again.
   * Otherwise its turn is over: the next step starts at the first unserved
     candidate after it, or, if every candidate was served, at the head's
     ring successor (so the head role, which pays for bytes the others then
     share, rotates).

NOTE on trimming and deficit: an item is charged for the tokens it is
*granted* (``g``), not requested; the dropped trailing drafts are not
verified, not charged, and the demand is consumed (the engine re-drafts).
Trimming only happens when fewer than ``t`` tokens are left in the step.

NOTE on credit bounds: a quantum is only ever added while ``D < c``, so
``0 <= D < c_max + w * Q`` where ``c_max`` is the largest item cost seen
(oversize items included). The ledger is exact: ``D_after = D_before +
quanta - charged``; credit leaves only with the request.

Liveness (proved in ``docs/scheduler.md``; evaluated by
:func:`pdflash.scheduler.bounds.liveness_bound`): whatever every request's
demand is, a backlogged request is served within ``N * L + 1`` steps, where
``N`` counts the requests live while it waits, ``L = k (W + 1) + ceil(T
(c_max + w_max Q)) + 2``, ``k = ceil(c_max / (w_min Q))`` and ``W = ceil(T N
(c_max + 2 w_max Q))``: a quiet stretch without a new lap lasts at most
``W`` steps, a waiting head needs at most ``k`` laps, a visit pays at least
``1/T`` per step from bounded credit, and the cursor never passes a waiting
request, so at most ``N - 1`` turns come before its own.

Fairness (:func:`pdflash.scheduler.bounds.fairness_bound`): when every step
holds one item (the DRR-on-a-link case), two requests backlogged at every
step of an interval differ in weighted service over it by less than ``3Q +
c_max / w_a + c_max / w_b`` -- for any interval, not only from their
arrival. When several items share a step, an item that does not fit the
*residual* budget waits for the head position while smaller items are
packed around it: work conservation wins there, and that wait is bounded by
the liveness bound.

Determinism: same config and event sequence, same schedules; the only
order used is the ring (arrival) order; no clock, no hashing order. The
class is not thread-safe; ``step()`` releases the GIL inside the native
scan.
"""

from __future__ import annotations

from pdflash.scheduler.bounds import fairness_bound, liveness_bound
from pdflash.scheduler.config import MIN_WEIGHT, NORMAL_ITEM_COST_MAX, SchedulerConfig
from pdflash.scheduler.core import StepGrants, StepResult, UnknownRequestError, VerifyScheduler
from pdflash.scheduler.policies import DeadlinePolicy, FairPolicy, PolicyInput, WeightPolicy

__all__ = [
    "MIN_WEIGHT",
    "NORMAL_ITEM_COST_MAX",
    "DeadlinePolicy",
    "FairPolicy",
    "PolicyInput",
    "SchedulerConfig",
    "StepGrants",
    "StepResult",
    "UnknownRequestError",
    "VerifyScheduler",
    "WeightPolicy",
    "fairness_bound",
    "liveness_bound",
]
