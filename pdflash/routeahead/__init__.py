"""Route-ahead: predict the experts a verify pass will route to, and count
how well the predictions did (DESIGN.md §5)."""

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
    "pack_masks",
    "predict_batch",
    "routed_bitsets_from_topk",
    "select_under_budget",
]
