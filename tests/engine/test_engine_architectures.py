"""The engine over the shared-expert (qwen2_moe) and dense-first-layer
(glm4_moe) architectures: greedy output equals plain greedy decoding with
transformers, offloaded through a tiny expert cache, for the plain (B0),
speculative + route-ahead (PD) and hybrid host-expert (PD+host) pipelines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pdflash.engine.drafter import write_synthetic_drafter

from .conftest import oracle_drafts
from .test_engine_offloaded import MAX_NEW, _stack


@pytest.fixture(scope="module", params=["qwen2_moe", "glm4_moe"])
def checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[Any]]:
    from transformers import AutoModelForCausalLM

    from pdflash.models import write_synthetic_checkpoint

    torch.set_num_threads(1)
    arch = request.param
    tmp = tmp_path_factory.mktemp(arch)
    # glm4_moe: 4 decoder layers, the first dense, so 3 MoE layers
    write_synthetic_checkpoint(
        tmp / "target", arch, "tiny", num_layers=4, dtype=torch.float32, seed=3
    )
    cfg = json.loads((tmp / "target" / "config.json").read_text())
    write_synthetic_drafter(tmp / "drafter", cfg, "tiny", seed=4, dtype=torch.float32)
    ref_model = AutoModelForCausalLM.from_pretrained(tmp / "target", dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    cases = []
    for n in (3, 9, 6):
        prompt = torch.randint(0, cfg["vocab_size"], (n,), generator=gen).tolist()
        ids, out = list(prompt), []
        with torch.no_grad():
            for _ in range(MAX_NEW):
                tok = int(ref_model(torch.tensor([ids])).logits[0, -1].argmax())
                out.append(tok)
                ids.append(tok)
        cases.append((prompt, out))
    return tmp, cases


@pytest.mark.parametrize("baseline", ["B0", "PD", "PD+host"])
def test_engine_greedy_equals_plain_greedy(
    baseline: str, checkpoint: tuple[Path, list[Any]]
) -> None:
    tmp, cases = checkpoint
    eng, adapter, issuer = _stack(
        tmp, "x", baseline, cache_slots=6, block_size=5, max_running=2, token_budget=8
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
