"""The architecture extension API: an adapter defined outside pdflash, for a
model type pdflash does not ship, registered with ``register_adapter`` or
found through a ``pdflash.adapters`` entry point, runs end to end (load,
offloaded forward equal to transformers', a greedy engine run equal to plain
greedy) using only public names."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from issuer_fixtures import token_ids
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM, modeling_qwen3_moe

from pdflash.models import (
    ENTRY_POINT_GROUP,
    MoEAdapterBase,
    SwiGLUAdapter,
    UnknownArchitectureError,
    available_architectures,
    get_adapter_class,
    load_adapter,
    register_adapter,
    unregister_adapter,
)

ATOL = 1e-5


# -- a model type transformers and pdflash do not know, defined here ---------


class OutsideMoeConfig(Qwen3MoeConfig):
    model_type = "pdflash_outside_moe"


class OutsideMoeForCausalLM(Qwen3MoeForCausalLM):
    config_class = OutsideMoeConfig


AutoConfig.register("pdflash_outside_moe", OutsideMoeConfig, exist_ok=True)
AutoModelForCausalLM.register(OutsideMoeConfig, OutsideMoeForCausalLM, exist_ok=True)


class OutsideMoeAdapter(SwiGLUAdapter):
    """Public API only: class attributes plus the q/k-norm hook."""

    arch = "pdflash_outside_moe"
    modeling: ClassVar[Any] = modeling_qwen3_moe
    hf_block_class = "Qwen3MoeSparseMoeBlock"

    @classmethod
    def num_experts_of(cls, config: Any) -> int:
        return int(config.num_experts)

    @classmethod
    def moe_intermediate_size(cls, config: Any) -> int:
        return int(config.moe_intermediate_size)

    def qkv(self, attn: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t, d = x.shape[0], self.head_dim
        q = attn.q_norm(attn.q_proj(x).view(t, -1, d))
        k = attn.k_norm(attn.k_proj(x).view(t, -1, d))
        return q, k, attn.v_proj(x).view(t, -1, d)


def _tiny_config(config_cls: type, **extra: Any) -> Any:
    return config_cls(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        max_position_embeddings=256, **extra,
    )  # fmt: skip


def _save_random_model(model_cls: type, config: Any, path: Path) -> Any:
    """A checkpoint written by transformers itself (not pdflash's writer)."""
    torch.manual_seed(0)
    model = model_cls(config).to(torch.float32).eval()
    with torch.no_grad():  # init std 0.02 gives near-flat logits; widen them
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    model.save_pretrained(path)
    return model


def _greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            tok = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(tok)
            ids.append(tok)
    return out


def _engine_greedy(adapter: Any, prompt: list[int], n: int) -> list[int]:
    from pdflash.engine.config import EngineConfig
    from pdflash.engine.engine import Engine

    eng = Engine(adapter, EngineConfig.preset("B0"), expert_cache=adapter.cache, max_seq_len=64)
    rid = eng.add_request(prompt, max_new_tokens=n)
    out: list[int] = eng.run_until_done(max_steps=200)[rid].output
    return out


def _check_end_to_end(path: Path, model: Any, adapter_cls: type, issuer: Any) -> None:
    ad = load_adapter(path, issuer=issuer, cache_slots=4, max_batch_tokens=2)
    assert type(ad) is adapter_cls
    ids = token_ids(9, 1)
    with torch.no_grad():
        want = model(input_ids=ids[None]).logits[0]
        torch.testing.assert_close(ad.forward_logits(ids), want, atol=ATOL, rtol=0)
    prompt = ids[:5].tolist()
    assert _engine_greedy(ad, prompt, 8) == _greedy(model, prompt, 8)
    assert ad.cache is not None and ad.cache.stats()["evictions"] > 0
    ad.close()


@pytest.fixture
def registered() -> Iterator[None]:
    register_adapter("pdflash_outside_moe", OutsideMoeAdapter)
    yield
    unregister_adapter("pdflash_outside_moe")


def test_outside_adapter_registered_at_run_time_runs_end_to_end(
    registered: None, tmp_path: Path, host_issuer: Any
) -> None:
    assert "pdflash_outside_moe" in available_architectures()
    assert get_adapter_class("pdflash_outside_moe") is OutsideMoeAdapter
    model = _save_random_model(OutsideMoeForCausalLM, _tiny_config(OutsideMoeConfig), tmp_path)
    _check_end_to_end(tmp_path, model, OutsideMoeAdapter, host_issuer)


def test_register_adapter_refuses_bad_registrations() -> None:
    class NotAnAdapter:
        arch = "pdflash_outside_moe"

    with pytest.raises(TypeError, match=r"subclass of pdflash\.models\.MoEAdapterBase"):
        register_adapter("pdflash_outside_moe", NotAnAdapter)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"arch is 'pdflash_outside_moe'.*'other_moe'"):
        register_adapter("other_moe", OutsideMoeAdapter)

    class NoBlock(MoEAdapterBase):
        arch = "pdflash_no_block"

    with pytest.raises(TypeError, match="does not set"):
        register_adapter("pdflash_no_block", NoBlock)
    # a built-in name needs replace=True; replacing then unregistering restores it
    builtin = get_adapter_class("qwen3_moe")

    class MyQwen3(OutsideMoeAdapter):
        arch = "qwen3_moe"

    with pytest.raises(ValueError, match="already built in; pass replace=True"):
        register_adapter("qwen3_moe", MyQwen3)
    assert get_adapter_class("qwen3_moe") is builtin
    register_adapter("qwen3_moe", MyQwen3, replace=True)
    try:
        assert get_adapter_class("qwen3_moe") is MyQwen3
    finally:
        unregister_adapter("qwen3_moe")
    assert get_adapter_class("qwen3_moe") is builtin
    with pytest.raises(KeyError):
        unregister_adapter("qwen3_moe")
    with pytest.raises(UnknownArchitectureError, match="register_adapter"):
        get_adapter_class("pdflash_nothing_moe")


