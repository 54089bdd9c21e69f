"""The routing's host read-back shared by a layer's readers
(:func:`pdflash.models.offload.routed_ids_on_host`): one device read per
routing tensor within a :func:`~pdflash.models.offload.shared_routing_reads`
block, never a stale or aliased array across tensors, blocks or steps."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from pdflash.models.offload import routed_ids_on_host, shared_routing_reads


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
    with shared_routing_reads():
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
    with shared_routing_reads():
        ha = routed_ids_on_host(a)
        hb = routed_ids_on_host(b)
        assert hb is not ha and hb.tolist() == ha.tolist() and len(reads) == 2
        # the memo holds one tensor: going back to the first reads it again
        assert routed_ids_on_host(a) is not ha and len(reads) == 3


def test_an_in_place_change_is_read_anew_and_the_old_array_is_not_a_view() -> None:
    ids = torch.tensor([[4, 6], [1, 2]])
    with shared_routing_reads():
        before = routed_ids_on_host(ids)
        ids[0, 0] = 7  # bumps the version counter
        after = routed_ids_on_host(ids)
    assert after.tolist() == [7, 6, 1, 2]
    assert before.tolist() == [4, 6, 1, 2]  # a copy, not the tensor's memory


def test_an_inference_tensor_is_read_every_time(reads: list[int]) -> None:
    with torch.inference_mode():
        ids = torch.tensor([[1, 0]], dtype=torch.int32)
    with shared_routing_reads():
        a = routed_ids_on_host(ids)
        b = routed_ids_on_host(ids)
    assert a.tolist() == b.tolist() == [1, 0] and a.dtype == np.int64
    assert len(reads) == 2


def _write_without_version_bump(ids: torch.Tensor, values: list[list[int]]) -> None:
    """What a CUDA graph replay does to its static outputs: new values in the
    tensor's memory, its version counter untouched."""
    version = ids._version
    ids.data.copy_(torch.tensor(values, dtype=ids.dtype))  # `.data`: its own counter
    assert ids._version == version


def test_a_write_that_bumps_no_version_is_read_in_the_next_block(reads: list[int]) -> None:
    ids = torch.tensor([[4, 6], [1, 2]])
    with shared_routing_reads():
        before = routed_ids_on_host(ids)
        _write_without_version_bump(ids, [[7, 0], [3, 5]])
        # within one block the memo cannot see such a write (identity and
        # version unchanged): why a block spans one layer's readers only, and
        # what a memo kept across blocks (the old one) would have returned
        assert routed_ids_on_host(ids) is before and len(reads) == 1
    with shared_routing_reads():
        after = routed_ids_on_host(ids)
    assert after.tolist() == [7, 0, 3, 5] and len(reads) == 2
    assert before.tolist() == [4, 6, 1, 2]


def test_outside_a_block_every_call_reads_the_device(reads: list[int]) -> None:
    ids = torch.tensor([[2, 3]])
    first = routed_ids_on_host(ids)
    _write_without_version_bump(ids, [[5, 1]])
    assert routed_ids_on_host(ids).tolist() == [5, 1] and first.tolist() == [2, 3]
    assert len(reads) == 2
    # a block's read leaves nothing behind once the block is left
    with shared_routing_reads():
        routed_ids_on_host(ids)
    _write_without_version_bump(ids, [[0, 4]])
    assert routed_ids_on_host(ids).tolist() == [0, 4] and len(reads) == 4


def test_nested_blocks_share_the_outermost_read_and_an_error_clears_it(
    reads: list[int],
) -> None:
    ids = torch.tensor([[1, 2]])
    with shared_routing_reads():
        outer = routed_ids_on_host(ids)
        with shared_routing_reads():  # the MoE block's own, inside the runner's
            assert routed_ids_on_host(ids) is outer
        assert routed_ids_on_host(ids) is outer and len(reads) == 1
    with pytest.raises(KeyError), shared_routing_reads():
        routed_ids_on_host(ids)
        raise KeyError("a reader failed")
    _write_without_version_bump(ids, [[3, 3]])
    with shared_routing_reads():
        assert routed_ids_on_host(ids).tolist() == [3, 3]
    assert len(reads) == 3


def test_another_thread_s_block_shares_nothing(reads: list[int]) -> None:
    import threading

    ids = torch.tensor([[6, 2]])
    got: list[np.ndarray] = []
    with shared_routing_reads():
        mine = routed_ids_on_host(ids)
        t = threading.Thread(target=lambda: got.append(routed_ids_on_host(ids)))
        t.start()
        t.join()
    assert got[0] is not mine and got[0].tolist() == mine.tolist() and len(reads) == 2


def test_routed_counts_equal_the_device_bincount() -> None:
    from types import SimpleNamespace

    from pdflash.models.offload import OffloadedMoE

    gen = torch.Generator().manual_seed(0)
    runtime = SimpleNamespace(num_experts=16)
    for rows, k in ((1, 1), (2, 4), (33, 8)):
        topk = torch.stack([torch.randperm(16, generator=gen)[:k] for _ in range(rows)])
        ids, counts = OffloadedMoE._routing_on_host(runtime, topk)  # type: ignore[arg-type]
        ref = torch.bincount(topk.reshape(-1), minlength=16).numpy()
        np.testing.assert_array_equal(ids, topk.reshape(-1).numpy())
        assert counts.dtype == np.int64
        np.testing.assert_array_equal(counts, ref)
