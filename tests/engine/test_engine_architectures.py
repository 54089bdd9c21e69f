"""The engine over the shared-expert (qwen2_moe) and dense-first-layer
(glm4_moe) architectures: greedy output equals plain greedy decoding with
transformers, offloaded through a tiny expert cache, for the plain (B0),
speculative + route-ahead (PD) and hybrid host-expert (PD+host) pipelines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from .conftest import oracle_drafts
from .test_engine_offloaded import MAX_NEW, _stack, host_started_on, offloaded_checkpoint


@pytest.fixture(scope="module", params=["qwen2_moe", "glm4_moe"])
def checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[Any]]:
    # glm4_moe: 4 decoder layers, the first dense, so 3 MoE layers
    return offloaded_checkpoint(tmp_path_factory, request.param)


@pytest.mark.parametrize("baseline", ["B0", "PD", "PD+host"])
def test_engine_greedy_equals_plain_greedy(
    baseline: str, checkpoint: tuple[Path, list[Any]]
) -> None:
    tmp, cases = checkpoint
    eng, adapter, issuer = _stack(
        tmp,
        "x",
        baseline,
        cache_slots=6,
        controller=host_started_on(baseline),
        block_size=5,
        max_running=2,
        token_budget=8,
    )
    try:
        assert eng.kv.num_layers == adapter.num_decoder_layers
        ids = [eng.add_request(p, max_new_tokens=MAX_NEW) for p, _ in cases]
        if baseline != "B0":
            oracle_drafts(eng, {rid: ref for rid, (_, ref) in zip(ids, cases, strict=True)}, seed=5)
        done = eng.run_until_done(max_steps=400)
        for rid, (_, ref) in zip(ids, cases, strict=True):
            assert done[rid].output == ref, (baseline, rid)
        stats = adapter.cache.stats()
        assert stats["misses"] > 0 and stats["evictions"] > 0
        assert int(np.asarray(adapter.cache.pins).sum()) == 0
        assert eng.kv.used_pages == 0
        # the routing the engine recorded covers the MoE layers only
        assert eng.route_freq.shape == (adapter.num_layers, adapter.num_experts)
        assert eng.route_freq.sum() > 0
        if eng.host_service is not None:
            assert eng.host_service.books.experts > 0
    finally:
        if eng.host_service is not None:
            eng.host_service.close()
        issuer.close()
