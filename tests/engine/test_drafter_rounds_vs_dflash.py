"""End to end against the reference: the same drafter weights and target run
through ``dflash``'s own generation loop and through the engine propose the
same draft tokens round after round (context features, draft KV across
rounds, anchor + MASK block, positions) and commit the same output."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from dflash_reference import dflash_twin

from pdflash.engine.config import EngineConfig
from pdflash.engine.drafter import load_drafter, write_synthetic_drafter
from pdflash.engine.engine import Engine

from .conftest import TINY

dflash_model = pytest.importorskip("dflash.model")


def test_draft_tokens_match_dflash_generate(tmp_path: Path, hf_target: Any, adapter: Any) -> None:
    write_synthetic_drafter(tmp_path, TINY, "tiny", seed=11, dtype=torch.float32)
    ours = load_drafter(tmp_path, dtype=torch.float32)
    ref, ref_drafts = dflash_twin(tmp_path, ours)
    block = ref.block_size
    assert block == ours.cfg.block_size == 16

    prompt = [7, 3, 55, 21, 90, 14, 2, 61, 33]
    max_new = 60
    with torch.no_grad():
        out = dflash_model.dflash_generate(
            ref, hf_target, torch.tensor([prompt]), max_new_tokens=max_new, stop_token_ids=None
        )
    ref_output = out[0, len(prompt) :].tolist()

    eng = Engine(
        adapter,
        EngineConfig.preset("B1", block_size=block, max_running=1),
        drafter=ours,
        max_seq_len=96,
    )
    our_drafts: list[list[int]] = []
    inner = eng._draft_blocks

    def capture(todo: list[Any]) -> None:
        inner(todo)
        for req, _ in todo:
            our_drafts.append(req.drafts.tolist())

    eng._draft_blocks = capture  # type: ignore[method-assign]
    rid = eng.add_request(prompt, max_new_tokens=max_new)
    eng.run_until_done(max_steps=200)
    assert eng.request(rid).output == ref_output[:max_new]
    # full blocks (B - 1 drafts) on both sides: every round until the last few
    full = [
        i
        for i in range(min(len(ref_drafts), len(our_drafts)))
        if len(ref_drafts[i]) == len(our_drafts[i]) == block - 1
    ]
    assert len(full) >= 3
    assert full == list(range(len(full)))
    for i in full:
        assert our_drafts[i] == ref_drafts[i], i
