"""The DFlash drafter: z-lab checkpoint loading and a differential test
against the reference implementation from the ``dflash`` PyPI package."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pdflash.engine.drafter import (
    DrafterConfig,
    DraftItem,
    load_drafter,
    synthetic_drafter_config,
    write_synthetic_drafter,
)
from pdflash.engine.kv_cache import PagedKVCache

dflash_model = pytest.importorskip("dflash.model")

HIDDEN = 64


def _reference(tmp_path: Path, layer_types: list[str] | None = None) -> torch.nn.Module:
    from transformers import Qwen3Config

    cfg = Qwen3Config(
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=101,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        layer_types=layer_types,
        sliding_window=5 if layer_types else None,
        use_sliding_window=bool(layer_types),
    )
    cfg.num_target_layers = 6
    cfg.dflash_config = {"target_layer_ids": [1, 3], "mask_token_id": 100, "block_size": 6}
    torch.manual_seed(0)
    model = dflash_model.DFlashDraftModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.15)
    model.save_pretrained(tmp_path)
    return model


def _kv(drafter: torch.nn.Module) -> PagedKVCache:
    return drafter.new_kv_cache(num_pages=16, page_size=4, device="cpu", dtype=torch.float32)


@pytest.mark.parametrize("layer_types", [None, ["sliding_attention", "full_attention"]])
def test_drafter_matches_reference_over_two_rounds(
    tmp_path: Path, layer_types: list[str] | None
) -> None:
    ref = _reference(tmp_path, layer_types)
    ours = load_drafter(tmp_path, dtype=torch.float32)
    assert ours.target_layer_ids == (1, 3)
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(1)
    feat_dim = 2 * HIDDEN
    ctx1 = torch.randn(1, 7, feat_dim, generator=gen)  # prompt features
    ctx2 = torch.randn(1, 3, feat_dim, generator=gen)  # committed after round 1
    blk1 = torch.randn(1, 6, HIDDEN, generator=gen)
    blk2 = torch.randn(1, 6, HIDDEN, generator=gen)

    # NOTE: a plain (non-sliding) cache: the reference's mask applies the window
    cache = DynamicCache()
    with torch.no_grad():
        r1 = ref(
            target_hidden=ctx1,
            noise_embedding=blk1,
            position_ids=torch.arange(0, 13)[None],
            past_key_values=cache,
            use_cache=True,
        )
        cache.crop(-(cache.get_seq_length() - 7))
        r2 = ref(
            target_hidden=ctx2,
            noise_embedding=blk2,
            position_ids=torch.arange(7, 16)[None],
            past_key_values=cache,
            use_cache=True,
        )
    kv = _kv(ours)
    kv.add_sequence(0)
    o1 = ours.forward_blocks(ctx1[0], blk1[0], [DraftItem(0, 7, 6)], kv)
    assert kv.length(0) == 7  # block rolled back, context kept
    o2 = ours.forward_blocks(ctx2[0], blk2[0], [DraftItem(0, 3, 6)], kv)
    assert kv.length(0) == 10
    torch.testing.assert_close(o1, r1[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o2, r2[0], rtol=1e-5, atol=1e-5)


def test_batched_drafting_equals_one_at_a_time(tmp_path: Path) -> None:
    _reference(tmp_path)
    ours = load_drafter(tmp_path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(2)
    ctx_a, ctx_b = (
        torch.randn(5, 2 * HIDDEN, generator=gen),
        torch.randn(9, 2 * HIDDEN, generator=gen),
    )
    blk_a, blk_b = torch.randn(6, HIDDEN, generator=gen), torch.randn(3, HIDDEN, generator=gen)
    kv = _kv(ours)
    kv.add_sequence(0)
    kv.add_sequence(1)
    both = ours.forward_blocks(
        torch.cat([ctx_a, ctx_b]),
        torch.cat([blk_a, blk_b]),
        [DraftItem(0, 5, 6), DraftItem(1, 9, 3)],
        kv,
    )
    kv2 = _kv(ours)
    kv2.add_sequence(7)
    a = ours.forward_blocks(ctx_a, blk_a, [DraftItem(7, 5, 6)], kv2)
    kv2.add_sequence(8)
    b = ours.forward_blocks(ctx_b, blk_b, [DraftItem(8, 9, 3)], kv2)
    torch.testing.assert_close(both, torch.cat([a, b]), rtol=1e-5, atol=1e-5)


def test_load_rejects_bad_checkpoints(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    _reference(tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    bad = dict(weights)
    bad["fc.weight"] = torch.zeros(3, 3)
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"'fc\.weight'.*shape"):
        load_drafter(tmp_path)
    missing = {k: v for k, v in weights.items() if k != "norm.weight"}
    save_file(missing, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensor 'norm\.weight'"):
        load_drafter(tmp_path)
    extra = dict(weights)
    extra["lm_head.weight"] = torch.zeros(2, 2)
    save_file(extra, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"unexpected tensor 'lm_head\.weight'"):
        load_drafter(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [1, 99]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="out of range"):
        load_drafter(tmp_path)


def test_sharded_checkpoint_with_model_prefix(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    ref = _reference(tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors").unlink()
    names = sorted(weights)
    half = len(names) // 2
    shards = {"a.safetensors": names[:half], "b.safetensors": names[half:]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({f"model.{k}": weights[k] for k in keys}, str(tmp_path / fname))
        weight_map.update({f"model.{k}": fname for k in keys})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    ours = load_drafter(tmp_path, dtype=torch.float32)
    torch.testing.assert_close(ours.fc.weight, ref.fc.weight)


@pytest.mark.parametrize("preset", ["tiny", "full"])
def test_synthetic_drafter_round_trips(tmp_path: Path, preset: str) -> None:
    target = {
        "hidden_size": 32,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "vocab_size": 50,
        "moe_intermediate_size": 16,
        "torch_dtype": "float32",
    }
    write_synthetic_drafter(tmp_path, target, preset, seed=3)
    drafter = load_drafter(tmp_path)
    cfg = synthetic_drafter_config(target, preset)
    assert json.loads((tmp_path / "config.json").read_text())["pdflash_synthetic"] is True
    assert drafter.cfg == DrafterConfig.from_dict(cfg) or drafter.cfg.target_layer_ids == tuple(
        cfg["dflash_config"]["target_layer_ids"]
    )
    assert all(0 <= i < 6 for i in drafter.target_layer_ids)
    assert drafter.fc.weight.shape == (32, 32 * len(drafter.target_layer_ids))
    with pytest.raises(ValueError, match="unknown drafter preset 'huge'"):
        write_synthetic_drafter(tmp_path / "x", target, "huge")


def test_drafter_written_beside_a_synthetic_target(tmp_path: Path) -> None:
    from pdflash.engine.drafter import drafter_writer
    from pdflash.models import write_synthetic_checkpoint

    write_synthetic_checkpoint(
        tmp_path,
        "gpt_oss",
        "tiny",
        num_layers=3,
        dtype=torch.float32,
        on_written=drafter_writer(seed=2),
    )
    drafter = load_drafter(tmp_path / "dflash-drafter")
    target = json.loads((tmp_path / "config.json").read_text())
    assert drafter.cfg.hidden_size == target["hidden_size"]
    assert drafter.cfg.vocab_size == target["vocab_size"]
    assert drafter.cfg.num_target_layers == 3
    assert drafter.fc.weight.dtype == torch.float32
