"""qwen2_moe (shared expert with a sigmoid gate) and glm4_moe (dense first
layer, ungated shared expert, grouped sigmoid routing with bias correction):
offloaded equals the resident transformers forward; dense layers and the
MoE-layer numbering; a MoE-block part pdflash does not know is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from issuer_fixtures import evicting_adapter, reference_model, token_ids

from pdflash.models import MoEBlockSpec, UnknownMoEPartError, load_adapter
from pdflash.models.attention import reference_attention
from pdflash.models.offload import OffloadedMoEBlock, grouped_mm_works, install_offloaded_blocks
from pdflash.protocols import DenseLayerAdapter, MoEModelAdapter, decoder_layer_plan

ATOL = 1e-5
#: name -> (arch, config overrides): qwen2_moe also with a dense middle layer
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2_moe": ("qwen2_moe", {}),
    "qwen2_moe_dense": ("qwen2_moe", {"num_hidden_layers": 3, "mlp_only_layers": [1]}),
    "glm4_moe": ("glm4_moe", {}),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from pdflash.models import write_synthetic_checkpoint

    root = tmp_path_factory.mktemp("arch_ckpts")
    return {
        name: write_synthetic_checkpoint(
            root / name,
            arch,
            "tiny",
            dtype=torch.float32,
            seed=2,
            shard_bytes=20_000,
            config_overrides=overrides,
        )
        for name, (arch, overrides) in VARIANTS.items()
    }


@pytest.mark.parametrize("path", ["grouped", "loop"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_offloaded_forward_equals_resident_with_eviction(
    name: str, path: str, ckpts: dict[str, Path], host_issuer: object
) -> None:
    # 4 slots for 8 experts x >= 2 MoE layers: a 9-token forward evicts within a layer
    ad = evicting_adapter(ckpts[name], host_issuer)
    assert ad.cache is not None and ad.runtime is not None and ad.cache.num_slots == 4
    if path == "grouped" and not grouped_mm_works(torch.device("cpu"), torch.float32):
        pytest.skip("this torch has no CPU grouped_mm")
    if path == "loop":
        ad.runtime.grouped = None
    assert ad.runtime.path == path
    ref = reference_model(ckpts[name])
    with torch.no_grad():
        for seed in range(3):
            ids = token_ids(9, seed)
            torch.testing.assert_close(
                ad.forward_logits(ids), ref(input_ids=ids[None]).logits[0], atol=ATOL, rtol=0
            )
    st = ad.cache.stats()
    assert st["misses"] > 0 and st["evictions"] > 0
    assert int(ad.cache.pins.sum()) == 0


def test_layer_numbering_with_dense_layers(ckpts: dict[str, Path], host_issuer: object) -> None:
    ad = load_adapter(ckpts["glm4_moe"], issuer=host_issuer, cache_fraction=1.0)
    assert isinstance(ad, MoEModelAdapter) and isinstance(ad, DenseLayerAdapter)
    # decoder layer 0 is dense; MoE layers 0, 1 are decoder layers 1, 2
    assert (ad.num_decoder_layers, ad.num_layers, ad.moe_layers) == (3, 2, (1, 2))
    assert decoder_layer_plan(ad) == [None, 0, 1]
    assert [ad.moe_layer_of(d) for d in range(3)] == [None, 0, 1]
    with pytest.raises(ValueError, match="out of range"):
        ad.moe_layer_of(3)
    assert ad.store.num_layers == ad.cache.num_layers == 2  # type: ignore[union-attr]
    # the store reads MoE layer m's experts under its decoder layer's name
    keys = ad.store.expert_keys()
    assert any(k.startswith("model.layers.1.mlp.experts.") for k in keys)
    assert not any(k.startswith("model.layers.0.") for k in keys)
    # the dense layer keeps its HF MLP, resident
    dense = ad.hf_model.model.layers[0].mlp
    assert not isinstance(dense, OffloadedMoEBlock)
    assert all(p.device.type == "cpu" and not p.is_meta for p in dense.parameters())
    x = torch.randn(3, 32)
    assert ad.dense_mlp(0, x).shape == (3, 32)
    with pytest.raises(ValueError, match="not dense"):
        ad.dense_mlp(1, x)
    qwen = load_adapter(ckpts["qwen2_moe_dense"], issuer=host_issuer, cache_fraction=1.0)
    assert decoder_layer_plan(qwen) == [0, None, 1]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_adapter_pieces_reproduce_the_hf_forward(
    name: str, ckpts: dict[str, Path], host_issuer: object
) -> None:
    """Attention by decoder layer, dense MLPs, routing and MoE (with the
    shared expert) by MoE layer, composed by hand, give transformers' logits;
    the routing equals what the HF router computes inside the HF forward."""
    ad = load_adapter(ckpts[name], issuer=host_issuer, cache_fraction=0.5, max_batch_tokens=4)
    ref = reference_model(ckpts[name])
    seen: dict[int, Any] = {}
    for m, d in enumerate(ad.moe_layers):
        router = ref.model.layers[d].mlp.gate
        router.register_forward_hook(lambda mod, a, out, m=m: seen.__setitem__(m, (a[0], out)))
    ids = token_ids(11, 3)
    pos = torch.arange(ids.numel())
    with torch.no_grad():
        want = ref(input_ids=ids[None]).logits[0]
        h = ad.embed(ids)
        for d, m in enumerate(decoder_layer_plan(ad)):
            spec = ad.attention_spec(d)
            assert spec.sliding_window is None and not spec.has_sinks
            q, k, v = ad.project_qkv(d, ad.input_norm(d, h), pos)
            h = h + ad.project_out(d, reference_attention(q, k, v, spec, pos, pos))
            if m is None:
                h = h + ad.dense_mlp(d, h)
                continue
            normed = ad.moe_norm(m, h)
            hf_in, hf_out = seen[m]
            torch.testing.assert_close(normed, hf_in.reshape(normed.shape), atol=ATOL, rtol=0)
            top_ids, top_w = ad.route(m, normed)
            assert top_ids.dtype == torch.int64 and top_ids.shape == (11, ad.top_k)
            if isinstance(hf_out, tuple) and len(hf_out) == 3:  # transformers 5 routers
                assert torch.equal(top_ids, hf_out[2].long())
                torch.testing.assert_close(top_w, hf_out[1], atol=ATOL, rtol=0)
            h = h + ad.moe(m, normed)
        got = ad.lm_head(ad.final_norm(h))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["qwen2_moe", "glm4_moe"])
def test_shared_expert_runs_resident_and_matters(
    name: str, ckpts: dict[str, Path], host_issuer: object
) -> None:
    ad = load_adapter(ckpts[name], issuer=host_issuer, cache_fraction=1.0)
    assert ad.runtime is not None
    block = ad.blocks[0]
    shared = getattr(block, ad.shared_expert_attr or "")
    assert all(not p.is_meta for p in shared.parameters())
    x = torch.randn(5, 32)
    with torch.no_grad():
        ids, w = ad.route(0, x)
        routed = ad.runtime.forward_routed(0, x, ids, w)
        full = ad.moe(0, x)
        expected = shared(x)
        if ad.shared_expert_gate_attr is not None:  # qwen2_moe: sigmoid-gated
            expected = torch.sigmoid(getattr(block, ad.shared_expert_gate_attr)(x)) * expected
    torch.testing.assert_close(full, routed + expected, atol=0, rtol=0)
    # not a no-op: dropping it (as an unchecked install would) changes the output
    assert float((full - routed).abs().max()) > 1e-3


@pytest.mark.parametrize("name", list(VARIANTS))
def test_install_offloaded_on_a_from_pretrained_model(
    name: str, ckpts: dict[str, Path], host_issuer: object
) -> None:
    ad = load_adapter(ckpts[name], issuer=host_issuer, cache_slots=4, max_batch_tokens=2)
    ref = reference_model(ckpts[name])
    ids = token_ids(6, 7)
    with torch.no_grad():
        want = ref(input_ids=ids[None]).logits[0]
        off = reference_model(ckpts[name])
        blocks = ad.install_offloaded(off)
        assert [b.layer for b in blocks] == list(range(ad.num_layers))
        assert not any(".experts." in n for n, _ in off.named_parameters())
        assert any(f".{ad.shared_expert_attr}." in n for n, _ in off.named_parameters())
        for d, m in enumerate(decoder_layer_plan(ad)):
            assert isinstance(off.model.layers[d].mlp, OffloadedMoEBlock) == (m is not None)
        got = off(input_ids=ids[None]).logits[0]
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_resident_blocks_with_shared_experts_reproduce_the_forward(
    ckpts: dict[str, Path], host_issuer: object
) -> None:
    for name in ("qwen2_moe", "glm4_moe"):
        ad = load_adapter(ckpts[name], issuer=host_issuer, cache_fraction=1.0)
        ids = token_ids(7, 2)
        with torch.no_grad():
            offloaded = ad.forward_logits(ids)
            with ad.swapped_blocks([ad.resident_block(m) for m in range(ad.num_layers)]):
                resident = ad.forward_logits(ids)
        torch.testing.assert_close(resident, offloaded, atol=ATOL, rtol=0)


def test_unknown_moe_block_part_is_refused_with_its_name(ckpts: dict[str, Path]) -> None:
    """A spec without the shared expert (how an all-routed adapter would see
    qwen2_moe) is refused naming it, and the model is left unchanged."""
    model = reference_model(ckpts["qwen2_moe"])
    before = [type(layer.mlp) for layer in model.model.layers]
    with pytest.raises(UnknownMoEPartError, match=r"'shared_expert'"):
        install_offloaded_blocks(model, None, spec=MoEBlockSpec(router_attr="gate"))
    with pytest.raises(UnknownMoEPartError, match=r"'shared_expert_gate'"):
        install_offloaded_blocks(
            model, None, spec=MoEBlockSpec(router_attr="gate", shared_expert_attr="shared_expert")
        )
    assert [type(layer.mlp) for layer in model.model.layers] == before
    # a direct parameter or buffer of the block is a part too
    glm = reference_model(ckpts["glm4_moe"])
    glm.model.layers[2].mlp.register_buffer("extra_scale", torch.ones(1))
    spec = MoEBlockSpec(router_attr="gate", shared_expert_attr="shared_experts", moe_layers=(1, 2))
    with pytest.raises(UnknownMoEPartError, match=r"layer 2: .*'extra_scale'"):
        install_offloaded_blocks(glm, None, spec=spec)
    assert not any(isinstance(layer.mlp, OffloadedMoEBlock) for layer in glm.model.layers)
    # a declared part the block lacks is an error too
    with pytest.raises(TypeError, match="no shared expert gate 'shared_expert_gate'"):
        install_offloaded_blocks(
            reference_model(ckpts["glm4_moe"]),
            None,
            spec=MoEBlockSpec(
                shared_expert_attr="shared_experts",
                shared_expert_gate_attr="shared_expert_gate",
                moe_layers=(1, 2),
            ),
        )


def _grouped_topk_reference(
    x: np.ndarray, weight: np.ndarray, bias: np.ndarray, cfg: Any
) -> tuple[list[set[int]], list[dict[int, float]]]:
    """GLM/DeepSeek-V3 routing, token by token, written from its definition."""
    e, groups, per = weight.shape[0], int(cfg.n_group), weight.shape[0] // int(cfg.n_group)
    sets, weights = [], []
    for row in x.astype(np.float64):
        scores = 1.0 / (1.0 + np.exp(-(weight.astype(np.float64) @ row)))
        biased = scores + bias
        group_score = [sum(sorted(biased[g * per : (g + 1) * per])[-2:]) for g in range(groups)]
        kept = sorted(range(groups), key=lambda g: -group_score[g])[: int(cfg.topk_group)]
        allowed = [i for i in range(e) if i // per in kept]
        chosen = sorted(allowed, key=lambda i: -biased[i])[: int(cfg.num_experts_per_tok)]
        w = {i: scores[i] for i in chosen}
        if cfg.norm_topk_prob:
            total = sum(w.values())
            w = {i: v / total for i, v in w.items()}
        sets.append(set(chosen))
        weights.append({i: v * float(cfg.routed_scaling_factor) for i, v in w.items()})
    return sets, weights


def test_glm4_grouped_routing_matches_its_definition(
    ckpts: dict[str, Path], host_issuer: object
) -> None:
    ad = load_adapter(ckpts["glm4_moe"], issuer=host_issuer, cache_fraction=1.0)
    router = ad.blocks[0].router_module
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        # a bias large enough to move choices, so the correction is exercised
        router.e_score_correction_bias.copy_(torch.randn(8, generator=gen) * 0.5)
        x = torch.randn(64, 32, generator=gen)
        logits, w, ids = ad.route_tokens(router, x)
    assert logits.dtype == torch.float32 and w.dtype == torch.float32
    sets, weights = _grouped_topk_reference(
        x.numpy(), router.weight.detach().numpy(), router.e_score_correction_bias.numpy(), ad.config
    )
    per_group = 8 // int(ad.config.n_group)
    for t in range(64):
        got = ids[t].tolist()
        assert set(got) == sets[t]
        assert len({i // per_group for i in got}) == 1  # topk_group=1: one group per token
        for i, v in zip(got, w[t].tolist(), strict=True):
            assert v == pytest.approx(weights[t][i], rel=1e-5)
    # the bias changes the choice for some token (not a vacuous check)
    plain, _ = _grouped_topk_reference(
        x.numpy(), router.weight.detach().numpy(), np.zeros(8), ad.config
    )
    assert plain != sets


def test_glm4_ignores_multi_token_prediction_layers(ckpts: dict[str, Path]) -> None:
    from pdflash.models import get_adapter_class, synthetic_config

    cls = get_adapter_class("glm4_moe")
    cfg = synthetic_config("glm4_moe")
    assert cls.ignore_checkpoint_key("model.layers.3.eh_proj.weight", cfg)
    assert not cls.ignore_checkpoint_key("model.layers.2.mlp.gate.weight", cfg)
    assert not cls.ignore_checkpoint_key("lm_head.weight", cfg)
    assert cls.moe_layer_indices(synthetic_config("glm4_moe", first_k_dense_replace=2)) == [2]
