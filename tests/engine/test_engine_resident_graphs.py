"""The engine's eager verify (PD, every expert resident) with recorded
all-resident layer calls on (:mod:`pdflash.models.resident_graphs`; the
recorder is the engine's CPU stand-in for CUDA graphs): lossless, the layers'
calls really replayed, nothing left pinned."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pdflash.engine.graphs import EagerBackend
from pdflash.models import offload
from pdflash.models.resident_graphs import ResidentGraphs, set_resident_graphs

from .conftest import oracle_drafts
from .test_engine_offloaded import MAX_NEW, _stack, offloaded_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    return offloaded_checkpoint(tmp_path_factory, "qwen3_moe")


def test_pd_all_resident_with_recorded_layer_calls_is_lossless(
    checkpoint: tuple[Path, list[Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    tmp, cases = checkpoint
    monkeypatch.setattr(
        offload, "ResidentGraphs", partial(ResidentGraphs, lambda _d: EagerBackend())
    )
    set_resident_graphs("on")
    try:
        eng, adapter, issuer = _stack(
            tmp, "x", "PD", cache_slots=1 << 20, block_size=5, max_running=2, token_budget=8
        )
        try:
            ids = [eng.add_request(p, max_new_tokens=MAX_NEW) for p, _ in cases]
            oracle_drafts(eng, {rid: ref for rid, (_, ref) in zip(ids, cases, strict=True)}, seed=5)
            done = eng.run_until_done(max_steps=400)
            for rid, (_, ref) in zip(ids, cases, strict=True):
                assert done[rid].output == ref, rid
            recorded = adapter.runtime.resident_graphs
            st = recorded.stats
            assert st.captures > 0 and st.replays > 0 and st.mismatches == 0, st.as_dict()
            assert recorded.num_graphs <= recorded.max_graphs
            assert int(np.asarray(adapter.cache.pins).sum()) == 0
        finally:
            issuer.close()
        adapter.close()
        assert recorded.num_graphs == 0
    finally:
        set_resident_graphs(None)
