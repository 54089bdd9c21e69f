"""The 2-D {tokens, missing-expert-bytes} deficit verify scheduler (DESIGN §4).

Each step picks which live requests' verify blocks run together under a token
budget ``T`` and a budget ``M`` of *missing* expert bytes (bytes of the union
of the batch's predicted experts that are not resident). Fairness is deficit
round robin over one scalar, dominant-cost deficit.

The rules (the native core and ``pdflash._reference.scheduler`` both
implement exactly these):

1. **Ring.** Live requests are kept in arrival order (a sequence number
   given by ``add_request``; ties cannot occur, and would break by request
   id). A request re-added after removal gets a new sequence number and zero
   credit.
2. **Demand.** ``update_demand`` sets ``t = 1 + drafts`` tokens and the
   predicted set ``X``. A step that serves a request *consumes* its demand:
   it has none until the next ``update_demand`` (the engine drafts again). A
   request without demand is skipped and keeps its credit (which is bounded,
   and it gets no quantum while idle).
3. **Scan order.** A step scans the live requests with demand in ring order,
   starting at the first whose sequence number is >= the saved cursor
   (wrapping). The first of them is the *head*.
4. **Passes.** For each not-yet-served candidate, in scan order:
   a. the step closes if it already holds ``max_requests_per_step`` items or
      no tokens are left;
   b. grant ``g = min(t, tokens left)`` (token trimming: a prefix of the
      drafts, never below 1 token);
   c. marginal bytes ``mb = bytes(X minus R minus the experts of the items
      already in the batch)`` (charged in scan order: the union, not a sum);
   d. if the batch is not empty and ``mb`` exceeds the bytes left, the item
      does not fit: skip it, no credit change;
   e. cost ``c = max(g / T, mb / M)`` (token-only mode: ``g / T``);
   f. credit: the head (empty batch) opens new laps until it can pay
      (``while D < c``: if already credited in the current lap, ``lap += 1``;
      ``D += w * Q``). Any other candidate with ``D < c`` receives one quantum
      ``w * Q`` if it has not been credited in the current lap;
   g. if still ``D < c`` the request is credit-limited: skip it;
   h. serve it: ``D -= c``, record ``(g, mb, c)``; if ``mb > M`` it is the
      oversize exception and the step closes with it alone.
   A pass that served something is followed by another (marginal costs only
   fall as the union grows). A pass that served nothing while some fitting
   candidate was credit-limited starts a new lap (``lap += 1``) and passes
   again (work conservation). Otherwise the step closes.
5. **Cursor.** The head always runs. If afterwards its credit still covers
   the cost it just paid, its DRR visit continues: the next step starts at
   the head again (NOTE: without this, a step that fits one item would be
   plain round robin and weights would not matter). Otherwise the next step
   starts at the first unserved candidate of this scan (it becomes the head,
   so no request starves), or, if every candidate was served, at the head's
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
