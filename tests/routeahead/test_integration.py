"""Route-ahead wired to a real offloaded model: predict, prefetch through the
expert cache (host H2D issuer), verify, then book the step and the cache's
evictions into RouteAheadStats."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pdflash.protocols import Band, DraftedBlock, expert_mask
from pdflash.routeahead import (
    ApproxRouterPredictor,
    RouteAheadStats,
    pack_masks,
    routed_bitsets_from_topk,
    select_under_budget,
    unpack_bitsets,
)


class EvictionRecorder:
    """An eviction policy wrapper that books every eviction into the stats."""

    def __init__(self, base: Any, stats: RouteAheadStats) -> None:
        self.base = base
        self.stats = stats
        self.name = f"recording_{base.name}"
        self.evicted = 0

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.base, attr)

    def on_evict(self, flat_ids: Any) -> None:
        self.evicted += int(np.asarray(flat_ids).size)
        self.stats.record_eviction(flat_ids)
        self.base.on_evict(flat_ids)


def test_predict_prefetch_verify_book(tiny_moes: Any) -> None:
    from pdflash.cache.eviction import LRUPolicy
    from pdflash.h2d import H2DIssuer
    from pdflash.models import load_adapter

    tiny = tiny_moes("qwen3_moe")
    stats = RouteAheadStats(tiny.layers, tiny.experts, tiny.adapter.expert_nbytes)
    policy = EvictionRecorder(LRUPolicy(), stats)
    with H2DIssuer(backend="host") as issuer:
        adapter = load_adapter(
            tiny.path,
            dtype=torch.float32,
            issuer=issuer,
            cache_fraction=0.3,
            policy=policy,
            max_batch_tokens=16,
        )
        assert adapter.cache is not None
        routing: dict[int, torch.Tensor] = {}
        remove = adapter.add_route_hook(
            lambda layer, topk: routing.__setitem__(layer, topk.clone())
        )
        predictor = ApproxRouterPredictor(adapter)
        E, L = tiny.experts, tiny.layers
        budget = 12 * L * adapter.expert_nbytes  # 12 experts a layer on average
        routed_total = 0
        for step, ids in enumerate(tiny.tokens(6, 16, seed=3)):
            block = DraftedBlock(0, ids, torch.arange(16))
            scores = predictor.predict(block)
            chosen = select_under_budget(scores, adapter.expert_nbytes, budget)
            resident = adapter.cache.resident_mask().copy()  # before this step's copies
            adapter.cache.prefetch(chosen, Band.ROUTE_AHEAD)
            routing.clear()
            with torch.no_grad():
                adapter.forward_logits(ids)  # the verify forward, experts from the cache
            topk = torch.stack([routing[layer] for layer in range(L)]).long().numpy()
            routed = routed_bitsets_from_topk(topk, np.zeros(16, np.int64), 1, E)
            predicted = expert_mask(chosen, L, E)
            stats.update_bitsets(pack_masks(predicted), routed, pack_masks(resident))
            routed_total += int(unpack_bitsets(routed, E).sum())
            assert stats.steps == step + 1
        remove()
        snap = stats.snapshot()
        cache_stats = adapter.cache.stats()
        adapter.close()
    # the booked sets are the forward's real routing and the budgeted prediction
    assert snap.batch.routed == routed_total > 0
    assert 0 < snap.batch.predicted_bytes <= 6 * budget
    # a 30% cache forced evictions, and every one was shown to the stats
    assert policy.evicted > 0
    copies = snap.copies
    assert copies.prefetch_issued > 0
    assert copies.resident_routed + copies.prefetch_used + copies.demand_loads == snap.batch.routed
    assert copies.late_used + copies.evicted_before_use <= copies.prefetch_unused
    assert 0.0 <= float(snap.coverage) <= 1.0
    # the cache's own ledger saw prefetches evicted unused too, when ours did
    if copies.evicted_before_use:
        assert cache_stats["prefetch_bytes_evicted_unused"] > 0
    print(
        f"\nintegration: coverage={snap.coverage:.3f} precision={snap.precision:.3f} "
        f"evicted_before_use={copies.evicted_before_use} demand_loads={copies.demand_loads}"
    )
