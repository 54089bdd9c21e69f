"""Lossless: greedy speculative output == plain greedy autoregressive output
of the target, token for token (fp32, CPU)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pdflash.engine.config import EngineConfig
from pdflash.engine.engine import Engine, RequestState

from .conftest import (
    greedy_reference,
    make_batcher_and_predictor,
    oracle_drafts,
    random_prompts,
)

MAX_NEW = 20


@pytest.fixture(scope="module")
def cases(hf_target: Any) -> list[tuple[list[int], list[int]]]:
    torch.set_num_threads(1)
    prompts = random_prompts(5, 0, hf_target.config.vocab_size)
    return [(p, greedy_reference(hf_target, p, MAX_NEW)) for p in prompts]


@pytest.mark.parametrize("baseline", ["B0", "B1", "B2", "B3", "PD"])
@pytest.mark.parametrize("oracle", [False, True])
def test_greedy_matches_autoregressive(
    baseline: str, oracle: bool, adapter: Any, drafter: Any, cases: list[Any]
) -> None:
    if baseline == "B0" and oracle:
        pytest.skip("B0 drafts nothing")
    cfg = EngineConfig.preset(baseline, block_size=6, max_running=3, token_budget=11)
    batcher, predictor = make_batcher_and_predictor(cfg, adapter)
    eng = Engine(
        adapter, cfg, drafter=drafter, batcher=batcher, predictor=predictor, max_seq_len=64
    )
    ids = [eng.add_request(p, max_new_tokens=MAX_NEW) for p, _ in cases]
    if oracle:
        oracle_drafts(eng, {rid: ref for rid, (_, ref) in zip(ids, cases, strict=True)}, seed=7)
    done = eng.run_until_done(max_steps=500)
    for rid, (_, ref) in zip(ids, cases, strict=True):
        assert done[rid].output == ref, (baseline, rid)
        assert done[rid].state == RequestState.FINISHED
        assert done[rid].metrics.finish_reason == "length"
        assert sum(done[rid].metrics.acceptance_lengths) == MAX_NEW - 1  # first token from prefill
    lengths = [a for r in done.values() for a in r.metrics.acceptance_lengths]
    if oracle:
        assert max(lengths) > 2  # long prefixes really were accepted
    assert eng.kv.used_pages == 0
    assert eng.draft_kv is None or eng.draft_kv.used_pages == 0
