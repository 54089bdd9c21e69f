"""Hybrid miss service on a CUDA device: the host CPU's expert output equals
the GPU's within the dtype's tolerance, per architecture, and offloaded
forwards with misses served on the host equal those without."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from issuer_fixtures import ARCHS, evicting_adapter, token_ids

from pdflash.hybrid import ForcedHostPlanner, HostExpertExecutor, build_host_service
from pdflash.models import load_adapter, write_synthetic_checkpoint

pytestmark = pytest.mark.gpu

# bf16 accumulation order differs between the CPU's GEMM and the GPU's
TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (3e-2, 3e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ARCHS)
def test_host_expert_equals_gpu_expert(
    arch: str, dtype: torch.dtype, tmp_path: Path, cuda_issuer: Any
) -> None:
    path = write_synthetic_checkpoint(tmp_path / arch, arch, dtype=dtype)
    ad = load_adapter(path, device="cuda", dtype=dtype, issuer=cuda_issuer, cache_slots=8)
    assert ad.cache is not None and ad.runtime is not None
    ids = np.array([0, 3, ad.num_experts + 1], dtype=np.int64)
    counts = [3, 1, 5]
    x = torch.randn(sum(counts), ad.hidden_size, device="cuda", dtype=dtype)
    with HostExpertExecutor(ad.store.views, ad.expert_forward, dtype=ad.layout.dtype) as ex:
        # rows go device -> host (pinned, no sync), the pool computes, back to the device
        host = ex.submit(ids, x, counts).result()
    assert host.is_cuda and host.dtype == dtype
    slots = ad.cache.ensure_resident(ids)
    try:
        parts = x.split(counts)
        gpu = torch.cat(
            [
                ad.expert_forward(p, ad.runtime._slot_views[int(s)])
                for p, s in zip(parts, slots, strict=True)
            ]
        )
    finally:
        ad.cache.release(ids)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(host, gpu, atol=atol, rtol=rtol)
    ad.close()


@pytest.mark.parametrize("fmt", ["out_in", "fp32_in_out", "native"])
@pytest.mark.parametrize("arch", ("qwen3_moe", "gpt_oss"))
def test_prepared_host_expert_equals_gpu_expert(
    arch: str, fmt: str, tmp_path: Path, cuda_issuer: Any
) -> None:
    from pdflash.hybrid import host_weights_for
    from pdflash.hybrid.native import native_unavailable_reason

    dtype = torch.bfloat16
    if fmt == "native" and (why := native_unavailable_reason(dtype)) is not None:
        pytest.skip(why)
    path = write_synthetic_checkpoint(tmp_path / arch, arch, dtype=dtype)
    ad = load_adapter(path, device="cuda", dtype=dtype, issuer=cuda_issuer, cache_slots=8)
    assert ad.cache is not None and ad.runtime is not None
    ids = np.array([0, 3, ad.num_experts + 1], dtype=np.int64)
    counts = [3, 1, 5]
    x = torch.randn(sum(counts), ad.hidden_size, device="cuda", dtype=dtype)
    hw = host_weights_for(ad, fmt, budget_bytes=1 << 34)
    with HostExpertExecutor(
        hw.weights_of, hw.kernel.forward, dtype=hw.kernel.dtype, out_dtype=dtype
    ) as ex:
        host = ex.submit(ids, x, counts).result()
    assert host.is_cuda and host.dtype == dtype
    slots = ad.cache.ensure_resident(ids)
    try:
        gpu = torch.cat(
            [
                ad.expert_forward(p, ad.runtime._slot_views[int(s)])
                for p, s in zip(x.split(counts), slots, strict=True)
            ]
        )
    finally:
        ad.cache.release(ids)
    # bf16 rounds every intermediate: the error bounded by the output's scale
    err = (host.float() - gpu.float()).abs()
    scale = float(gpu.float().abs().max())
    assert float(err.max()) <= 3e-2 * scale and float(err.mean()) <= 3e-3 * scale
    ad.close()


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_forward_with_host_misses_on_cuda(arch: str, tmp_path: Path, cuda_issuer: Any) -> None:
    path = write_synthetic_checkpoint(tmp_path / arch, arch, dtype=torch.float32)
    ad = evicting_adapter(path, cuda_issuer, device="cuda", dtype=torch.float32)
    ids = token_ids(9, 0)
    want = ad.forward_logits(ids)
    svc = build_host_service(
        ad, link_bytes_per_s=50e9, planner=ForcedHostPlanner(every=2), calibrate=False
    )
    try:
        for _ in range(4):  # slots reused while host rows are in flight
            got = ad.forward_logits(ids)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert svc.books.experts > 0 and svc.books.busy_s > 0
        assert ad.cache is not None and int(ad.cache.pins.sum()) == 0
    finally:
        svc.close()
        ad.close()


def test_calibration_on_cuda_records_threads_and_roundtrip(
    tmp_path: Path, cuda_issuer: Any
) -> None:
    path = write_synthetic_checkpoint(tmp_path / "g", "gpt_oss", dtype=torch.bfloat16)
    ad = load_adapter(path, device="cuda", issuer=cuda_issuer, cache_slots=8)
    threads = torch.get_num_threads()
    svc = build_host_service(ad, link_bytes_per_s=50e9, intra_op_threads=2)
    try:
        assert svc.cost is not None and svc.cost.source == "calibrated"
        assert svc.cost.intra_op_threads == 2 == torch.get_num_threads()
        assert svc.cost.roundtrip_s > 0
    finally:
        svc.close()
        ad.close()
        torch.set_num_threads(threads)  # process-wide: leave it as found


def test_mxfp4_experts_prepared_on_the_gpu_equal_the_cpu_preparation(
    tmp_path: Path, cuda_issuer: Any
) -> None:
    from pdflash.hybrid import host_kernel_for
    from pdflash.hybrid.kernels import prepare_all
    from pdflash.hybrid.prepare import prepare_device

    path = write_synthetic_checkpoint(tmp_path / "mx", "gpt_oss", expert_format="mxfp4", seed=2)
    ad = load_adapter(path, device="cuda", dtype=torch.bfloat16, issuer=cuda_issuer, cache_slots=8)
    where = prepare_device(ad)
    assert ad.layout.format == "mxfp4" and where is not None and where.type == "cuda"
    from pdflash.hybrid.native import native_unavailable_reason

    native = [] if native_unavailable_reason(torch.bfloat16) else ["native"]
    for fmt in ("out_in", "fp32_in_out", *native):
        kernel = host_kernel_for(ad, fmt)
        assert kernel is not None
        ids = [0, 5, ad.num_experts + 2]
        cpu = prepare_all(kernel, ad.store.views, ids)
        gpu = prepare_all(kernel, ad.store.views, ids, device="cuda")
        assert cpu is not None and gpu is not None
        for a, b in zip(cpu.experts, gpu.experts, strict=True):
            for k in a:
                assert b[k].device.type == "cpu"
                # the Triton dequantizer is bit-identical to the torch path
                assert torch.equal(a[k], b[k]), (fmt, k)
    ad.close()
    # dense gpt-oss: the transposed copies are made on the GPU too, the same bytes
    path = write_synthetic_checkpoint(tmp_path / "bf", "gpt_oss", dtype=torch.bfloat16, seed=2)
    ad = load_adapter(path, device="cuda", dtype=torch.bfloat16, issuer=cuda_issuer, cache_slots=8)
    kernel = host_kernel_for(ad, "fp32_out_in")
    assert kernel is not None and prepare_device(ad, kernel) is not None
    cpu = prepare_all(kernel, ad.store.views, [1, 2])
    gpu = prepare_all(kernel, ad.store.views, [1, 2], device="cuda")
    assert cpu is not None and gpu is not None
    for a, b in zip(cpu.experts, gpu.experts, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
    ad.close()


@pytest.mark.parametrize("every", [1, 2])
def test_a_hosting_layer_syncs_the_host_once_on_cuda(
    every: int, tmp_path: Path, cuda_issuer: Any
) -> None:
    """A layer with HOST experts reads its routing (the one sync a layer
    with misses has) and nothing else: the HOST rows are chosen from that
    read, their copy down and the result's copy up wait on no sync."""
    from pdflash.bench.eager_host import count_syncs

    path = write_synthetic_checkpoint(tmp_path / "g", "gpt_oss", dtype=torch.bfloat16)
    ad = load_adapter(path, device="cuda", issuer=cuda_issuer, cache_slots=8, max_batch_tokens=4)
    svc = build_host_service(
        ad, link_bytes_per_s=50e9, planner=ForcedHostPlanner(every=every), calibrate=False
    )
    try:
        rt = ad.runtime
        assert rt is not None
        g = torch.Generator().manual_seed(1)
        tokens, k = 4, ad.top_k
        topk = torch.stack([torch.randperm(ad.num_experts, generator=g)[:k] for _ in range(tokens)])
        x = torch.randn(tokens, ad.hidden_size, generator=g).to("cuda", ad.dtype)
        ids, w = topk.cuda(), torch.full((tokens, k), 1.0 / k, device="cuda")
        out: list[torch.Tensor] = []
        assert count_syncs(lambda: out.append(rt.forward_routed(0, x, ids, w))) == 1
        assert svc.books.layers == 1 and svc.books.experts > 0
        svc.enabled = False  # the same layer, every miss copied
        want = rt.forward_routed(0, x, ids, w)
        torch.testing.assert_close(out[0], want, atol=3e-2, rtol=3e-2)
    finally:
        svc.close()
        ad.close()
