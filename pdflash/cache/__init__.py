"""The device expert cache and its eviction policies."""

from __future__ import annotations

from pdflash.cache.eviction import (
    EvictionPolicy,
    LayerCyclicPolicy,
    LFUPolicy,
    LRUPolicy,
    RouteAheadPolicy,
    make_policy,
)
from pdflash.cache.expert_cache import CacheTooSmallError, ExpertCache, ExpertSource, quiesce

__all__ = [
    "CacheTooSmallError",
    "EvictionPolicy",
    "ExpertCache",
    "ExpertSource",
    "LFUPolicy",
    "LRUPolicy",
    "LayerCyclicPolicy",
    "RouteAheadPolicy",
    "make_policy",
    "quiesce",
]
