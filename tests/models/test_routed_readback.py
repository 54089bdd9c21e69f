"""The routing's host read-back shared by a layer's readers
(:func:`pdflash.models.offload.routed_ids_on_host`): one device read per
routing tensor, never a stale or aliased array across tensors or steps."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from pdflash.models.offload import routed_ids_on_host


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the device reads (``Tensor.cpu`` calls) the helper makes."""
    calls: list[int] = []
    real = torch.Tensor.cpu

    def counting(self: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        calls.append(1)
        return real(self, *args, **kw)

    monkeypatch.setattr(torch.Tensor, "cpu", counting)
    return calls


def test_a_second_read_of_the_same_routing_reads_nothing(reads: list[int]) -> None:
    ids = torch.tensor([[3, 1], [0, 3]])
    first = routed_ids_on_host(ids)
    second = routed_ids_on_host(ids)
    assert second is first and len(reads) == 1
    assert first.dtype == np.int64 and first.tolist() == [3, 1, 0, 3]
    assert not first.flags.writeable  # a reader cannot change what the next one sees
    with pytest.raises(ValueError):
        first[0] = 7


def test_another_routing_is_read_anew_even_with_equal_values(reads: list[int]) -> None:
    a = torch.tensor([[2, 5]])
    b = torch.tensor([[2, 5]])
    ha = routed_ids_on_host(a)
    hb = routed_ids_on_host(b)
    assert hb is not ha and hb.tolist() == ha.tolist() and len(reads) == 2
    # the memo holds one tensor: going back to the first reads it again
    assert routed_ids_on_host(a) is not ha and len(reads) == 3


def test_an_in_place_change_is_read_anew_and_the_old_array_is_not_a_view() -> None:
    ids = torch.tensor([[4, 6], [1, 2]])
    before = routed_ids_on_host(ids)
    ids[0, 0] = 7  # bumps the version counter
    after = routed_ids_on_host(ids)
    assert after.tolist() == [7, 6, 1, 2]
    assert before.tolist() == [4, 6, 1, 2]  # a copy, not the tensor's memory


def test_an_inference_tensor_is_read_every_time(reads: list[int]) -> None:
    with torch.inference_mode():
        ids = torch.tensor([[1, 0]], dtype=torch.int32)
    a = routed_ids_on_host(ids)
    b = routed_ids_on_host(ids)
    assert a.tolist() == b.tolist() == [1, 0] and a.dtype == np.int64
    assert len(reads) == 2


def test_routed_counts_equal_the_device_bincount() -> None:
    from types import SimpleNamespace

    from pdflash.models.offload import OffloadedMoE

    gen = torch.Generator().manual_seed(0)
    runtime = SimpleNamespace(num_experts=16)
    for rows, k in ((1, 1), (2, 4), (33, 8)):
        topk = torch.stack([torch.randperm(16, generator=gen)[:k] for _ in range(rows)])
        counts = OffloadedMoE._routed_counts(runtime, topk)  # type: ignore[arg-type]
        ref = torch.bincount(topk.reshape(-1), minlength=16).numpy()
        assert counts.dtype == np.int64
        np.testing.assert_array_equal(counts, ref)
