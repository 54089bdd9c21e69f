"""Hybrid miss service per architecture: an expert's output is the same
function whichever side computes it (host executor over the store's host
views vs the device path over a cache slot), and offloaded forwards with
misses served on the host equal the resident transformers model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from issuer_fixtures import ARCHS, evicting_adapter, reference_model, token_ids

from pdflash.hybrid import ForcedHostPlanner, HostExpertExecutor, build_host_service
from pdflash.models import load_adapter

ATOL = 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ARCHS)
def test_host_expert_equals_device_expert(
    arch: str, dtype: torch.dtype, tiny_checkpoints: dict[str, Path], host_issuer: object
) -> None:
    ad = load_adapter(tiny_checkpoints[arch], issuer=host_issuer, cache_slots=8, dtype=dtype)
    assert ad.cache is not None and ad.runtime is not None
    ids = np.array([0, 3, ad.num_experts + 1], dtype=np.int64)  # two layers
    counts = [3, 1, 5]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sum(counts), ad.hidden_size, generator=g).to(dtype)
    with HostExpertExecutor(
        ad.store.views, ad.expert_forward, dtype=ad.store.layout.dtype, workers=2
    ) as ex:
        host = ex.compute(ids, x, counts)
    slots = ad.cache.ensure_resident(ids)
    try:
        views = [ad.runtime._slot_views[int(s)] for s in slots]
        parts = x.split(counts)
        device = torch.cat([ad.expert_forward(p, v) for p, v in zip(parts, views, strict=True)])
    finally:
        ad.cache.release(ids)
    assert host.dtype == device.dtype == dtype
    # same function, same device here: equal to the bit
    torch.testing.assert_close(host, device, rtol=0, atol=0)


@pytest.mark.parametrize("path", ["grouped", "loop"])
@pytest.mark.parametrize("arch", ARCHS)
def test_offloaded_forward_with_host_misses_equals_resident(
    arch: str, path: str, tiny_checkpoints: dict[str, Path], host_issuer: object
) -> None:
    ad = evicting_adapter(tiny_checkpoints[arch], host_issuer)
    assert ad.cache is not None and ad.runtime is not None
    if path == "loop":
        ad.runtime.grouped = None
    if ad.runtime.path != path:
        pytest.skip(f"{arch} has no {path} path here")
    ref = reference_model(tiny_checkpoints[arch])
    ids = token_ids(9, 3)
    with torch.no_grad():
        want = ref(input_ids=ids[None]).logits[0]
    copied = {}
    for every in (None, 2, 1):
        ad.cache.reset_stats()
        svc = None
        if every is not None:
            svc = build_host_service(
                ad, link_bytes_per_s=1e9, planner=ForcedHostPlanner(every=every), calibrate=False
            )
        try:
            got = ad.forward_logits(ids)
        finally:
            if svc is not None:
                svc.close()
                assert ad.runtime is not None
                ad.runtime.host_service = None
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        assert int(ad.cache.pins.sum()) == 0
        copied[every] = ad.cache.copies
        if svc is not None:
            b = svc.books
            assert b.experts > 0 and b.layers > 0
            assert b.bytes_saved == b.experts * ad.expert_nbytes
            assert b.compute_s > 0
    # every miss on the host: nothing new is copied; half of them: fewer copies
    assert copied[1] == 0
    assert copied[2] < copied[None]


@pytest.mark.parametrize("arch", ("gpt_oss", "qwen3_moe"))
def test_calibrated_cost_model_service_keeps_the_output(
    arch: str, tiny_checkpoints: dict[str, Path], host_issuer: object
) -> None:
    ad = load_adapter(tiny_checkpoints[arch], issuer=host_issuer, cache_slots=4, max_batch_tokens=2)
    ref = reference_model(tiny_checkpoints[arch])
    # a slow "link" so the calibrated planner gives the host some misses
    svc = build_host_service(ad, link_bytes_per_s=1e6)
    try:
        assert svc.cost is not None and svc.cost.source == "calibrated"
        assert svc.cost.expert_nbytes == ad.expert_nbytes
        ids = token_ids(7, 5)
        with torch.no_grad():
            want = ref(input_ids=ids[None]).logits[0]
        torch.testing.assert_close(ad.forward_logits(ids), want, atol=ATOL, rtol=0)
        assert svc.books.experts > 0
        assert svc.describe()["calibration"]["source"] == "calibrated"
    finally:
        svc.close()


@pytest.mark.parametrize("every", [1, 2])
def test_mxfp4_experts_are_dequantized_on_the_host(
    every: int, mxfp4_checkpoint: Path, host_issuer: object
) -> None:
    from transformers import Mxfp4Config

    ad = load_adapter(
        mxfp4_checkpoint, issuer=host_issuer, cache_slots=4, max_batch_tokens=2, dtype=torch.float32
    )
    assert ad.layout.format == "mxfp4" and ad.runtime is not None
    # the executor reads the compressed host views and the adapter's own
    # expert function dequantizes them on the CPU: same as over a cache slot
    ids = np.array([1, ad.num_experts + 2], dtype=np.int64)
    x = torch.randn(5, ad.hidden_size, generator=torch.Generator().manual_seed(2))
    with HostExpertExecutor(ad.store.views, ad.expert_forward, dtype=ad.layout.dtype) as ex:
        host = ex.compute(ids, x, [2, 3])
    slots = ad.cache.ensure_resident(ids)
    try:
        device = torch.cat(
            [
                ad.expert_forward(p, ad.runtime._slot_views[int(s)])
                for p, s in zip(x.split([2, 3]), slots, strict=True)
            ]
        )
    finally:
        ad.cache.release(ids)
    torch.testing.assert_close(host, device, rtol=0, atol=0)
    ref = _resident_mxfp4(mxfp4_checkpoint, Mxfp4Config(dequantize=True))
    svc = build_host_service(
        ad, link_bytes_per_s=1e9, planner=ForcedHostPlanner(every=every), calibrate=False
    )
    try:
        tokens = token_ids(9, 4)
        with torch.no_grad():
            want = ref(input_ids=tokens[None]).logits[0]
        torch.testing.assert_close(ad.forward_logits(tokens), want, atol=ATOL, rtol=0)
        assert svc.books.experts > 0
        assert svc.books.bytes_saved == svc.books.experts * ad.expert_nbytes  # MXFP4 bytes
    finally:
        svc.close()


def _resident_mxfp4(path: Path, quantization_config: object) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=torch.float32,
        attn_implementation="eager",
        quantization_config=quantization_config,
    )
    return model.eval()


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_fp8_experts_are_dequantized_on_the_host(
    arch: str, tiny_checkpoints: dict[str, Path], host_issuer: object
) -> None:
    ad = evicting_adapter(tiny_checkpoints[arch], host_issuer, expert_dtype="fp8")
    assert ad.layout.format == "fp8" and ad.runtime is not None
    tokens = token_ids(9, 6)
    want = ad.forward_logits(tokens)  # every miss copied (fp8 over the link)
    for every in (1, 2):
        svc = build_host_service(
            ad, link_bytes_per_s=1e9, planner=ForcedHostPlanner(every=every), calibrate=False
        )
        try:
            # the host reads the fp8 host views; the adapter's expert function
            # dequantizes them there, as the device does from a slot
            torch.testing.assert_close(ad.forward_logits(tokens), want, atol=ATOL, rtol=0)
            assert svc.books.experts > 0
        finally:
            svc.close()
            ad.runtime.host_service = None


def test_service_and_executor_give_torch_its_thread_count_back(
    tiny_checkpoints: dict[str, Path], host_issuer: object
) -> None:
    """torch's intra-op thread count is process-wide: whoever sets it gives
    the previous count back on close, or when building fails."""
    ad = load_adapter(tiny_checkpoints["qwen3_moe"], issuer=host_issuer, cache_slots=8)
    before = torch.get_num_threads()
    threads = before + 1
    svc = build_host_service(
        ad,
        link_bytes_per_s=1e9,
        planner=ForcedHostPlanner(every=1),
        calibrate=False,
        intra_op_threads=threads,
    )
    try:
        assert torch.get_num_threads() == threads
        assert svc.describe()["intra_op_threads"] == threads
    finally:
        svc.close()
        assert ad.runtime is not None
        ad.runtime.host_service = None
    assert torch.get_num_threads() == before
    svc.close()  # idempotent: nothing set twice
    assert torch.get_num_threads() == before
    # a build that fails after setting the count (no planner, nothing to build one from)
    with pytest.raises(ValueError, match="no planner"):
        build_host_service(ad, link_bytes_per_s=1e9, calibrate=False, intra_op_threads=threads)
    assert torch.get_num_threads() == before
    assert ad.runtime.host_service is None
    # the executor alone, when given a count
    with HostExpertExecutor(
        ad.store.views, ad.expert_forward, dtype=ad.store.layout.dtype, intra_op_threads=threads
    ) as ex:
        assert torch.get_num_threads() == threads == ex.intra_op_threads
    assert torch.get_num_threads() == before
    with HostExpertExecutor(ad.store.views, ad.expert_forward, dtype=ad.store.layout.dtype):
        assert torch.get_num_threads() == before
    assert torch.get_num_threads() == before
