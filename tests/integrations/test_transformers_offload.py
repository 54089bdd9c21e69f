"""``pdflash.integrations.transformers.offload``: the unchanged
``model.generate()`` over offloaded experts gives plain transformers' greedy
output (CPU, fp32, tiny synthetic checkpoints)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdflash.integrations.transformers import offload, offloaded
from pdflash.models import write_synthetic_checkpoint

pytestmark = pytest.mark.timeout(180)

PROMPTS = torch.tensor([[5, 17, 33, 9, 60, 7], [1, 2, 3, 4, 5, 6]])


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss", "glm4_moe"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch = request.param
    return write_synthetic_checkpoint(
        tmp_path_factory.mktemp(arch), arch, "tiny", dtype=torch.float32
    )


def _reference(path: Path) -> torch.Tensor:
    plain = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    out: torch.Tensor = plain.generate(PROMPTS, max_new_tokens=12, do_sample=False)
    return out


def test_offload_path_generate_equals_transformers(checkpoint: Path) -> None:
    want = _reference(checkpoint)
    model = offload(checkpoint, cache_fraction=0.3, device="cpu")
    try:
        got = model.generate(PROMPTS, max_new_tokens=12, do_sample=False)
        stats = model.pdflash.stats()
    finally:
        model.pdflash.close()
    assert torch.equal(got, want)
    # a 30% cache: experts were really copied in, and route-ahead prefetched some
    assert stats["misses"] > 0 and stats["bytes_in"] > 0
    assert stats["route_ahead_bytes"] > 0
    with pytest.raises(RuntimeError, match="no runtime"):
        model.generate(PROMPTS, max_new_tokens=2, do_sample=False)


def test_offload_loaded_model_generate_equals_transformers(checkpoint: Path) -> None:
    want = _reference(checkpoint)
    loaded = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    with offloaded(loaded, cache_fraction=0.3, device="cpu", route_ahead=False) as model:
        assert model is loaded
        assert not any(".experts." in n for n, _ in model.named_parameters())
        got = model.generate(PROMPTS, max_new_tokens=12, do_sample=False)
        assert model.pdflash.stats()["route_ahead_bytes"] == 0
    assert torch.equal(got, want)


def test_offload_meta_model_loads_from_checkpoint(checkpoint: Path) -> None:
    from transformers import AutoConfig, GenerationConfig

    want = _reference(checkpoint)
    config = AutoConfig.from_pretrained(str(checkpoint))
    with torch.device("meta"):
        empty = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with offloaded(empty, checkpoint=checkpoint, cache_fraction=0.5, device="cpu") as model:
        # from_config has no generation defaults: take the checkpoint's (eos)
        model.generation_config = GenerationConfig.from_pretrained(str(checkpoint))
        got = model.generate(PROMPTS, max_new_tokens=12, do_sample=False)
    assert torch.equal(got, want)


def test_offload_refuses_a_model_without_checkpoint(checkpoint: Path, tmp_path: Path) -> None:
    loaded = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    loaded.config._name_or_path = str(tmp_path)
    with pytest.raises(ValueError, match="checkpoint=DIR"):
        offload(loaded, device="cpu")
    with pytest.raises(ValueError, match="not both"):
        offload(checkpoint, cache_fraction=0.5, cache_gb=1.0)


def test_offload_evicts_layer_cyclic_by_default_and_lru_on_request(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default is the engine baselines' policy (layer_cyclic), told which
    MoE layer runs, in forward order; ``lru`` stays selectable. Both give
    plain transformers' greedy output."""
    from pdflash.cache.eviction import LayerCyclicPolicy
    from pdflash.models.offload import decoder_layers

    seen: list[int] = []
    told = LayerCyclicPolicy.before_layer

    def spy(self: LayerCyclicPolicy, layer: int) -> None:
        seen.append(layer)
        told(self, layer)

    monkeypatch.setattr(LayerCyclicPolicy, "before_layer", spy)
    want = _reference(checkpoint)
    with offloaded(checkpoint, cache_fraction=0.3, device="cpu") as model:
        assert model.pdflash.cache.policy.name == "layer_cyclic"
        layers = model.pdflash.adapter.num_layers
        got = model.generate(PROMPTS, max_new_tokens=12, do_sample=False)
        assert model.pdflash.stats()["misses"] > 0
    assert torch.equal(got, want)
    # one forward per generated token but the last (the prefill and 11 decode steps), each 0..L-1
    assert seen == list(range(layers)) * 12
    # closing the handle removed the layer hook with the others
    assert not any(layer._forward_pre_hooks for layer in decoder_layers(model))
    with offloaded(checkpoint, cache_fraction=0.3, device="cpu", eviction="lru") as model:
        assert model.pdflash.cache.policy.name == "lru"
        assert not any(layer._forward_pre_hooks for layer in decoder_layers(model))
        got = model.generate(PROMPTS, max_new_tokens=12, do_sample=False)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="unknown eviction policy"):
        offload(checkpoint, cache_fraction=0.3, device="cpu", eviction="fifo")
