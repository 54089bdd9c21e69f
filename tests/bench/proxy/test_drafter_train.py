"""The DFlash drafter trainer: a block sees only target features strictly
before its anchor; the training forward equals the engine's drafter forward;
same-position labels and decaying weights; the trained checkpoint loads in
pdflash's engine and in the reference ``dflash`` loop with the same rounds;
the decoding loop equals plain greedy in fp32; anchor acceptance is exact."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from dflash_reference import dflash_twin
from pdflash.bench.proxy import drafter as dt
from pdflash.bench.proxy.decode import (
    anchor_tau,
    distinct_ratio,
    harmonic_mean,
    plain_greedy,
    speculative_decode,
)
from pdflash.bench.proxy.presets import drafter_preset
from pdflash.bench.proxy.target import heldout_prompts

from pdflash.engine.drafter import DraftItem, load_drafter
from pdflash.engine.sampling import SamplingParams

from .conftest import DRAFT_STEPS

TARGET_CFG = {
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 50,
    "rope_parameters": {"rope_theta": 10000.0},
}


def _random_drafter(tmp_path: Path) -> Any:
    cfg = dt.drafter_config(TARGET_CFG, drafter_preset("cpu-tiny"))
    model = dt.new_drafter(cfg, seed=3)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    dt.save_drafter(model, cfg, tmp_path, "float32")
    return load_drafter(tmp_path, dtype=torch.float32)


def _blocks(drafter: Any, feats: torch.Tensor, emb: torch.Tensor, anchors: list[int]) -> Any:
    with torch.no_grad():
        return dt.block_hidden(drafter, feats, emb, torch.tensor([anchors]))[0]


def test_a_block_cannot_see_features_at_or_after_its_anchor(tmp_path: Path) -> None:
    drafter = _random_drafter(tmp_path)
    B, H = drafter.cfg.block_size, drafter.cfg.hidden_size
    gen = torch.Generator().manual_seed(0)
    feats = torch.randn(1, 24, 2 * H, generator=gen)
    anchors = [5, 9, 14]
    emb = torch.randn(1, len(anchors), B, H, generator=gen)
    base = _blocks(drafter, feats, emb, anchors)

    future = feats.clone()
    future[:, 9:] += 5.0 * torch.randn(future[:, 9:].shape, generator=gen)  # at anchor 9 and after
    out = _blocks(drafter, future, emb, anchors)
    torch.testing.assert_close(out[0], base[0], rtol=0, atol=1e-6)  # anchor 5
    torch.testing.assert_close(out[1], base[1], rtol=0, atol=1e-6)  # anchor 9: its own position
    assert (out[2] - base[2]).abs().max() > 1e-3  # anchor 14 sees positions 9..13

    before = feats.clone()
    before[:, 8] += 5.0  # the last position before anchor 9
    out = _blocks(drafter, before, emb, anchors)
    torch.testing.assert_close(out[0], base[0], rtol=0, atol=1e-6)
    assert (out[1] - base[1]).abs().max() > 1e-3

    other = emb.clone()
    other[0, 2] += 1.0  # another block's tokens never leak
    out = _blocks(drafter, feats, other, anchors)
    torch.testing.assert_close(out[:2], base[:2], rtol=0, atol=1e-6)


def test_training_forward_equals_the_engine_drafter(tmp_path: Path) -> None:
    drafter = _random_drafter(tmp_path)
    B, H = drafter.cfg.block_size, drafter.cfg.hidden_size
    gen = torch.Generator().manual_seed(1)
    feats = torch.randn(1, 30, 2 * H, generator=gen)
    emb = torch.randn(1, 2, B, H, generator=gen)
    ours = _blocks(drafter, feats, emb, [11, 20])
    for j, a in enumerate((11, 20)):
        kv = drafter.new_kv_cache(num_pages=16, page_size=4, device="cpu", dtype=torch.float32)
        kv.add_sequence(0)
        with torch.no_grad():
            ref = drafter.forward_blocks(feats[0, :a], emb[0, j], [DraftItem(0, a, B)], kv)
        torch.testing.assert_close(ours[j], ref, rtol=1e-5, atol=1e-5)


def test_labels_weights_and_anchors() -> None:
    w = dt.loss_weights(6, 2.0)
    assert w[0] == 0.0 and w[1] == 1.0
    assert torch.all(w[2:] < w[1:-1])
    torch.testing.assert_close(w[3], torch.tensor(float(np.exp(-1.0))))
    tokens = torch.arange(100, 130)[None]
    anchors = torch.tensor([[3, 10]])
    lab = dt.block_labels(tokens, anchors, 4)
    assert lab.tolist() == [[[103, 104, 105, 106], [110, 111, 112, 113]]]
    emb_ids: list[Any] = []
    dt.embed_blocks(lambda ids: emb_ids.append(ids) or ids.float(), tokens, anchors, 4)
    assert emb_ids[0].tolist() == [[[103, 2, 2, 2], [110, 2, 2, 2]]]  # anchor then <|mask|>
    a = dt.sample_anchors(np.random.default_rng(0), 5, 10, 40, 8)
    assert a.shape == (5, 8) and a.min() >= 10 and a.max() <= 40
    assert all(len(set(r)) == 8 for r in a.tolist())


def test_drafter_trains_and_its_checkpoint_is_zlab_layout(
    trained_drafter: tuple[Path, dict[str, Any]], trained_target: tuple[Path, dict[str, Any]]
) -> None:
    path, prov = trained_drafter
    assert prov["steps"] == DRAFT_STEPS
    assert prov["final_loss"] < prov["first_loss"]
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["dflash_config"]["mask_token_id"] == 2
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 2]
    assert cfg["num_target_layers"] == 4 and cfg["pdflash_proxy"]["steps"] == DRAFT_STEPS
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "fc.weight" in names and "hidden_norm.weight" in names
    assert not any("embed" in n or "lm_head" in n for n in names)  # shared with the target


def test_decoding_loop_equals_plain_greedy_and_anchor_tau_is_exact(
    models: tuple[Any, Any], trained_target: tuple[Path, dict[str, Any]]
) -> None:
    target, drafter = models
    prompts = heldout_prompts(trained_target[0], "eval", 3, 20, 0)
    assert len(prompts) == 3
    for prompt, _ in prompts:
        res = speculative_decode(target, drafter, prompt, 30, SamplingParams())
        assert res.tokens == plain_greedy(target, prompt, 30)
        assert sum(res.acceptance) + 1 == 30
        # tau(a) at the loop's own round starts equals each round's commit
        starts = np.cumsum([len(prompt), *res.acceptance[:-1]])
        seq = torch.tensor([prompt + res.tokens])
        full = [i for i, r in enumerate(res.verify_rows) if r == drafter.cfg.block_size]
        taus = anchor_tau(
            target,
            drafter,
            seq,
            len(prompt),
            temperature=0.0,
            anchors=[int(starts[i]) for i in full if starts[i] <= seq.shape[1] - 8],
        )
        expect = [res.acceptance[i] for i in full if starts[i] <= seq.shape[1] - 8]
        assert taus.tolist() == expect
    gen = torch.Generator().manual_seed(0)
    sampled = speculative_decode(
        target, drafter, prompts[0][0], 30, SamplingParams(temperature=1.0), generator=gen
    )
    assert len(sampled.tokens) == 30 and sum(sampled.acceptance) == 29
    assert all(1 <= a <= drafter.cfg.block_size for a in sampled.acceptance)


def test_engine_runs_the_trained_pair_like_the_loop(
    trained_target: tuple[Path, dict[str, Any]],
    trained_drafter: tuple[Path, dict[str, Any]],
    models: tuple[Any, Any],
) -> None:
    from pdflash.engine.config import EngineConfig
    from pdflash.engine.engine import Engine
    from pdflash.h2d import H2DIssuer
    from pdflash.models import load_adapter

    target, drafter = models
    prompts = [p for p, _ in heldout_prompts(trained_target[0], "eval", 2, 20, 0)]
    issuer = H2DIssuer(backend="host")
    try:
        adapter = load_adapter(trained_target[0], issuer=issuer, cache_fraction=0.5)
        eng = Engine(
            adapter,
            EngineConfig.preset("B1", block_size=drafter.cfg.block_size, max_running=2),
            drafter=load_drafter(trained_drafter[0], dtype=torch.float32),
            expert_cache=adapter.cache,
            max_seq_len=96,
        )
        ids = [eng.add_request(p, max_new_tokens=24) for p in prompts]
        done = eng.run_until_done(max_steps=200)
        for rid, p in zip(ids, prompts, strict=True):
            assert done[rid].output == plain_greedy(target, p, 24)
            loop = speculative_decode(target, drafter, p, 24, SamplingParams())
            assert done[rid].metrics.acceptance_lengths == loop.acceptance
        assert adapter.cache.stats()["misses"] > 0  # experts really were offloaded
        adapter.close()
    finally:
        issuer.close()


def test_reference_dflash_loop_accepts_the_same_rounds(
    trained_drafter: tuple[Path, dict[str, Any]],
    trained_target: tuple[Path, dict[str, Any]],
    models: tuple[Any, Any],
) -> None:
    dflash_model = pytest.importorskip("dflash.model")
    target, drafter = models
    ref, ref_drafts = dflash_twin(trained_drafter[0], drafter)
    prompt = heldout_prompts(trained_target[0], "eval", 1, 20, 0)[0][0]
    max_new = 40
    with torch.no_grad():
        out = dflash_model.dflash_generate(
            ref, target, torch.tensor([prompt]), max_new_tokens=max_new, stop_token_ids=None
        )
    ours = speculative_decode(target, drafter, prompt, max_new, SamplingParams())
    assert out[0, len(prompt) :].tolist() == ours.tokens
    B = drafter.cfg.block_size
    # dflash shortens the block near the end; compare the rounds with full blocks
    full = [
        i
        for i in range(min(len(ref_drafts), len(ours.drafted)))
        if len(ref_drafts[i]) == B - 1 and ours.verify_rows[i] == B
    ]
    assert len(full) >= 2 and full == list(range(len(full)))
    for i in full:
        assert ours.drafted[i][1:] == ref_drafts[i], i


def test_distinct_ratio_and_harmonic_mean() -> None:
    assert distinct_ratio([1, 1, 1, 2]) == 0.5
    assert harmonic_mean([1.0, 4.0]) == pytest.approx(1.6)
    with pytest.raises(ValueError):
        harmonic_mean([])


def test_asking_for_cuda_without_cuda_fails_with_the_librarys_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The proxy resolves devices through pdflash.serve.build.resolve_device, so
    # a missing GPU is a clear error up front rather than a late torch failure.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="requested but CUDA is not available"):
        dt.train_drafter(
            tmp_path / "no-target", tmp_path / "out", drafter_preset("cpu-tiny"), device="cuda"
        )
