"""ExpertStore packing, checkpoint formats and the clear errors on bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from pdflash.models import (
    CheckpointError,
    UnknownArchitectureError,
    UnsupportedConfigError,
    get_adapter_class,
    load_adapter,
    write_synthetic_checkpoint,
)
from pdflash.models.layout import ALIGN_BYTES, dequantize_mxfp4
from pdflash.models.store import INDEX_FILE, ExpertStore


def _store(path: Path, dtype: torch.dtype = torch.float32, **kw: object) -> ExpertStore:
    cfg = json.loads((path / "config.json").read_text())
    cls = get_adapter_class(cfg["model_type"])
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    return ExpertStore(
        path,
        cls.expert_layout(config, dtype),
        cls.expert_formats(config),
        config.num_hidden_layers,
        cls.num_experts_of(config),
        pin=False,
        **kw,  # type: ignore[arg-type]
    )


def _read(path: Path, key: str) -> torch.Tensor:
    index = json.loads((path / INDEX_FILE).read_text())["weight_map"]
    with safe_open(str(path / index[key]), "pt") as f:
        return f.get_tensor(key)


def test_qwen_experts_packed_contiguously_in_hub_order(tiny_checkpoints: dict[str, Path]) -> None:
    path = tiny_checkpoints["qwen3_moe"]
    store = _store(path, workers=2)
    assert store.format.name == "hub"
    assert store.expert_nbytes % ALIGN_BYTES == 0
    assert store.buffer.numel() == 2 * 8 * store.expert_nbytes
    for layer, expert in [(0, 0), (1, 5)]:
        g = layer * 8 + expert
        v = store.views(g)
        p = f"model.layers.{layer}.mlp.experts.{expert}."
        gate, up, down = (
            _read(path, p + n + ".weight") for n in ("gate_proj", "up_proj", "down_proj")
        )
        assert torch.equal(v["gate_up"], torch.cat([gate, up]))
        assert torch.equal(v["down"], down)
        # the views alias the packed bytes: one expert is one contiguous range
        assert v["gate_up"].data_ptr() == store.buffer.data_ptr() + g * store.expert_nbytes
        assert int(store.host_ptrs([g])[0]) == v["gate_up"].data_ptr()


def test_pack_converts_dtype(tiny_checkpoints: dict[str, Path]) -> None:
    path = tiny_checkpoints["mixtral"]
    store = _store(path, dtype=torch.bfloat16)
    w1 = _read(path, "model.layers.1.block_sparse_moe.experts.3.w1.weight")
    assert torch.equal(store.views(8 + 3)["gate_up"][:16], w1.to(torch.bfloat16))


def test_allocator_is_used_for_the_host_buffer(tiny_checkpoints: dict[str, Path]) -> None:
    made: list[int] = []

    def alloc(n: int) -> torch.Tensor:
        made.append(n)
        return torch.zeros(n, dtype=torch.uint8)

    store = _store(tiny_checkpoints["olmoe"], allocator=alloc)
    assert made == [store.total_nbytes]


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "olmoe"])
def test_transformers5_fused_format_loads_and_matches_hf(
    arch: str, tmp_path: Path, host_issuer: object
) -> None:
    from transformers import AutoModelForCausalLM

    path = write_synthetic_checkpoint(
        tmp_path / arch, arch, dtype=torch.float32, expert_format="fused"
    )
    assert "model.layers.0.mlp.experts.gate_up_proj" in load_file(str(path / "model.safetensors"))
    ad = load_adapter(path, issuer=host_issuer, cache_slots=4, max_batch_tokens=2)
    assert ad.store.format.name == "fused"
    ref = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, experts_implementation="eager"
    )
    ids = torch.arange(6) * 7 % 128
    with torch.no_grad():
        torch.testing.assert_close(
            ad.forward_logits(ids), ref(input_ids=ids[None]).logits[0], atol=1e-5, rtol=0
        )


def test_mxfp4_dequantize_matches_transformers() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 6, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(115, 135, (3, 6, 2), generator=g, dtype=torch.uint8)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)  # [E, 64, 6]
    for e in range(3):
        got = dequantize_mxfp4(blocks[e], scales[e], torch.bfloat16).t()
        assert torch.equal(got, want[e])


def test_gpt_oss_mxfp4_checkpoint_dequantized_at_pack_time(tmp_path: Path) -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    path = write_synthetic_checkpoint(
        tmp_path / "g", "gpt_oss", expert_format="mxfp4", shard_bytes=30_000
    )
    assert (
        json.loads((path / "config.json").read_text())["quantization_config"]["quant_method"]
        == "mxfp4"
    )
    store = _store(path, dtype=torch.bfloat16)
    assert store.format.name == "mxfp4"
    p = "model.layers.1.mlp.experts."
    want_gu = convert_moe_packed_tensors(
        _read(path, p + "gate_up_proj_blocks"), _read(path, p + "gate_up_proj_scales")
    )
    want_dn = convert_moe_packed_tensors(
        _read(path, p + "down_proj_blocks"), _read(path, p + "down_proj_scales")
    )
    for e in (0, 7):
        v = store.views(8 + e)
        assert torch.equal(v["gate_up"], want_gu[e])
        assert torch.equal(v["down"], want_dn[e])
        assert torch.equal(v["down_bias"], _read(path, p + "down_proj_bias")[e])


def test_missing_shard_names_the_file(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    path = shutil.copytree(tiny_checkpoints["qwen3_moe"], tmp_path / "ck")
    index = json.loads((path / INDEX_FILE).read_text())["weight_map"]
    victim = index["model.layers.1.mlp.experts.3.up_proj.weight"]
    (path / victim).unlink()
    with pytest.raises(CheckpointError, match=rf"shard file '{victim}'.*missing"):
        load_adapter(path)


def _rewrite(path: Path, key: str, new: torch.Tensor | None) -> str:
    index = json.loads((path / INDEX_FILE).read_text())
    shard = index["weight_map"][key]
    tensors = load_file(str(path / shard))
    if new is None:
        del tensors[key]
        del index["weight_map"][key]
        (path / INDEX_FILE).write_text(json.dumps(index))
    else:
        tensors[key] = new
    save_file(tensors, str(path / shard), metadata={"format": "pt"})
    return shard


def test_wrong_expert_shape_names_file_and_tensor(
    tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    path = shutil.copytree(tiny_checkpoints["olmoe"], tmp_path / "ck")
    key = "model.layers.1.mlp.experts.2.down_proj.weight"
    shard = _rewrite(path, key, torch.zeros(32, 15))
    with pytest.raises(
        CheckpointError, match=rf"{shard}: tensor '{key}' has shape \[32, 15\], expected \[32, 16\]"
    ):
        load_adapter(path)


def test_wrong_non_expert_shape_names_file_and_tensor(
    tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    path = shutil.copytree(tiny_checkpoints["gpt_oss"], tmp_path / "ck")
    key = "model.layers.0.self_attn.sinks"
    shard = _rewrite(path, key, torch.zeros(5))
    with pytest.raises(
        CheckpointError, match=rf"{shard}: tensor '{key}' has shape \[5\], expected \[4\]"
    ):
        load_adapter(path)


def test_missing_tensor_is_named(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    path = shutil.copytree(tiny_checkpoints["mixtral"], tmp_path / "ck")
    key = "model.layers.1.block_sparse_moe.experts.6.w3.weight"
    _rewrite(path, key, None)
    with pytest.raises(
        CheckpointError, match=rf"'{key}' \(layer 1, expert 6, hub naming\) not found"
    ):
        load_adapter(path)
    path2 = shutil.copytree(tiny_checkpoints["mixtral"], tmp_path / "ck2")
    key2 = "model.layers.0.self_attn.k_proj.weight"
    _rewrite(path2, key2, None)
    with pytest.raises(CheckpointError, match=rf"tensor '{key2}' not found"):
        load_adapter(path2)


def test_no_expert_naming_matches(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    path = shutil.copytree(tiny_checkpoints["qwen3_moe"], tmp_path / "ck")
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "mixtral"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        CheckpointError, match=r"no expert tensors for layer 0 expert 0.*block_sparse_moe"
    ):
        load_adapter(path)


def test_unknown_architecture(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    path = shutil.copytree(tiny_checkpoints["qwen3_moe"], tmp_path / "ck")
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "llama"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        UnknownArchitectureError, match=r"no pdflash adapter for model_type 'llama'; supported: \["
    ):
        load_adapter(path)
    with pytest.raises(UnknownArchitectureError, match="deepseek_v3"):
        get_adapter_class("deepseek_v3")


def test_dense_layers_are_refused(tmp_path: Path) -> None:
    with pytest.raises(
        UnsupportedConfigError, match=r"dense \(non-MoE\) layers \(mlp_only_layers=\[1\]"
    ):
        write_synthetic_checkpoint(
            tmp_path / "d", "qwen3_moe", config_overrides={"mlp_only_layers": [1]}
        )
    path = write_synthetic_checkpoint(tmp_path / "q", "qwen3_moe")
    cfg = json.loads((path / "config.json").read_text())
    cfg["decoder_sparse_step"] = 2
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedConfigError, match="decoder_sparse_step=2"):
        load_adapter(path)


def test_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        load_adapter(tmp_path)


def test_synthetic_is_labelled_and_seeded(tmp_path: Path) -> None:
    a = write_synthetic_checkpoint(tmp_path / "a", "olmoe", seed=3, num_layers=1)
    b = write_synthetic_checkpoint(
        tmp_path / "b", "olmoe", seed=3, num_layers=1, shard_bytes=10_000
    )
    c = write_synthetic_checkpoint(tmp_path / "c", "olmoe", seed=4, num_layers=1)
    meta = json.loads((a / "config.json").read_text())
    assert meta["pdflash_synthetic"]["seed"] == 3 and meta["num_hidden_layers"] == 1
    assert (b / INDEX_FILE).is_file() and not (a / INDEX_FILE).is_file()
    key = "model.layers.0.mlp.experts.5.up_proj.weight"
    ta = load_file(str(a / "model.safetensors"))[key]
    assert ta.dtype == torch.bfloat16
    assert torch.equal(ta, _read(b, key))  # independent of sharding
    assert not torch.equal(ta, load_file(str(c / "model.safetensors"))[key])
    with pytest.raises(ValueError, match="no synthetic preset 'huge'"):
        write_synthetic_checkpoint(tmp_path / "x", "olmoe", "huge")


def test_store_registers_its_buffer_with_the_issuer(tiny_checkpoints: dict[str, Path]) -> None:
    from pdflash.h2d import H2DIssuer

    issuer = H2DIssuer(backend="host")
    try:
        ad = load_adapter(tiny_checkpoints["qwen3_moe"], issuer=issuer, cache_fraction=1.0)
        ptr = ad.store.buffer.data_ptr()
        with pytest.raises(ValueError, match="already registered"):
            issuer.register_host(ptr, 16)
        ad.close()
        issuer.register_host(ptr, 16)  # close() unregistered it
        issuer.unregister_host(ptr)
    finally:
        issuer.close()


def test_store_registers_with_the_issuer_of_a_later_cache(
    tiny_checkpoints: dict[str, Path],
) -> None:
    from pdflash.cache import ExpertCache
    from pdflash.h2d import H2DIssuer

    ad = load_adapter(tiny_checkpoints["olmoe"])  # no issuer: nothing registered yet
    assert ad.cache is None and ad.store.registered_with is None
    with pytest.raises(RuntimeError, match="no expert cache attached"):
        ad.moe(0, torch.zeros(1, ad.hidden_size))
    first, second = H2DIssuer(backend="host"), H2DIssuer(backend="host")
    try:
        ptr = ad.store.buffer.data_ptr()
        for issuer in (first, second):
            ad.attach_cache(ExpertCache(ad.store, issuer, fraction=1.0, top_k=ad.top_k))
            assert ad.store.registered_with is issuer
            with pytest.raises(ValueError, match="already registered"):
                issuer.register_host(ptr, 16)
        first.register_host(ptr, 16)  # moving to `second` unregistered it from `first`
        out = ad.moe(1, torch.ones(3, ad.hidden_size))
        assert out.shape == (3, ad.hidden_size) and torch.isfinite(out).all()
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize(
    ("preset", "expert_params", "num_ids"),
    [
        ("qwen3-30b-a3b", 3 * 2048 * 768, 48 * 128),
        ("gpt-oss-20b", 2880 * 5760 + 5760 + 2880 * 2880 + 2880, 24 * 32),
        ("mixtral-8x7b", 3 * 4096 * 14336, 32 * 8),
        ("olmoe-1b-7b", 3 * 2048 * 1024, 16 * 64),
    ],
)
def test_published_presets_have_the_published_expert_shapes(
    preset: str, expert_params: int, num_ids: int
) -> None:
    from pdflash.models import PRESET_ARCH, synthetic_config
    from pdflash.models.synthetic import _tensor_specs

    arch = PRESET_ARCH[preset]
    config = synthetic_config(arch, preset)
    cls = get_adapter_class(arch)
    cls.validate_config(config)
    layout = cls.expert_layout(config, torch.bfloat16)
    assert sum(layout.numels.values()) == expert_params
    assert config.num_hidden_layers * cls.num_experts_of(config) == num_ids
    # every tensor the writer would emit, for 2 layers (meta only, no data)
    specs = _tensor_specs(arch, synthetic_config(arch, preset, num_layers=2), torch.bfloat16, None)
    expert_elems = sum(int(np.prod(s)) for name, s, _, _ in specs if ".experts." in name)
    assert expert_elems == 2 * cls.num_experts_of(config) * expert_params
