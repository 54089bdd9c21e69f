"""The layer-cyclic eviction policy: Belady order at layer granularity."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pdflash.cache.eviction import LayerCyclicPolicy


def test_victims_follow_next_use_distance_then_predictions() -> None:
    pol = LayerCyclicPolicy(num_layers=4, num_experts=3)
    pol.reset(12)
    pol.on_insert(np.arange(12, dtype=np.int64), clock=1)
    pol.before_layer(2)
    cand = np.arange(12, dtype=np.int64)
    # distances from layer 2: layer 3 -> 1, layer 0 -> 2, layer 1 -> 3, layer 2 -> 4
    assert pol.next_use_distance(cand).tolist() == [2, 2, 2, 3, 3, 3, 4, 4, 4, 1, 1, 1]
    order = pol.victims(cand, 12).tolist()
    assert [g // 3 for g in order] == [2, 2, 2, 1, 1, 1, 0, 0, 0, 3, 3, 3]
    pol.set_predicted(np.array([6, 7], dtype=np.int64))  # layer 2's experts 0 and 1
    assert pol.victims(cand, 3).tolist()[0] == 8  # the unpredicted one goes first
    pol.before_layer(3)  # between forwards the last layer stays current
    assert [g // 3 for g in pol.victims(cand, 12).tolist()][:3] == [3, 3, 3]
    assert [g // 3 for g in pol.victims(cand, 12).tolist()][-3:] == [0, 0, 0]
    with pytest.raises(ValueError, match="layer 4 out of range"):
        pol.before_layer(4)
    with pytest.raises(ValueError, match="4x3 experts"):
        pol.reset(13)


def test_layer_cyclic_moves_fewer_bytes_than_lru_when_half_the_experts_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under the layer-cyclic sweep LRU evicts exactly what the next forward
    needs first; with half the experts cached the layer-cyclic policy must
    move clearly fewer bytes per token (same workload, same routing)."""
    from pdflash.bench.engine_run import RunSpec, run_spec

    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    per_token = {}
    for eviction in ("lru", "layer_cyclic"):
        spec = RunSpec(
            arch="tiny",
            layers=4,
            baseline="B1",
            concurrency=4,
            cache_fraction=0.5,
            max_new_tokens=32,
            eviction=eviction,
        )
        row = run_spec(spec).row
        assert row["eviction_policy"] == eviction
        per_token[eviction] = row["bytes_per_token"]
    assert per_token["layer_cyclic"] < 0.85 * per_token["lru"], per_token


@pytest.mark.parametrize("baseline", ["B0", "B1", "B2", "PD"])
def test_auto_eviction_is_layer_cyclic_for_every_offloaded_baseline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, baseline: str
) -> None:
    """A fair comparison: no offloaded baseline runs LRU (which thrashes the
    layer-cyclic forward) while PD gets the layer-cyclic policy."""
    from pdflash.bench.engine_run import RunSpec, run_spec

    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    spec = RunSpec(
        arch="tiny",
        layers=2,
        baseline=baseline,
        concurrency=1,
        cache_fraction=0.5,
        max_new_tokens=4,
    )
    assert spec.eviction == "auto"
    assert run_spec(spec).row["eviction_policy"] == "layer_cyclic"
