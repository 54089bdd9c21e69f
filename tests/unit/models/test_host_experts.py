"""Hybrid miss service per architecture: an expert's output is the same
function whichever side computes it (host executor over the store's host
views vs the device path over a cache slot), and offloaded forwards with
misses served on the host equal the resident transformers model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pdflash.hybrid import ForcedHostPlanner, HostExpertExecutor, build_host_service
from pdflash.models import load_adapter

ARCHS = ("qwen3_moe", "gpt_oss", "mixtral", "olmoe")
ATOL = 1e-5


def _tokens(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (n,), generator=g)


def _resident(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    )
    return model.eval()


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


@pytest.mark.parametrize("arch", ARCHS)
def test_offloaded_forward_with_host_misses_equals_resident(
    arch: str, tiny_checkpoints: dict[str, Path], host_issuer: object
) -> None:
    ad = load_adapter(
        tiny_checkpoints[arch],
        issuer=host_issuer,
        cache_slots=4,
        max_batch_tokens=2,
        attn_implementation="eager",
    )
    assert ad.cache is not None
    ref = _resident(tiny_checkpoints[arch])
    ids = _tokens(9, 3)
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
    ref = _resident(tiny_checkpoints[arch])
    # a slow "link" so the calibrated planner gives the host some misses
    svc = build_host_service(ad, link_bytes_per_s=1e6)
    try:
        assert svc.cost is not None and svc.cost.source == "calibrated"
        assert svc.cost.expert_nbytes == ad.expert_nbytes
        ids = _tokens(7, 5)
        with torch.no_grad():
            want = ref(input_ids=ids[None]).logits[0]
        torch.testing.assert_close(ad.forward_logits(ids), want, atol=ATOL, rtol=0)
        assert svc.books.experts > 0
        assert svc.describe()["calibration"]["source"] == "calibrated"
    finally:
        svc.close()
