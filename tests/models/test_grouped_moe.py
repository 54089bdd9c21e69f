"""The grouped-GEMM offloaded block: slab views, split calls, the no-sync
all-resident path and its deferred accounting, MXFP4 experts kept compressed
end to end; each against transformers' forward."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from issuer_fixtures import token_ids

from pdflash.models import load_adapter, offload
from pdflash.models.layout import ComponentSpec, ExpertLayout

ATOL = 1e-5

needs_grouped = pytest.mark.skipif(
    not offload.grouped_mm_works(torch.device("cpu"), torch.float32),
    reason="this torch has no CPU grouped_mm",
)


def reference_model(path: Path, **kw: Any) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", **kw
    )
    return model.eval()


def test_slab_views_are_strided_views_of_each_slot() -> None:
    layout = ExpertLayout(
        [
            ComponentSpec("w", (3, 4)),
            ComponentSpec("codes", (5,), torch.uint8),
            ComponentSpec("b", (4,)),
        ],
        torch.float32,
    )
    assert layout.nbytes == 3 * 256 and layout.offsets == {"w": 0, "codes": 256, "b": 512}
    slab = torch.zeros((3, layout.nbytes), dtype=torch.uint8)
    views = layout.slab_views(slab)
    assert views["w"].shape == (3, 3, 4) and views["w"].stride() == (layout.nbytes // 4, 4, 1)
    assert views["codes"].dtype == torch.uint8 and views["codes"].shape == (3, 5)
    views["w"][2] = torch.arange(12.0).view(3, 4)
    views["codes"][1] = 7
    per_slot = layout.views(slab[2])
    assert torch.equal(per_slot["w"], torch.arange(12.0).view(3, 4))
    assert torch.equal(layout.views(slab[1])["codes"], torch.full((5,), 7, dtype=torch.uint8))
    assert views["w"].data_ptr() == slab.data_ptr()  # no copy
    with pytest.raises(ValueError, match="slab must be"):
        layout.slab_views(slab[:, :-1])


@needs_grouped
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_slab_split_into_calls_of_max_groups(
    arch: str,
    tiny_checkpoints: dict[str, Path],
    host_issuer: object,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 16 slots in calls of 3: five calls per projection, most rows outside
    # each call's slots; the result must not change
    monkeypatch.setattr(offload, "MAX_GROUPS_PER_CALL", 3)
    ad = load_adapter(tiny_checkpoints[arch], issuer=host_issuer, cache_fraction=1.0)
    ref = reference_model(tiny_checkpoints[arch], experts_implementation="eager")
    ids = token_ids(7, 2)
    with torch.no_grad():
        want = ref(input_ids=ids[None]).logits[0]
        for _ in range(2):  # cold (copies), then all resident
            torch.testing.assert_close(ad.forward_logits(ids), want, atol=ATOL, rtol=0)


@needs_grouped
def test_all_resident_layers_never_read_the_routing_on_the_host(
    tiny_checkpoints: dict[str, Path], host_issuer: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    ad = load_adapter(tiny_checkpoints["qwen3_moe"], issuer=host_issuer, cache_fraction=1.0)
    cache = ad.cache
    assert cache is not None
    ref = reference_model(tiny_checkpoints["qwen3_moe"], experts_implementation="eager")
    ids = token_ids(5, 4)
    with torch.no_grad():
        ad.forward_logits(ids)  # cold: copies everything the routing needs
        cache.prefetch(np.arange(cache.num_ids))  # now every expert is resident
        cache.drain_inflight()
        cache.reset_stats()
        clock = cache.clock

        def no_acquire(*_a: object, **_k: object) -> None:
            raise AssertionError("an all-resident layer must not acquire by routing")

        monkeypatch.setattr(cache, "acquire", no_acquire)
        got = ad.forward_logits(ids)
        torch.testing.assert_close(got, ref(input_ids=ids[None]).logits[0], atol=ATOL, rtol=0)
    assert len(cache._deferred) == ad.num_layers  # counted later, not yet
    assert cache.clock == clock + ad.num_layers
    # the deferred accounting gives what acquire would have counted
    seen: set[int] = set()
    hooked = []

    def hook(layer: int, topk: torch.Tensor) -> None:
        hooked.append(layer)
        seen.update((layer * ad.num_experts + torch.unique(topk)).tolist())

    ad.add_route_hook(hook)
    with torch.no_grad():
        ad.forward_logits(ids)
    st = cache.stats()
    assert not cache._deferred
    assert st["hits"] == 2 * len(seen) and st["misses"] == 0
    assert int(cache.pins.sum()) == 0
    last = cache.policy.last_use  # type: ignore[attr-defined]
    assert all(last[g] > clock for g in seen)


@needs_grouped
def test_deferred_accesses_reach_the_policy_before_an_eviction(
    tiny_checkpoints: dict[str, Path], host_issuer: object
) -> None:
    ad = load_adapter(tiny_checkpoints["olmoe"], issuer=host_issuer, cache_slots=8)
    cache = ad.cache
    assert cache is not None
    cache.prefetch(np.arange(8))  # all of layer 0, nothing of layer 1
    cache.drain_inflight()
    x = torch.randn(1, ad.hidden_size)
    topk = torch.tensor([[0, 1]])  # what an uninformed LRU would evict first
    ad.runtime.forward_routed(0, x, topk, torch.ones(1, 2))  # type: ignore[union-attr]
    assert len(cache._deferred) == 1
    # two misses in layer 1 evict two of layer 0: never the two just used
    slots, _ = cache.acquire(np.array([8, 9]))
    cache.wait_ready(cache.ticket[slots])
    cache.release(np.array([8, 9]))
    assert cache.is_resident([0, 1]).all()
    assert not cache._deferred


@pytest.mark.parametrize("path", ["grouped", "loop"])
def test_mxfp4_experts_stay_compressed_and_equal_transformers(
    path: str, mxfp4_checkpoint: Path, host_issuer: object
) -> None:
    from transformers import Mxfp4Config

    ad = load_adapter(
        mxfp4_checkpoint, issuer=host_issuer, cache_slots=4, max_batch_tokens=2, dtype=torch.float32
    )
    dense = load_adapter(
        mxfp4_checkpoint,
        issuer=host_issuer,
        cache_slots=4,
        max_batch_tokens=2,
        dtype=torch.float32,
        expert_dtype="dense",
    )
    assert ad.layout.format == "mxfp4" and dense.layout.format == "dense"
    # stored bytes: 4 bits per weight (+ one scale byte per 32) vs 32 bits per weight
    for name in ("gate_up", "down"):
        assert ad.layout.component_nbytes(f"{name}_blocks") * 8 == dense.layout.component_nbytes(
            name
        )
        assert ad.layout.component_nbytes(f"{name}_scales") * 32 * 4 == (
            dense.layout.component_nbytes(name)
        )
    assert ad.expert_nbytes < dense.expert_nbytes
    assert ad.cache is not None and ad.cache.expert_nbytes == ad.expert_nbytes
    assert ad.runtime is not None
    if path == "grouped" and not offload.grouped_mm_works(torch.device("cpu"), torch.float32):
        pytest.skip("this torch has no CPU grouped_mm")
    if path == "loop":
        ad.runtime.grouped = None
    assert ad.runtime.path == path
    ref = reference_model(mxfp4_checkpoint, quantization_config=Mxfp4Config(dequantize=True))
    ref_dtype = ref.model.layers[0].mlp.experts.gate_up_proj.dtype
    with torch.no_grad():
        for seed in range(2):
            ids = token_ids(9, seed)
            got = ad.forward_logits(ids)
            # the MXFP4 slab and the pack-time dequantization: the same weights
            # (dequantize_mxfp4 is checked bit for bit against transformers'
            # convert_moe_packed_tensors), but the slab's GEMMs read them as
            # transposed views and the dense slab's contiguously, and some CPUs'
            # GEMM kernels round the two layouts differently (AMD EPYC, torch
            # 2.13: up to 4.8e-7 absolute on these logits)
            torch.testing.assert_close(got, dense.forward_logits(ids), atol=2e-6, rtol=1e-5)
            if ref_dtype != torch.float32:
                continue  # this transformers keeps dequantized experts in bf16: checked on GPU
            want = ref(input_ids=ids[None]).logits[0]
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    st = ad.cache.stats()
    assert st["bytes_in"] == st["copies"] * ad.expert_nbytes > 0


def test_unknown_expert_dtype_is_refused(tiny_checkpoints: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="expert_dtype"):
        load_adapter(tiny_checkpoints["qwen3_moe"], expert_dtype="int3")


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_fp8_experts_equal_the_dequantized_weights_and_halve_the_bytes(
    arch: str, tiny_checkpoints: dict[str, Path], host_issuer: object
) -> None:
    """``expert_dtype='fp8'``: e4m3 values + per-output-channel fp32 scales in
    the slab; both paths equal the HF block run on the dequantized weights
    exactly, and those weights are within e4m3's rounding of the checkpoint's."""
    from pdflash.models.layout import FP8_DTYPE

    path = tiny_checkpoints[arch]
    dense = load_adapter(path, issuer=host_issuer, cache_fraction=1.0)
    ad = load_adapter(
        path, issuer=host_issuer, cache_slots=4, max_batch_tokens=2, expert_dtype="fp8"
    )
    assert ad.layout.format == "fp8" and ad.layout.dtypes["gate_up"] == FP8_DTYPE
    # fp32 checkpoint: a quarter of the weight bytes, plus one fp32 scale per channel
    assert ad.layout.component_nbytes("gate_up") * 4 == dense.layout.component_nbytes("gate_up")
    assert ad.expert_nbytes < dense.expert_nbytes
    axis = ad.expert_out_axes["gate_up"]
    for g in (0, 5, 13):
        w_q = ad.dense_expert_weights(ad.store.views(g))["gate_up"]
        w = dense.store.views(g)["gate_up"]
        step = w.abs().amax(dim=1 - axis, keepdim=True) / 448 * 32  # e4m3: 3 mantissa bits
        assert ((w_q - w).abs() <= step).all() and not torch.equal(w_q, w)
    ids = token_ids(9, 1)
    with torch.no_grad():
        resident = [ad.resident_block(i) for i in range(ad.num_layers)]
        with ad.swapped_blocks(resident):
            want = ad.forward_logits(ids)
        assert ad.runtime is not None
        if offload.grouped_mm_works(torch.device("cpu"), torch.float32):
            assert ad.runtime.path == "grouped"
        torch.testing.assert_close(ad.forward_logits(ids), want, atol=ATOL, rtol=0)
        ad.runtime.grouped = None  # type: ignore[union-attr]
        torch.testing.assert_close(ad.forward_logits(ids), want, atol=ATOL, rtol=0)


def test_fp8_refuses_compressed_checkpoints(mxfp4_checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="re-stores dense checkpoints"):
        load_adapter(mxfp4_checkpoint, expert_dtype="fp8")
