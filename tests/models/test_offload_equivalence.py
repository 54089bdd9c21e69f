"""Offloaded execution equals the resident transformers model, per arch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from issuer_fixtures import ARCHS, evicting_adapter, reference_model, token_ids

from pdflash.models import load_adapter
from pdflash.models.attention import reference_attention
from pdflash.models.offload import grouped_mm_works

ATOL = 1e-5


@pytest.mark.parametrize("path", ["grouped", "loop"])
@pytest.mark.parametrize("arch", ARCHS)
def test_offloaded_forward_equals_resident_with_eviction(
    arch: str, path: str, tiny_checkpoints: dict[str, Path], host_issuer: object
) -> None:
    # The smallest legal cache: min(E=8, top_k=2 x max_batch_tokens=2) = 4 slots
    # of 16 experts; a 9-token forward routes more experts than that per
    # layer, so the block works in groups and evicts within one layer.
    ad = evicting_adapter(tiny_checkpoints[arch], host_issuer)
    assert ad.cache is not None and ad.cache.num_slots == ad.cache.min_slots == 4
    assert ad.runtime is not None
    if path == "grouped" and not grouped_mm_works(torch.device("cpu"), torch.float32):
        pytest.skip("this torch has no CPU grouped_mm")
    if path == "loop":  # the per-expert path, kept for expert_fn-only runtimes
        ad.runtime.grouped = None
    assert ad.runtime.path == path
    ref = reference_model(tiny_checkpoints[arch])
    with torch.no_grad():
        for seed in range(3):
            ids = token_ids(9, seed)
            want = ref(input_ids=ids[None]).logits[0]
            got = ad.forward_logits(ids)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        # one token: 2 layers x top-2 = 4 experts fit, so a repeat is all hits
        one = token_ids(1, 9)
        ad.forward_logits(one)
        hits = ad.cache.hits
        torch.testing.assert_close(
            ad.forward_logits(one), ref(input_ids=one[None]).logits[0], atol=ATOL, rtol=0
        )
    st = ad.cache.stats()
    assert st["misses"] > 0 and st["evictions"] > 0
    assert st["hits"] - hits == ad.num_layers * ad.top_k
    assert st["bytes_in"] == st["copies"] * ad.expert_nbytes
    assert int(ad.cache.pins.sum()) == 0  # every pin released


@pytest.mark.parametrize("arch", ARCHS)
def test_install_offloaded_on_a_from_pretrained_model(
    arch: str, tiny_checkpoints: dict[str, Path], host_issuer: object
) -> None:
    ad = load_adapter(tiny_checkpoints[arch], issuer=host_issuer, cache_slots=4, max_batch_tokens=2)
    ref = reference_model(tiny_checkpoints[arch])
    ids = token_ids(6, 7)
    with torch.no_grad():
        want = ref(input_ids=ids[None]).logits[0]
        off = reference_model(tiny_checkpoints[arch])
        blocks = ad.install_offloaded(off)
        assert len(blocks) == ad.num_layers
        assert not any(".experts." in n for n, _ in off.named_parameters())
        got = off(input_ids=ids[None]).logits[0]
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_adapter_pieces_reproduce_the_hf_forward(
    arch: str, tiny_checkpoints: dict[str, Path], host_issuer: object
) -> None:
    """embed / norms / project_qkv (rotary, q/k norms) / reference attention
    with the spec and sinks / project_out / route / moe / final norm / lm_head,
    composed by hand, give transformers' logits; route and router_logits
    equal what the HF router computes inside the HF forward."""
    ad = load_adapter(
        tiny_checkpoints[arch], issuer=host_issuer, cache_fraction=0.5, max_batch_tokens=4
    )
    ref = reference_model(tiny_checkpoints[arch])
    seen: dict[int, tuple[torch.Tensor, ...]] = {}
    router_name = ad.router_attr
    for i, layer in enumerate(ref.model.layers):
        router = getattr(layer.mlp, router_name)
        router.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(i, (a[0], *out)))
    ids = token_ids(11, 3)
    pos = torch.arange(ids.numel())
    with torch.no_grad():
        want = ref(input_ids=ids[None]).logits[0]
        h = ad.embed(ids)
        for layer in range(ad.num_layers):
            spec = ad.attention_spec(layer)
            assert spec.has_sinks == (arch == "gpt_oss")
            if arch == "gpt_oss":
                assert spec.sliding_window == (4 if layer % 2 == 0 else None)
            x = ad.input_norm(layer, h)
            q, k, v = ad.project_qkv(layer, x, pos)
            assert q.shape == (11, spec.num_heads, spec.head_dim)
            assert k.shape == v.shape == (11, spec.num_kv_heads, spec.head_dim)
            attn = reference_attention(q, k, v, spec, pos, pos, ad.attention_sinks(layer))
            h = h + ad.project_out(layer, attn)
            normed = ad.moe_norm(layer, h)
            hf_in, hf_logits, hf_scores, hf_ids = seen[layer]
            torch.testing.assert_close(normed, hf_in, atol=ATOL, rtol=0)
            torch.testing.assert_close(
                ad.router_logits(layer, normed), hf_logits, atol=ATOL, rtol=0
            )
            top_ids, top_w = ad.route(layer, normed)
            assert top_ids.dtype == torch.int64 and top_ids.shape == (11, ad.top_k)
            assert torch.equal(top_ids, hf_ids.long())
            torch.testing.assert_close(top_w, hf_scores, atol=ATOL, rtol=0)
            h = h + ad.moe(layer, normed)
        got = ad.lm_head(ad.final_norm(h))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_route_hook_sees_every_layer_and_can_prefetch(
    tiny_checkpoints: dict[str, Path], host_issuer: object
) -> None:
    from pdflash.protocols import Band

    ad = load_adapter(tiny_checkpoints["qwen3_moe"], issuer=host_issuer, cache_fraction=1.0)
    assert ad.cache is not None
    calls: list[tuple[int, torch.Tensor]] = []

    def prefetch_next(layer: int, topk: torch.Tensor) -> None:
        calls.append((layer, topk.clone()))
        if layer + 1 < ad.num_layers:  # guess: same expert ids one layer down
            nxt = (layer + 1) * ad.num_experts + torch.unique(topk).numpy()
            ad.cache.prefetch(nxt, Band.ROUTE_AHEAD)

    remove = ad.add_route_hook(prefetch_next)
    ids = token_ids(5)
    with torch.no_grad():
        ad.forward_logits(ids)
    assert [c[0] for c in calls] == list(range(ad.num_layers))
    assert all(c[1].shape == (5, ad.top_k) for c in calls)
    st = ad.cache.stats()
    assert st["prefetch_bytes_in"] > 0
    remove()
    with torch.no_grad():
        ad.forward_logits(ids)
    assert len(calls) == ad.num_layers


@pytest.mark.parametrize("arch", ARCHS)
def test_adapter_implements_the_protocol(
    arch: str, tiny_checkpoints: dict[str, Path], host_issuer: object
) -> None:
    from pdflash.protocols import MoEModelAdapter

    ad = load_adapter(tiny_checkpoints[arch], issuer=host_issuer, cache_fraction=1.0)
    assert isinstance(ad, MoEModelAdapter)
    assert (ad.arch, ad.num_layers, ad.num_experts, ad.top_k, ad.hidden_size, ad.vocab_size) == (
        arch,
        2,
        8,
        2,
        32,
        128,
    )
    assert ad.expert_nbytes == ad.store.expert_nbytes == ad.cache.expert_nbytes  # type: ignore[union-attr]
    x = torch.randn(3, 32)
    assert ad.router_logits(0, x).shape == (3, 8)
    assert ad.moe(0, x).shape == (3, 32)
    assert ad.lm_head(ad.final_norm(x)).shape == (3, 128)


def test_layer_output_hook_enables_next_layer_prefetch(
    tiny_checkpoints: dict[str, Path], host_issuer: object
) -> None:
    from pdflash.protocols import Band

    ad = load_adapter(tiny_checkpoints["olmoe"], issuer=host_issuer, cache_fraction=1.0)
    assert ad.cache is not None
    seen: list[int] = []

    def lookahead(layer: int, hidden: torch.Tensor) -> None:
        seen.append(layer)
        assert hidden.shape == (4, ad.hidden_size)
        if layer + 1 < ad.num_layers:
            nxt = layer + 1
            ids, _ = ad.route(nxt, ad.moe_norm(nxt, hidden))
            ad.cache.prefetch(nxt * ad.num_experts + torch.unique(ids).numpy(), Band.ROUTE_AHEAD)

    remove = ad.add_layer_output_hook(lookahead)
    with torch.no_grad():
        ad.forward_logits(token_ids(4))
    remove()
    with torch.no_grad():
        ad.forward_logits(token_ids(4))
    assert seen == [0, 1]
    assert ad.cache.prefetch_bytes_in > 0


def test_fp16_keeps_gpt_oss_norms_in_fp32_like_transformers(
    tiny_checkpoints: dict[str, Path], host_issuer: object
) -> None:
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoints["gpt_oss"]
    ad = load_adapter(
        path, dtype=torch.float16, issuer=host_issuer, cache_slots=4, max_batch_tokens=2
    )
    ref = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float16, experts_implementation="eager"
    )
    ours = {n: p.dtype for n, p in ad.hf_model.named_parameters()}
    theirs = {n: p.dtype for n, p in ref.named_parameters() if ".experts." not in n}
    assert ours == theirs and ours["model.norm.weight"] == torch.float32
    ids = token_ids(6, 5)
    with torch.no_grad():
        torch.testing.assert_close(
            ad.forward_logits(ids), ref(input_ids=ids[None]).logits[0], atol=2e-3, rtol=0
        )