PLUGIN = '''
"""A separate package adding an architecture to pdflash (test fixture)."""
from typing import Any, ClassVar

from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM, modeling_qwen3_moe

from pdflash.models import SwiGLUAdapter


class PluginMoeConfig(Qwen3MoeConfig):
    model_type = "pdflash_plugin_moe"


class PluginMoeForCausalLM(Qwen3MoeForCausalLM):
    config_class = PluginMoeConfig


AutoConfig.register("pdflash_plugin_moe", PluginMoeConfig, exist_ok=True)
AutoModelForCausalLM.register(PluginMoeConfig, PluginMoeForCausalLM, exist_ok=True)


class PluginMoeAdapter(SwiGLUAdapter):
    arch = "pdflash_plugin_moe"
    modeling: ClassVar[Any] = modeling_qwen3_moe
    hf_block_class = "Qwen3MoeSparseMoeBlock"

    @classmethod
    def num_experts_of(cls, config):
        return int(config.num_experts)

    @classmethod
    def moe_intermediate_size(cls, config):
        return int(config.moe_intermediate_size)

    def qkv(self, attn, x):
        t, d = x.shape[0], self.head_dim
        q = attn.q_norm(attn.q_proj(x).view(t, -1, d))
        k = attn.k_norm(attn.k_proj(x).view(t, -1, d))
        return q, k, attn.v_proj(x).view(t, -1, d)


NOT_AN_ADAPTER = 42
'''


@pytest.fixture
def plugin_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An installed-looking distribution (dist-info with entry points) on sys.path."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "pdflash_test_plugin.py").write_text(PLUGIN)
    info = site / "pdflash_test_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: pdflash-test-plugin\nVersion: 0.1\n"
    )
    (info / "entry_points.txt").write_text(
        textwrap.dedent(
            f"""\
            [{ENTRY_POINT_GROUP}]
            pdflash_plugin_moe = pdflash_test_plugin:PluginMoeAdapter
            pdflash_broken_moe = pdflash_test_plugin:NOT_AN_ADAPTER
            pdflash_missing_moe = pdflash_test_plugin_missing:Adapter
            """
        )
    )
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, "pdflash_test_plugin", raising=False)
    return tmp_path


def test_entry_point_adapter_is_loaded_lazily_and_runs_end_to_end(
    plugin_on_path: Path, host_issuer: Any
) -> None:
    assert "pdflash_plugin_moe" in available_architectures()
    assert "pdflash_test_plugin" not in sys.modules  # listed, not imported
    cls = get_adapter_class("pdflash_plugin_moe")
    plugin = sys.modules["pdflash_test_plugin"]
    assert cls is plugin.PluginMoeAdapter
    ckpt = plugin_on_path / "ckpt"
    model = _save_random_model(
        plugin.PluginMoeForCausalLM, _tiny_config(plugin.PluginMoeConfig), ckpt
    )
    _check_end_to_end(ckpt, model, cls, host_issuer)


def test_bad_entry_points_fail_naming_the_entry_point(plugin_on_path: Path) -> None:
    with pytest.raises(TypeError, match=r"entry point pdflash_broken_moe .*MoEAdapterBase"):
        get_adapter_class("pdflash_broken_moe")
    with pytest.raises(ImportError, match=r"entry point pdflash_missing_moe .*failed to load"):
        get_adapter_class("pdflash_missing_moe")
