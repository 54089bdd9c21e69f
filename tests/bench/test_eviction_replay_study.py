"""bench/eviction_replay_study.py: its replay harness against the reference
replays of pdflash.report.belady, and its closed loop on a small trace."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pdflash.bench import eviction_replay_study as study

from pdflash.cache.eviction import LayerCyclicPolicy, LFUPolicy, LRUPolicy
from pdflash.report.belady import belady, lru

H200 = Path(__file__).resolve().parents[2] / "bench" / "results" / "h200"


def _random_accesses(seed: int, layers: int = 3, experts: int = 16, steps: int = 60):
    rng = np.random.default_rng(seed)
    return [
        (layer, np.unique(rng.integers(0, experts, size=int(rng.integers(1, 8)))) + layer * experts)
        for _ in range(steps)
        for layer in range(layers)
    ]


@pytest.mark.parametrize("seed", range(6))
def test_the_replay_matches_the_reference_lru_and_never_beats_belady(seed: int) -> None:
    acc = _random_accesses(seed)
    ids = [a for _, a in acc]
    for slots in (8, 13, 29):
        got = study.replay(acc, slots, 48, LRUPolicy())
        assert got == lru(ids, slots, 1).loads
        best = belady(ids, slots, 1).loads
        freq = study.step_frequency([[a] for _, a in acc], 48)
        for policy in (
            LFUPolicy(),
            LayerCyclicPolicy(3, 16, LRUPolicy()),
            LayerCyclicPolicy(3, 16, LFUPolicy()),
            study.FrequencyOracle(3, 16, freq),
        ):
            assert study.replay(acc, slots, 48, policy) >= best


def test_the_closed_loop_on_the_committed_trace() -> None:
    """Every recorded round is taken exactly once, at most ``clients`` at a
    step, and a step's layer accesses are its rows' unions."""
    from pdflash.traces import load_trace

    trace = load_trace(H200 / "proxy-balanced-2026-12-01" / "trace_gpu_t1.npz")
    steps = study.closed_loop_steps(trace, 4, 15)
    layers, experts = int(trace.provenance["num_layers"]), int(trace.provenance["num_experts"])
    assert all(len(s) == layers for s in steps)
    # at most 4 rounds a step: at least ceil(rounds / 4) steps
    assert len(steps) >= -(-trace.round_request.size // 4)
    # full width: every recorded row's experts appear, once per step they are in
    total = sum(int(np.unique(trace.verify_topk[:, layer, :]).size) for layer in range(layers))
    seen = {int(g) for s in steps for ids in s for g in ids}
    assert len(seen) == total
    for s in steps:
        for layer, ids in enumerate(s):
            assert ids.size and np.all(ids // experts == layer)
    rows = study.study(trace, 4, [0.2], [1])
    assert len(rows) == 1 and rows[0]["belady_loads"] > 0
    assert rows[0]["layer_cyclic(lru)_vs_belady"] >= 1.0
