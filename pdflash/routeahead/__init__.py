"""Route-ahead: predict the experts a verify pass will route to, and count
how well the predictions did (docs/design.md §5).

One verify step, as the engine drives it::

    horizon = AcceptanceHorizon(block_size=16)
    predictor = CombinedPredictor(
        [(ApproxRouterPredictor(adapter), 1.0), (previous_round, 0.15), (prior, 0.05)],
        expert_nbytes=adapter.expert_nbytes, byte_budget=budget)
    stats = RouteAheadStats.for_adapter(adapter)

    blocks = [horizon.apply(b) for b in drafted_blocks]       # sets b.horizon
    scores = predict_batch(predictor, blocks)                  # (R, L, E) float32
    flat_ids = select_under_budget(scores.sum(0), adapter.expert_nbytes, budget)
    resident = cache.resident_mask()                           # before the copies
    cache.prefetch(flat_ids)                                   # Band.ROUTE_AHEAD
    ... verify; NextLayerLookahead.predict_next(layer, hidden) per layer ...
    routed = routed_bitsets_from_topk(topk_ids, token_request, R, E)
    stats.update_bitsets(pack_masks(scores > 0), routed, pack_masks(resident))
    for b, mask in zip(blocks, unpack_bitsets(routed, E)):
        predictor.observe(b.request_id, mask)
    for b, accepted in ...: horizon.observe(b.request_id, accepted)
    # on eviction: stats.record_eviction(evicted_flat_ids)
"""

from __future__ import annotations

from pdflash.routeahead.horizon import AcceptanceHorizon
from pdflash.routeahead.predictors import (
    ApproxRouterPredictor,
    CombinedPredictor,
    FrequencyPriorPredictor,
    FrequencySource,
    NextLayerLookahead,
    PreviousRoundPredictor,
    RouterAccess,
    TokenPriorPredictor,
    TokenRoutingObserver,
    predict_batch,
    select_under_budget,
)
from pdflash.routeahead.stats import (
    CopyCounts,
    RouteAheadSnapshot,
    RouteAheadStats,
    SetCounts,
    pack_masks,
    routed_bitsets_from_topk,
    unpack_bitsets,
)

__all__ = [
    "AcceptanceHorizon",
    "ApproxRouterPredictor",
    "CombinedPredictor",
    "CopyCounts",
    "FrequencyPriorPredictor",
    "FrequencySource",
    "NextLayerLookahead",
    "PreviousRoundPredictor",
    "RouteAheadSnapshot",
    "RouteAheadStats",
    "RouterAccess",
    "SetCounts",
    "TokenPriorPredictor",
    "TokenRoutingObserver",
    "pack_masks",
    "predict_batch",
    "routed_bitsets_from_topk",
    "select_under_budget",
    "unpack_bitsets",
]
