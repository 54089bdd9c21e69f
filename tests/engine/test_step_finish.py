"""TargetRunner.finish's routed union per layer (the flat ids, sliced at the
layer boundaries) against a per-layer reference."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pdflash.engine.target import Chunk, TargetRunner


@pytest.mark.parametrize("density", [0.0, 0.03, 0.3, 1.0])
def test_finish_needed_flat_equals_per_layer_reference(density: float) -> None:
    layers, experts = 6, 16
    rng = np.random.default_rng(int(density * 100))
    routed = rng.random((3, layers, experts)) < density
    routed[:, 2] = False  # a layer nobody routed to
    lens = [2, 3, 1]
    chunks = [Chunk(i, torch.zeros(n, dtype=torch.int64), True) for i, n in enumerate(lens)]
    logits = torch.arange(6 * 5, dtype=torch.float32).reshape(6, 5)
    host = SimpleNamespace(adapter=SimpleNamespace(num_layers=layers, num_experts=experts))
    out = TargetRunner.finish(host, chunks, SimpleNamespace(lens=lens), logits, [], routed)  # type: ignore[arg-type]
    union = routed.any(axis=0)
    assert len(out.needed_flat) == layers
    for layer, got in enumerate(out.needed_flat):
        want = np.flatnonzero(union[layer]) + layer * experts
        assert got.dtype == np.int64 and got.tolist() == want.tolist()
    assert [t.shape[0] for t in out.logits] == lens
    assert out.logits_flat is logits
