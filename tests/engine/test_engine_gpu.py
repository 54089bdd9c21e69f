"""The engine on CUDA (skipped without a GPU): lossless greedy decoding with
the CUDA issuer and a tiny expert cache, and a run_spec smoke run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pdflash.engine.config import EngineConfig
from pdflash.engine.drafter import load_drafter, write_synthetic_drafter
from pdflash.engine.engine import Engine

pytestmark = pytest.mark.gpu


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("baseline", ["B0", "B1", "B3"])
def test_lossless_on_cuda(tmp_path: Path, arch: str, baseline: str) -> None:
    from transformers import AutoModelForCausalLM

    from pdflash.h2d import H2DIssuer
    from pdflash.models import load_adapter, write_synthetic_checkpoint

    write_synthetic_checkpoint(
        tmp_path / "t", arch, "tiny", num_layers=4, dtype=torch.float32, seed=3
    )
    cfg = json.loads((tmp_path / "t" / "config.json").read_text())
    write_synthetic_drafter(tmp_path / "d", cfg, "tiny", seed=4, dtype=torch.float32)
    issuer = H2DIssuer(backend="cuda")
    try:
        slots = 32 if baseline == "B3" else 6  # 4 layers x 8 experts
        adapter = load_adapter(
            tmp_path / "t", device="cuda", issuer=issuer, cache_slots=slots, max_batch_tokens=1
        )
        drafter = load_drafter(tmp_path / "d", device="cuda")
        eng = Engine(
            adapter,
            EngineConfig.preset(baseline, block_size=5, max_running=2),
            drafter=drafter,
            expert_cache=adapter.cache,
            max_seq_len=48,
            device="cuda",
        )
        ref = AutoModelForCausalLM.from_pretrained(tmp_path / "t", dtype=torch.float32).eval()
        prompt = [5, 17, 3, 99, 42, 8]
        ids, expect = list(prompt), []
        with torch.no_grad():
            for _ in range(12):
                tok = int(ref(torch.tensor([ids])).logits[0, -1].argmax())
                expect.append(tok)
                ids.append(tok)
        rid = eng.add_request(prompt, max_new_tokens=12)
        eng.run_until_done(max_steps=200)
        assert eng.request(rid).output == expect
        assert int(np.asarray(adapter.cache.pins).sum()) == 0
        assert eng.timer.compute_busy_s() > 0
    finally:
        issuer.close()


@pytest.mark.gpu
def test_run_spec_on_cuda(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    from pdflash.bench.engine_run import RunSpec, run_spec

    result = run_spec(
        RunSpec(
            arch="tiny", baseline="B1", concurrency=2, block_size=8, max_new_tokens=16, prompt_len=8
        )
    )
    row = result.row
    assert row["device_type"] == "cuda" and row["issuer_backend"] == "cuda"
    assert row["output_tokens_per_s"] > 0 and row["link_gbps_measured"] > 0
    assert row["compute_busy_s"] > 0 and row["wall_s"] > 0


@pytest.mark.gpu
def test_pd_stream_on_cuda(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """PD's streaming prefetcher with the CUDA issuer: copies go out ROUTE_AHEAD,
    every pin is returned (run_spec asserts it) and the byte counters agree."""
    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    from pdflash.bench.engine_run import RunSpec, run_spec

    row = run_spec(
        RunSpec(
            arch="tiny",
            baseline="PD",
            concurrency=4,
            block_size=8,
            max_new_tokens=24,
            prompt_len=8,
            cache_fraction=0.5,
        )
    ).row
    assert row["device_type"] == "cuda" and row["streaming_prefetch"] is True
    assert row["route_ahead_bytes_submitted"] > 0
    assert 0 <= row["wasted_prefetch_bytes"] <= row["h2d_bytes"]
    assert row["output_tokens_per_s"] > 0
