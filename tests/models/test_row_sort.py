"""The grouped block's row ordering (:func:`pdflash.models.offload.sort_rows`,
a counting sort) against the sort it replaced, and the all-resident layer's
one call over its slots' span against the split, sorted calls it replaced:
equal exactly (fp32, CPU), and equal to transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from issuer_fixtures import resident_adapter, token_ids

from pdflash.models import offload

needs_grouped = pytest.mark.skipif(
    not offload.grouped_mm_works(torch.device("cpu"), torch.float32),
    reason="this torch has no CPU grouped_mm",
)


def _old_sort(key: torch.Tensor, width: int, k: int) -> tuple[torch.Tensor, ...]:
    """What the block did before: a stable sort, searchsorted offsets, the
    tokens of the sorted rows, and the inverse permutation."""
    key_sorted, order = torch.sort(key, stable=True)
    offs = torch.searchsorted(key_sorted, torch.arange(width), right=True, out_int32=True)
    position = torch.empty_like(order)
    position[order] = torch.arange(key.numel())
    return key_sorted, order // k, offs, position


@pytest.mark.parametrize("counting", [True, False])
@pytest.mark.parametrize(
    ("n_tokens", "k", "width"), [(1, 1, 1), (7, 2, 8), (64, 8, 128), (33, 4, 1023), (5, 2, 40)]
)
def test_sort_rows_equals_a_stable_sort(
    n_tokens: int, k: int, width: int, counting: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not counting:
        monkeypatch.setattr(offload, "COUNTING_SORT_MAX_CELLS", 0)
    gen = torch.Generator().manual_seed(n_tokens * 1000 + width)
    for trial in range(3):
        # distinct experts per token (as top-k routing gives), some keys unused
        span = max(k, width // (trial + 1))
        key = torch.stack([torch.randperm(span, generator=gen)[:k] for _ in range(n_tokens)])
        key = key.reshape(-1) + (width - span) * (trial % 2)
        rows = offload.sort_rows(key, width, k)
        key_sorted, token, offs, position = _old_sort(key, width, k)
        assert rows.offs.dtype == torch.int32 and torch.equal(rows.offs, offs)
        assert torch.equal(rows.position, position)
        assert torch.equal(rows.token, token)
        assert torch.equal(rows.key_sorted(), key_sorted)


def test_sort_rows_falls_back_to_a_sort_past_the_cell_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    real_sort = torch.sort

    def counted_sort(*a: Any, **kw: Any) -> Any:
        calls.append(1)
        return real_sort(*a, **kw)

    monkeypatch.setattr(torch, "sort", counted_sort)
    key = torch.tensor([3, 1, 3, 0, 2, 1])
    offload.sort_rows(key, 4, 2)
    assert not calls  # 24 cells: counted
    monkeypatch.setattr(offload, "COUNTING_SORT_MAX_CELLS", 23)
    rows = offload.sort_rows(key, 4, 2)
    assert calls == [1]
    assert torch.equal(rows.position, _old_sort(key, 4, 2)[3])


def _old_run_sorted(
    self: offload.OffloadedMoE,
    x: torch.Tensor,
    k: int,
    key: torch.Tensor,
    width: int,
    views: dict[str, torch.Tensor],
    y_flat: torch.Tensor,
) -> None:
    """The unmasked call as it was: sort, searchsorted, indexed write back."""
    grouped = self.grouped
    assert grouped is not None
    key_sorted, order = torch.sort(key, stable=True)
    offs = torch.searchsorted(key_sorted, torch.arange(width), right=True, out_int32=True)
    y_flat[order] = grouped.forward(x[order // k], grouped.weights(views), offs, key_sorted)


@needs_grouped
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_resident_layers_run_one_call_over_their_slots_and_match_the_split_calls(
    arch: str,
    tiny_checkpoints: dict[str, Path],
    host_issuer: object,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 2 layers x 8 experts = 16 slots in calls of at most 10: without the
    # window each layer is two masked calls over slots 0-9 and 10-15; with it
    # one unmasked call over the 8 slots holding the layer
    monkeypatch.setattr(offload, "MAX_GROUPS_PER_CALL", 10)
    ad = resident_adapter(tiny_checkpoints[arch], host_issuer)
    runtime = ad.runtime
    windows = [runtime._resident_window(layer) for layer in range(ad.num_layers)]
    assert all(w is not None and w[1] == ad.num_experts for w in windows)
    calls: list[int] = []
    real_gmm = offload._grouped_mm

    def counted(*a: Any, **kw: Any) -> Any:
        calls.append(1)
        return real_gmm(*a, **kw)

    monkeypatch.setattr(offload, "_grouped_mm", counted)
    ids = token_ids(9, 5)
    with torch.no_grad():
        got = ad.forward_logits(ids)
        one_call = len(calls)
        calls.clear()
        monkeypatch.setattr(type(runtime), "_resident_window", lambda self, layer: None)
        split = ad.forward_logits(ids)
    assert one_call == 2 * ad.num_layers
    assert len(calls) == 4 * ad.num_layers
    assert torch.equal(got, split)


@needs_grouped
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_counting_sort_and_gather_equal_the_sort_and_indexed_write(
    arch: str,
    tiny_checkpoints: dict[str, Path],
    host_issuer: object,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from transformers import AutoModelForCausalLM

    ad = resident_adapter(tiny_checkpoints[arch], host_issuer)
    ids = token_ids(11, 6)
    ref = AutoModelForCausalLM.from_pretrained(
        tiny_checkpoints[arch], dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        want = ref(input_ids=ids[None]).logits[0]
        got = ad.forward_logits(ids)
        # the whole slab as one window too (the path of a slab of at most
        # MAX_GROUPS_PER_CALL slots whose layer spans are not known)
        monkeypatch.setattr(type(ad.runtime), "_resident_window", lambda self, layer: None)
        whole = ad.forward_logits(ids)
        monkeypatch.setattr(type(ad.runtime), "_run_sorted", _old_run_sorted)
        old = ad.forward_logits(ids)
    assert torch.equal(got, old) and torch.equal(whole, old)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.gpu
def test_sort_rows_on_cuda_equals_a_stable_sort_without_a_host_sync() -> None:
    gen = torch.Generator().manual_seed(9)
    for n_tokens, k, width in ((256, 8, 128), (256, 4, 32), (300, 8, 1023)):
        key = torch.stack([torch.randperm(width, generator=gen)[:k] for _ in range(n_tokens)])
        key = key.reshape(-1)
        want = _old_sort(key, width, k)
        dev = key.cuda()
        offload.sort_rows(dev, width, k)  # the cached index tensors, outside the check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            rows = offload.sort_rows(dev, width, k)
            key_sorted = rows.key_sorted()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert torch.equal(key_sorted.cpu(), want[0])
        assert torch.equal(rows.token.cpu(), want[1])
        assert torch.equal(rows.offs.cpu(), want[2])
        assert torch.equal(rows.position.cpu(), want[3])
