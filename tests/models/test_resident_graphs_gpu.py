"""Recorded all-resident layer calls on CUDA (CUDA graphs,
:mod:`pdflash.models.resident_graphs`): a replay equals the eager call bit
for bit over routings and token counts, a new routing between replays is
the one computed (no stale routing), a replay makes no host sync and
dispatches a handful of torch calls, and closing frees the graphs' memory."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from pdflash.bench.op_count import DispatchCounter

from pdflash.models import load_adapter, write_synthetic_checkpoint
from pdflash.models.resident_graphs import ResidentGraphs, set_resident_graphs

pytestmark = pytest.mark.gpu

#: torch calls of a replayed call: three input copies and the output's clone
#: (plus the routing's reshape; the graph launch is not a torch op)
MAX_REPLAY_DISPATCHES = 6


@pytest.fixture
def graphs_reset() -> Iterator[None]:
    yield
    set_resident_graphs(None)


def _adapter(arch: str, tmp_path: Path, issuer: Any) -> Any:
    overrides: dict[str, Any] = {"hidden_size": 256, "num_attention_heads": 4, "head_dim": 64}
    if arch == "qwen3_moe":  # Qwen3-30B-A3B's routing: 128 experts, top-8
        overrides.update(moe_intermediate_size=256, num_experts=128, num_experts_per_tok=8)
    else:  # gpt-oss-20b's: 32 experts, top-4
        overrides.update(intermediate_size=512, num_local_experts=32, num_experts_per_tok=4)
    path = write_synthetic_checkpoint(
        tmp_path / arch, arch, num_layers=2, dtype=torch.bfloat16, config_overrides=overrides
    )
    ad = load_adapter(path, device="cuda", issuer=issuer, cache_fraction=1.0)
    assert ad.runtime is not None and ad.runtime.path == "grouped" and ad.cache is not None
    ad.cache.prefetch(np.arange(ad.cache.num_ids))
    ad.cache.drain_inflight()
    ad.cache.device_slot_table()
    return ad


def _inputs(ad: Any, layer: int, tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    h = torch.randn(tokens, ad.hidden_size, generator=torch.Generator().manual_seed(seed))
    x = ad.moe_norm(layer, h.to("cuda", torch.bfloat16))
    ids, weights = ad.route(layer, x)
    return x, ids, weights


def _call(ad: Any, mode: str, layer: int, x: Any, ids: Any, weights: Any) -> torch.Tensor:
    set_resident_graphs(mode)
    out: torch.Tensor = ad.runtime.forward_routed(layer, x, ids, weights)
    return out


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_replays_equal_eager_bit_for_bit_and_follow_each_routing(
    arch: str, tmp_path: Path, cuda_issuer: Any, graphs_reset: None
) -> None:
    ad = _adapter(arch, tmp_path, cuda_issuer)
    # exact token counts: the eager call's kernels on its own shapes
    graphs = ad.runtime.resident_graphs = ResidentGraphs(token_buckets=())
    with torch.inference_mode():
        for layer in range(ad.num_layers):
            for tokens in (16, 37, 64, 256):
                previous = None
                for seed in range(4):
                    x, ids, weights = _inputs(ad, layer, tokens, 1000 * layer + tokens + seed)
                    want = _call(ad, "off", layer, x, ids, weights)
                    got = _call(ad, "on", layer, x, ids, weights)
                    assert graphs.last == ("eager" if seed == 0 else "graph"), graphs.last_reason
                    assert torch.equal(got, want), (layer, tokens, seed)
                    if previous is not None:  # a new routing, not the last replay's
                        assert not torch.equal(got, previous)
                    previous = got
    st = graphs.stats
    assert st.captures == ad.num_layers * 4 and st.mismatches == 0 and st.capture_failures == 0
    assert st.replays == ad.num_layers * 4 * 2
    cache_stats = ad.cache.stats()
    assert cache_stats["misses"] == 0 and int(ad.cache.pins.sum()) == 0
    ad.close()


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_a_replay_makes_no_host_sync_in_a_handful_of_torch_calls(
    arch: str, tmp_path: Path, cuda_issuer: Any, graphs_reset: None
) -> None:
    ad = _adapter(arch, tmp_path, cuda_issuer)
    with torch.inference_mode():
        x, ids, weights = _inputs(ad, 0, 64, 7)
        for _ in range(3):  # warming, recording, a first replay
            _call(ad, "on", 0, x, ids, weights)
        x2, ids2, weights2 = _inputs(ad, 0, 64, 8)
        want = _call(ad, "off", 0, x2, ids2, weights2)
        set_resident_graphs("on")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with DispatchCounter() as d:
                got = ad.runtime.forward_routed(0, x2, ids2, weights2)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert ad.runtime.resident_graphs.last == "graph"
    assert sum(d.ops.values()) <= MAX_REPLAY_DISPATCHES, dict(d.ops)
    assert torch.equal(got, want)
    ad.close()


def _padded(x: Any, ids: Any, weights: Any, size: int) -> tuple[torch.Tensor, ...]:
    """A call's inputs padded as the recorder pads them: zero rows of input
    and weight, each routed to the first token's experts."""
    pad = size - x.shape[0]
    return (
        torch.cat([x, x.new_zeros(pad, x.shape[1])]),
        torch.cat([ids, ids[:1].expand(pad, -1)]),
        torch.cat([weights, weights.new_zeros(pad, weights.shape[1])]),
    )


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_padded_replays_keep_the_real_rows_in_a_few_torch_calls(
    arch: str, tmp_path: Path, cuda_issuer: Any, graphs_reset: None
) -> None:
    """Token counts padded up to their bucket: one recording serves 37..40
    tokens; each replay equals, bit for bit, the eager call over the padded
    inputs, and its real rows the unpadded eager call's within bf16
    rounding; the cache's books count the real rows only; a padded replay
    makes no host sync in a few more torch calls than an exact one."""
    ad = _adapter(arch, tmp_path, cuda_issuer)
    graphs = ad.runtime.resident_graphs
    assert graphs.padded_tokens(37) == 40
    with torch.inference_mode():
        for i, tokens in enumerate((38, 37, 40, 39, 37)):  # 38: warming; then one recording
            x, ids, weights = _inputs(ad, 1, tokens, 50 + i)
            hits = ad.cache.stats()["hits"]
            want = _call(ad, "off", 1, x, ids, weights)
            eager_hits = ad.cache.stats()["hits"] - hits
            want_padded = _call(ad, "off", 1, *_padded(x, ids, weights, 40))
            hits = ad.cache.stats()["hits"]
            got = _call(ad, "on", 1, x, ids, weights)
            assert graphs.last == ("eager" if i == 0 else "graph"), graphs.last_reason
            assert ad.cache.stats()["hits"] - hits == eager_hits  # the books: the call's own
            assert got.shape == want.shape
            assert torch.equal(got, want_padded[:tokens]), (tokens, i)
            err = float((got.float() - want.float()).abs().max())
            assert err <= 2e-2 * float(want.float().abs().max()), (tokens, err)
        x, ids, weights = _inputs(ad, 1, 37, 99)
        want = _call(ad, "off", 1, *_padded(x, ids, weights, 40))
        set_resident_graphs("on")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with DispatchCounter() as d:
                got = ad.runtime.forward_routed(1, x, ids, weights)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert graphs.last == "graph"
    # + the first token's ids and their copy over the padding rows (the
    # padding rows' zeroing only where the last call had more real rows)
    assert sum(d.ops.values()) <= MAX_REPLAY_DISPATCHES + 2, dict(d.ops)
    assert torch.equal(got, want[:37])
    assert graphs.stats.captures == 1 and graphs.stats.mismatches == 0
    assert int(ad.cache.pins.sum()) == 0
    ad.close()


def test_close_frees_the_graphs_memory(
    tmp_path: Path, cuda_issuer: Any, graphs_reset: None
) -> None:
    ad = _adapter("gpt_oss", tmp_path, cuda_issuer)
    calls = [(layer, t) for layer in range(2) for t in (64, 256)]
    with torch.inference_mode():
        inputs = [_inputs(ad, layer, t, t) for layer, t in calls]
        for (layer, _), (x, ids, weights) in zip(calls, inputs, strict=True):
            _call(ad, "off", layer, x, ids, weights)  # eager caches made before `before`
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()
        for (layer, _), (x, ids, weights) in zip(calls, inputs, strict=True):
            for _ in range(3):
                _call(ad, "on", layer, x, ids, weights)
    graphs = ad.runtime.resident_graphs
    assert graphs.num_graphs == 4 and graphs.num_buckets == 2
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    held = torch.cuda.memory_reserved()  # the pools' memory is not releasable yet
    ad.runtime.close()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    after = torch.cuda.memory_reserved()
    assert graphs.num_graphs == 0 and graphs.num_buckets == 0
    assert held > before and after <= before + (held - before) // 4, (before, held, after)
    ad.close()
