"""A cache with a slot for every expert (``EngineConfig.full_cache``): every
offloaded engine fills it when built, as B3's, and runs none of the parts
that only serve a miss (no predictor, no stream, no lookahead, no background
copies, no PD controller); lossless; a smaller cache, or ``full_cache="off"``,
runs as configured."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pdflash.engine import Engine, EngineConfig
from pdflash.engine.config import NOTHING_TO_MISS

from .conftest import oracle_drafts
from .test_engine_offloaded import MAX_NEW, _stack, offloaded_checkpoint

#: more slots than experts (the cache clamps to the model's count)
FULL = 1 << 20
#: the parts each preset has on that only serve a miss
MISS_PARTS = {
    "PD": set(NOTHING_TO_MISS),
    "B1": {"lookahead"},
    "B2": {"lookahead"},
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    return offloaded_checkpoint(tmp_path_factory, "gpt_oss")


def _outputs(eng: Engine, cases: list[Any]) -> list[list[int]]:
    ids = [eng.add_request(p, max_new_tokens=MAX_NEW) for p, _ in cases]
    oracle_drafts(eng, {rid: ref for rid, (_, ref) in zip(ids, cases, strict=True)}, seed=5)
    done = eng.run_until_done(max_steps=400)
    return [list(done[rid].output) for rid in ids]


def _every_expert(adapter: Any) -> int:
    return int(adapter.num_layers * adapter.num_experts)


@pytest.mark.parametrize("baseline", ["PD", "B1", "B2"])
def test_full_cache_is_filled_when_built_and_runs_no_miss_machinery(
    baseline: str, checkpoint: tuple[Path, list[Any]]
) -> None:
    tmp, cases = checkpoint
    eng, adapter, issuer = _stack(
        tmp, "x", baseline, cache_slots=FULL, block_size=5, max_running=2, token_budget=8
    )
    try:
        cache = adapter.cache
        assert int(cache.num_slots) == _every_expert(adapter)
        # filled before the first request, as B3's
        assert np.asarray(cache.resident_mask(), dtype=bool).all()
        filled = int(cache.stats()["bytes_in"])
        assert filled == _every_expert(adapter) * int(cache.expert_nbytes)
        state = eng.full_cache_state()
        assert state["state"] == "filled" and state["by"] == "full_cache"
        assert set(state["switched_off"]) == MISS_PARTS[baseline]
        assert all(state["switched_off"].values())  # each with its reason
        # none of the parts that only serve a miss is built
        assert eng.predictor is None and eng.horizon is None and eng.parts is None
        assert eng.prefetch.built_stream is None and eng.prefetch.lookahead is None
        runtime = adapter.runtime
        assert not eng.runner.routed_hooks and not runtime.route_hooks
        # filled in layer order: each layer's experts in one span of the slab,
        # so every layer call runs B3's all-resident path over its own window
        assert runtime.path == "grouped"
        per_layer = adapter.num_experts
        assert [runtime._resident_window(layer) for layer in range(adapter.num_layers)] == [
            (layer * per_layer, per_layer) for layer in range(adapter.num_layers)
        ]

        outputs = _outputs(eng, cases)

        # lossless: plain greedy's tokens
        assert outputs == [ref for _, ref in cases]
        stats = cache.stats()
        # nothing copied after the fill, nothing missed
        assert int(stats["bytes_in"]) == filled and stats["misses"] == 0
        # no prediction, router pass, route-ahead, stream or background work ran
        assert eng.predict_s == 0.0 and eng.timer.kind_s("predict") == 0.0
        assert eng.prefetch.stage_s == {}
        assert all(v == 0 for v in eng.prefetch_bytes.values())
        assert int(np.asarray(cache.pins).sum()) == 0
        # every layer call of every forward took the all-resident path
        recorded = runtime.resident_graphs.stats.as_dict()
        assert sum(recorded["eager"].values()) == len(eng.routing_trace) > 0
    finally:
        issuer.close()


def test_pd_at_full_cache_equals_b3_and_plain_greedy(
    checkpoint: tuple[Path, list[Any]],
) -> None:
    tmp, cases = checkpoint
    got: dict[str, list[list[int]]] = {}
    for baseline in ("PD", "B3"):
        eng, _, issuer = _stack(
            tmp, "x", baseline, cache_slots=FULL, block_size=5, max_running=2, token_budget=8
        )
        try:
            got[baseline] = _outputs(eng, cases)
        finally:
            issuer.close()
    assert got["PD"] == got["B3"] == [ref for _, ref in cases]


def test_full_cache_off_runs_pd_as_configured(checkpoint: tuple[Path, list[Any]]) -> None:
    """The A/B arm: the cache fills on demand, PD's parts run."""
    tmp, cases = checkpoint
    eng, adapter, issuer = _stack(
        tmp,
        "x",
        "PD",
        cache_slots=FULL,
        block_size=5,
        max_running=2,
        token_budget=8,
        full_cache="off",
    )
    try:
        assert not np.asarray(adapter.cache.resident_mask(), dtype=bool).any()
        state = eng.full_cache_state()
        assert state["state"] == "off" and "full_cache off" in state["why_off"]
        assert eng.predictor is not None and eng.parts is not None
        assert eng.config == EngineConfig.preset(
            "PD", block_size=5, max_running=2, token_budget=8, full_cache="off"
        )
        assert _outputs(eng, cases) == [ref for _, ref in cases]
        assert adapter.cache.stats()["misses"] > 0
        assert "route_ahead" in eng.prefetch.stage_s
    finally:
        issuer.close()


def test_half_cache_runs_pd_unchanged(checkpoint: tuple[Path, list[Any]]) -> None:
    tmp, cases = checkpoint
    probe, adapter, issuer = _stack(tmp, "x", "B3", cache_slots=FULL)
    issuer.close()
    half = _every_expert(adapter) // 2
    eng, adapter, issuer = _stack(
        tmp, "x", "PD", cache_slots=half, block_size=5, max_running=2, token_budget=8
    )
    try:
        # not filled, nothing switched off: the preset as given
        assert not np.asarray(adapter.cache.resident_mask(), dtype=bool).any()
        assert eng.config == EngineConfig.preset("PD", block_size=5, max_running=2, token_budget=8)
        state = eng.full_cache_state()
        assert state["state"] == "off"
        assert state["why_off"] == (
            f"the expert cache has {half} slots for {_every_expert(adapter)} experts"
        )
        assert eng.predictor is not None and eng.parts is not None
        assert eng.prefetch.built_stream is not None
        assert _outputs(eng, cases) == [ref for _, ref in cases]
        assert "route_ahead" in eng.prefetch.stage_s and eng.timer.kind_s("predict") > 0
    finally:
        issuer.close()
    del probe


def test_b3_state_and_config_validation() -> None:
    with pytest.raises(ValueError, match="full_cache"):
        EngineConfig(full_cache="on")
    cfg, off = EngineConfig.preset("PD").without_miss_parts()
    assert set(off) == set(NOTHING_TO_MISS)
    assert not any(getattr(cfg, part) for part in NOTHING_TO_MISS)
    assert cfg.batching == "deficit_2d" and cfg.verify_width == "adaptive"
    b3, none = EngineConfig.preset("B3").without_miss_parts()
    assert none == {} and b3 == EngineConfig.preset("B3")
