"""The 2-D {tokens, missing-expert-bytes} deficit verify scheduler (DESIGN §4).

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

The rules (the native core and ``pdflash._reference.scheduler`` both
implement exactly these):

1. **Ring.** Live requests are kept in arrival order (a sequence number
   given by ``add_request``; ties cannot occur, and would break by request
   id). A request re-added after removal gets a new sequence number and zero
   credit.
2. **Demand.** ``update_demand`` sets ``t = 1 + drafts`` tokens and the
   predicted set ``X``. A step that serves a request *consumes* its demand:
   it has none until the next ``update_demand`` (the engine drafts again). A
   request without demand is skipped, keeps its credit (bounded) and is owed
   no quanta for the laps it sat out.
3. **Scan order.** A step scans the live requests with demand in ring order,
   starting at the first whose sequence number is >= the saved cursor
   (wrapping). The first of them is the *head*.
4. **Passes.** For each not-yet-served candidate, in scan order:

   a. the step closes if it already holds ``max_requests_per_step`` items or
      no tokens are left;
   b. grant ``g = min(t, tokens left)`` (token trimming: a prefix of the
      drafts, never below 1 token);
   c. marginal bytes ``mb = bytes(X minus R minus the experts of the items
      already in the batch)``: charged in scan order, so a batch pays for the
      union of its missing experts, not the sum;
   d. if the batch is not empty and ``mb`` exceeds the bytes left, the item
      does not fit: skip it, no credit change (an empty batch takes anything:
      that is how an oversize item runs);
   e. cost ``c = max(g / T, mb / M)`` (token-only mode: ``g / T``), the
      dominant share of the step's budgets;
   f. credit: while ``D < c`` and the request has not been credited for
      every lap since it became backlogged, it receives one quantum
      ``w * Q`` for the next such lap (at most one quantum per lap, DRR);
   g. if still ``D < c`` the request is credit-limited: skip it;
   h. serve it: ``D -= c``, record ``(g, mb, c)``; if ``mb > M`` it is the
      oversize exception and the step closes with it alone.

   A pass that served something is followed by another (marginal costs only
   fall as the union grows). A pass that served nothing while some fitting
   candidate was credit-limited starts a new lap (``lap += 1``) and passes
   again (work conservation: no live item that fits both residual budgets is
   left out). Otherwise the step closes. A step with live work therefore
   never comes back empty: with an empty batch everything fits, and laps
   are opened until someone can pay.
5. **Cursor.** If the head was served and its credit still covers the cost
   it just paid, its DRR visit continues: the next step starts at the head
   again (NOTE: without this, a step that fits one item would be plain round
   robin and weights would not matter). Otherwise the next step starts at
   the first unserved candidate of this scan, or, if every candidate was
   served, at the head's ring successor (so the head role, which pays for
   bytes the others then share, rotates).

NOTE on trimming and deficit: an item is charged for the tokens it is
*granted* (``g``), not requested; the dropped trailing drafts are not
verified, not charged, and the demand is consumed (the engine re-drafts).
Trimming only happens when fewer than ``t`` tokens are left in the step.

NOTE on credit bounds: a quantum is only ever added while ``D < c``, so
``0 <= D < c_max + w * Q`` where ``c_max`` is the largest item cost seen
(oversize items included). The ledger is exact: ``D_after = D_before +
quanta - charged``; credit leaves only with the request.

NOTE on fairness: every request gets at most one quantum per lap. When a
step holds one item (the DRR-on-a-link case) two continuously backlogged
requests differ in weighted service by at most ``c_max + Q + max(c_max,
Q)``, which is DESIGN's ``c_max + 2Q`` whenever ``c_max <= Q`` (always, short
of oversize items, since ``Q >= 1``). When several items share a step, an
item that does not fit the *residual* budget waits for the head position
while smaller items are packed around it: work conservation wins there, and
that wait is bounded (see ``InvariantTracker.starvation_bound``).

Determinism: same config and event sequence, same schedules; the only
order used is the ring (arrival) order; no clock, no hashing order. The
class is not thread-safe; ``step()`` releases the GIL inside the native
scan.
"""

from __future__ import annotations

from pdflash.scheduler.config import MIN_WEIGHT, NORMAL_ITEM_COST_MAX, SchedulerConfig
from pdflash.scheduler.core import StepResult, UnknownRequestError, VerifyScheduler
from pdflash.scheduler.policies import DeadlinePolicy, FairPolicy, PolicyInput, WeightPolicy

__all__ = [
    "MIN_WEIGHT",
    "NORMAL_ITEM_COST_MAX",
    "DeadlinePolicy",
    "FairPolicy",
    "PolicyInput",
    "SchedulerConfig",
    "StepResult",
    "UnknownRequestError",
    "VerifyScheduler",
    "WeightPolicy",
]
