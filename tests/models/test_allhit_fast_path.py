"""The all-hit (every expert resident) offloaded MoE call's fast path: a
block with no route hooks skips the shared routing-read block, no-op dtype
casts are not dispatched, and the call's torch dispatches stay bounded (each
is host time on a GPU host). Outputs equal the hooked call and the int64/
same-dtype call exactly (fp32, CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from issuer_fixtures import resident_adapter
from pdflash.bench.op_count import DispatchCounter

from pdflash.models import offload

needs_grouped = pytest.mark.skipif(
    not offload.grouped_mm_works(torch.device("cpu"), torch.float32),
    reason="this torch has no CPU grouped_mm",
)

#: torch dispatches of one all-hit grouped call (the counting sort, the
#: grouped MLP, the un-permute and the weighted sum); the arch's MLP differs
MAX_DISPATCHES = {"qwen3_moe": 28, "gpt_oss": 38}


@needs_grouped
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_all_hit_call_without_hooks_equals_the_hooked_call_in_bounded_dispatches(
    arch: str, tiny_checkpoints: dict[str, Path], host_issuer: object
) -> None:
    ad = resident_adapter(tiny_checkpoints[arch], host_issuer)
    runtime = ad.runtime
    assert runtime.path == "grouped"
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(13, ad.hidden_size, generator=gen)
    seen: list[int] = []
    with torch.inference_mode():
        for layer in range(ad.num_layers):
            x = ad.moe_norm(layer, h)  # the MoE block's input
            ids, weights = ad.route(layer, x)
            runtime.forward_routed(layer, x, ids, weights)  # the window's views, memoised
            with DispatchCounter() as d:
                plain = runtime.forward_routed(layer, x, ids, weights)
            assert sum(d.ops.values()) <= MAX_DISPATCHES[arch], dict(d.ops)
            # no cast of the int64 ids, no cast of an fp32 sum to fp32
            assert "to" not in d.ops or d.ops["to"] == 1  # the offsets' int32
            remove = runtime.add_route_hook(lambda layer, ids: seen.append(layer))
            try:
                hooked = runtime.forward_routed(layer, x, ids, weights)
            finally:
                remove()
            assert torch.equal(plain, hooked)
            # the layer's HF block on the same input: the same math
            want = ad.resident_block(layer)(x[None])
            want = (want[0] if isinstance(want, tuple) else want)[0]
            torch.testing.assert_close(plain, want, atol=1e-5, rtol=0)
    assert seen == list(range(ad.num_layers))


@needs_grouped
def test_all_hit_call_casts_only_what_needs_casting(
    tiny_checkpoints: dict[str, Path], host_issuer: object
) -> None:
    ad = resident_adapter(tiny_checkpoints["qwen3_moe"], host_issuer)
    runtime = ad.runtime
    x = torch.randn(6, ad.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        ids, weights = ad.route(0, ad.moe_norm(0, x))
        want = runtime.forward_routed(0, x, ids, weights)
        # int32 ids are widened; the result is the same bits
        assert torch.equal(runtime.forward_routed(0, x, ids.int(), weights), want)
        # float64 weights: summed in float64, returned in x's dtype
        got = runtime.forward_routed(0, x, ids, weights.double())
    assert got.dtype == x.dtype
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


@pytest.fixture
def row_sort_reset() -> Any:
    yield
    offload.set_row_sort(None)


@needs_grouped
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_row_sort_modes_give_the_same_bits_and_sort_dispatches_fewer(
    arch: str, tiny_checkpoints: dict[str, Path], host_issuer: object, row_sort_reset: Any
) -> None:
    ad = resident_adapter(tiny_checkpoints[arch], host_issuer)
    runtime = ad.runtime
    h = torch.randn(21, ad.hidden_size, generator=torch.Generator().manual_seed(8))
    with torch.inference_mode():
        for layer in range(ad.num_layers):
            x = ad.moe_norm(layer, h)
            ids, weights = ad.route(layer, x)
            got, ops = {}, {}
            for mode in ("counting", "sort"):
                offload.set_row_sort(mode)
                assert offload.row_sort_mode() == mode
                runtime.forward_routed(layer, x, ids, weights)  # memoised views
                with DispatchCounter() as d:
                    got[mode] = runtime.forward_routed(layer, x, ids, weights)
                ops[mode] = d.ops
            assert torch.equal(got["counting"], got["sort"])
            assert ops["sort"]["sort"] == 1 and "cumsum" not in ops["sort"]
            assert "sort" not in ops["counting"]
            # 5 torch calls instead of 12 (gpt-oss: and its sorted keys come with the sort)
            saved = sum(ops["counting"].values()) - sum(ops["sort"].values())
            assert saved == (9 if arch == "gpt_oss" else 7), (ops["counting"], ops["sort"])


def test_row_sort_setting_and_environment(
    monkeypatch: pytest.MonkeyPatch, row_sort_reset: Any
) -> None:
    with pytest.raises(ValueError, match="row sort must be one of"):
        offload.set_row_sort("radix")
    offload.set_row_sort(None)
    monkeypatch.setenv("PDFLASH_ROW_SORT", "sort")
    assert offload.row_sort_mode() == "sort"
    offload.set_row_sort(None)
    monkeypatch.setenv("PDFLASH_ROW_SORT", "bogus")
    with pytest.raises(ValueError, match="PDFLASH_ROW_SORT must be one of"):
        offload.row_sort_mode()
    offload.set_row_sort(None)
    monkeypatch.delenv("PDFLASH_ROW_SORT")
    assert offload.row_sort_mode() == offload.DEFAULT_ROW_SORT == "plan_atomic"


@pytest.mark.gpu
def test_sort_mode_on_cuda_equals_the_counting_sort_without_a_host_sync(
    row_sort_reset: Any,
) -> None:
    gen = torch.Generator().manual_seed(11)
    for n_tokens, k, width in ((16, 8, 128), (256, 8, 128), (256, 4, 32)):
        key = torch.stack([torch.randperm(width, generator=gen)[:k] for _ in range(n_tokens)])
        dev = key.reshape(-1).cuda()
        rows = {}
        for mode in ("counting", "sort"):
            offload.set_row_sort(mode)
            offload.sort_rows(dev, width, k)  # cached index tensors, outside the check
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                r = offload.sort_rows(dev, width, k)
                key_sorted = r.key_sorted()
            finally:
                torch.cuda.set_sync_debug_mode(0)
            rows[mode] = (r.position, r.token, r.offs, key_sorted)
        for a, b in zip(rows["counting"], rows["sort"], strict=True):
            assert torch.equal(a, b)
