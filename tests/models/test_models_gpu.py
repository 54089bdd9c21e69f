"""Offloaded MoE on a CUDA device through the CUDA-backend H2D issuer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from issuer_fixtures import evicting_adapter, small_gpu_overrides

from pdflash.models import load_adapter, write_synthetic_checkpoint
from pdflash.protocols import Band

pytestmark = pytest.mark.gpu

ARCHS = ("qwen3_moe", "gpt_oss", "mixtral", "olmoe", "qwen2_moe", "glm4_moe")


def _ids(n: int, seed: int, vocab: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ARCHS)
def test_offloaded_equals_resident_fp32_smallest_cache(
    arch: str, tmp_path: Path, cuda_issuer: Any
) -> None:
    path = write_synthetic_checkpoint(tmp_path / arch, arch, dtype=torch.float32)
    ad = evicting_adapter(path, cuda_issuer, device="cuda", dtype=torch.float32)
    assert ad.store.pinned and ad.cache is not None and ad.cache.slab.is_cuda
    resident = [ad.resident_block(i) for i in range(ad.num_layers)]
    # NOTE: many forwards with 4 slots: slots are overwritten while earlier
    # kernels may still be queued; results must not depend on that timing.
    for seed in range(8):
        ids = _ids(9, seed)
        with ad.swapped_blocks(resident):
            want = ad.forward_logits(ids)
        got = ad.forward_logits(ids)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert ad.cache.evictions > 0 and int(ad.cache.pins.sum()) == 0
    ad.close()


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_bf16_block_of_16_tokens(arch: str, tmp_path: Path, cuda_issuer: Any) -> None:
    overrides: dict[str, Any] = {"hidden_size": 256, "num_attention_heads": 4, "head_dim": 64}
    if arch == "qwen3_moe":
        overrides.update(moe_intermediate_size=512, num_experts=32, num_experts_per_tok=4)
    else:
        overrides.update(intermediate_size=512, num_local_experts=32, num_experts_per_tok=4)
    path = write_synthetic_checkpoint(
        tmp_path / arch,
        arch,
        num_layers=3,
        dtype=torch.bfloat16,
        device="cuda",
        config_overrides=overrides,
    )
    ad = load_adapter(
        path, device="cuda", issuer=cuda_issuer, cache_fraction=0.3, max_batch_tokens=4
    )
    assert ad.dtype == torch.bfloat16
    # NOTE: end-to-end bf16 logits can differ by more than rounding (a near-tie
    # in top-k flips under a 1-ulp change); compare each MoE layer on the same input.
    for layer in range(ad.num_layers):
        block = ad.resident_block(layer)
        x = torch.randn(16, 256, generator=torch.Generator().manual_seed(layer)).to(
            "cuda", torch.bfloat16
        )
        with torch.no_grad():
            want = block(x[None])
            want = (want[0] if isinstance(want, tuple) else want)[0].float()
            got = ad.moe(layer, x).float()
        assert (got - want).abs().max() <= 1e-2 * want.abs().max()
    assert torch.isfinite(ad.forward_logits(_ids(16, 0)).float()).all()
    assert ad.cache.misses > 0
    ad.close()


def test_route_ahead_prefetch_is_hit_by_the_forward(tmp_path: Path, cuda_issuer: Any) -> None:
    path = write_synthetic_checkpoint(tmp_path / "q", "qwen3_moe", dtype=torch.float32)
    ad = load_adapter(
        path, device="cuda", dtype=torch.float32, issuer=cuda_issuer, cache_fraction=1.0
    )
    assert ad.cache is not None
    routed: list[np.ndarray] = []
    remove = ad.add_route_hook(
        lambda layer, ids: routed.append(layer * ad.num_experts + torch.unique(ids).cpu().numpy())
    )
    ids = _ids(5, 0)
    want = ad.forward_logits(ids)  # learn the routing
    remove()
    fresh = load_adapter(
        path, device="cuda", dtype=torch.float32, issuer=cuda_issuer, cache_fraction=1.0
    )
    assert fresh.cache is not None
    tickets = fresh.cache.prefetch(np.concatenate(routed), Band.ROUTE_AHEAD)
    assert (tickets >= 0).all()
    got = fresh.forward_logits(ids)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    st = fresh.cache.stats()
    assert st["misses"] == 0 and st["hits"] == len(np.concatenate(routed))
    assert st["prefetch_bytes_in"] == st["bytes_in"] > 0


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_all_resident_layer_runs_grouped_without_a_host_sync(
    arch: str, tmp_path: Path, cuda_issuer: Any
) -> None:
    path = write_synthetic_checkpoint(
        tmp_path / arch,
        arch,
        num_layers=2,
        dtype=torch.bfloat16,
        config_overrides=small_gpu_overrides(arch),
    )
    ad = load_adapter(path, device="cuda", issuer=cuda_issuer, cache_fraction=1.0)
    assert ad.runtime is not None and ad.runtime.path == "grouped" and ad.cache is not None
    ad.cache.prefetch(np.arange(ad.cache.num_ids))
    ad.cache.drain_inflight()
    ad.cache.device_slot_table()  # upload the table once, outside the checked region
    for layer in range(ad.num_layers):
        x = torch.randn(64, 256, generator=torch.Generator().manual_seed(layer)).to(
            "cuda", torch.bfloat16
        )
        with torch.no_grad():
            ids, weights = ad.route(layer, x)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                got = ad.runtime.forward_routed(layer, x, ids, weights)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            block = ad.resident_block(layer)
            want = block(x[None])
            want = (want[0] if isinstance(want, tuple) else want)[0].float()
        assert (got.float() - want).abs().max() <= 1e-2 * want.abs().max()
    st = ad.cache.stats()  # the deferred accesses are counted now
    assert st["hits"] > 0 and st["misses"] == 0 and int(ad.cache.pins.sum()) == 0
    ad.close()


def test_mxfp4_experts_cross_the_link_compressed_bf16(tmp_path: Path, cuda_issuer: Any) -> None:
    path = write_synthetic_checkpoint(
        tmp_path / "g",
        "gpt_oss",
        num_layers=3,
        device="cuda",
        expert_format="mxfp4",
        config_overrides=small_gpu_overrides("gpt_oss"),
    )
    ad = load_adapter(
        path, device="cuda", issuer=cuda_issuer, cache_fraction=0.3, max_batch_tokens=4
    )
    dense = load_adapter(
        path,
        device="cuda",
        issuer=cuda_issuer,
        cache_fraction=0.3,
        max_batch_tokens=4,
        expert_dtype="dense",
    )
    assert ad.dtype == torch.bfloat16 and ad.layout.format == "mxfp4"
    assert ad.runtime is not None and ad.runtime.path == "grouped"
    # 4.25 bits per weight (+ aligned bf16 biases) vs 16
    assert ad.expert_nbytes * 3.5 < dense.expert_nbytes
    for layer in range(ad.num_layers):
        x = torch.randn(16, 256, generator=torch.Generator().manual_seed(layer)).to(
            "cuda", torch.bfloat16
        )
        with torch.no_grad():
            want = ad.resident_block(layer)(x[None])
            want = (want[0] if isinstance(want, tuple) else want)[0].float()
            got = ad.moe(layer, x).float()
            got_dense = dense.moe(layer, x).float()
        assert (got - want).abs().max() <= 1e-2 * want.abs().max()
        assert (got - got_dense).abs().max() <= 1e-2 * want.abs().max()
    st = ad.cache.stats()
    assert st["misses"] > 0 and st["bytes_in"] == st["copies"] * ad.expert_nbytes
    ad.close()
    dense.close()
