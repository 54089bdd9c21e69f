"""The HOST part's forward-thread path: its rows are chosen on the host from
the routing the block read for its counts (the same rows, in the same order,
as the device sort they replace), the layer reads its routing once, the
rows' write equals an indexed assignment, and the workers convert the rows'
dtype (the executor's output is unchanged)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from issuer_fixtures import evicting_adapter, token_ids

from pdflash.hybrid import ForcedHostPlanner, HostExpertExecutor, build_host_service
from pdflash.hybrid.block import host_rows
from pdflash.models import load_adapter


def _device_rows(
    flat: torch.Tensor, k: int, host_experts: np.ndarray, num_experts: int, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: the rows as the block chose them on the device (a
    stable sort of the routed ids with the other experts' rows sorted last)."""
    pick = torch.zeros(num_experts, dtype=torch.bool)
    pick[torch.from_numpy(host_experts)] = True
    key = torch.where(pick[flat], flat, num_experts)
    n = int(pick[flat].sum())
    rows = torch.argsort(key, stable=True)[:n]
    return rows, x[rows // k]


@pytest.mark.parametrize("seed", range(6))
def test_host_rows_equal_the_device_sort(seed: int) -> None:
    g = np.random.default_rng(seed)
    num_experts, k = int(g.integers(4, 40)), int(g.integers(1, 5))
    tokens = int(g.integers(1, 20))
    flat_np = np.stack(
        [g.choice(num_experts, size=k, replace=False) for _ in range(tokens)]
    ).reshape(-1)
    routed = np.unique(flat_np)
    host_experts = np.sort(
        g.choice(routed, size=int(g.integers(1, routed.size + 1)), replace=False)
    )
    x = torch.randn(tokens, 8, generator=torch.Generator().manual_seed(seed))
    flat = torch.from_numpy(flat_np)
    rows, x_rows = host_rows(x, flat_np, k, host_experts, num_experts)
    want_rows, want_x = _device_rows(flat, k, host_experts, num_experts, x)
    assert rows.dtype == torch.int64
    assert rows.tolist() == want_rows.tolist()
    torch.testing.assert_close(x_rows, want_x, rtol=0, atol=0)
    # grouped by expert in ascending id, as the executor's counts assume
    experts_of_rows = flat_np[rows.numpy()]
    assert (np.diff(experts_of_rows) >= 0).all()
    counts = np.bincount(flat_np, minlength=num_experts)[host_experts]
    assert np.bincount(experts_of_rows, minlength=num_experts)[host_experts].tolist() == (
        counts.tolist()
    )


def test_host_rows_of_an_expert_no_row_routes_to_are_none() -> None:
    flat_np = np.array([0, 1, 1, 2], dtype=np.int64)
    rows, x_rows = host_rows(torch.ones(2, 3), flat_np, 2, np.array([3]), 4)
    assert rows.numel() == 0 and tuple(x_rows.shape) == (0, 3)


@pytest.mark.parametrize("path", ["grouped", "loop"])
def test_a_hosting_layer_reads_its_routing_once_in_inference_mode(
    path: str, tiny_checkpoints: dict[str, Path], host_issuer: object, monkeypatch: Any
) -> None:
    """Inference tensors are not memoised by the shared routing read: the
    HOST rows must come from the counts' read, not from a second one."""
    ad = evicting_adapter(tiny_checkpoints["gpt_oss"], host_issuer)
    assert ad.runtime is not None
    if path == "loop":
        ad.runtime.grouped = None
    if ad.runtime.path != path:
        pytest.skip(f"no {path} path here")
    ids = token_ids(9, 4)
    want = ad.forward_logits(ids)  # every miss copied
    svc = build_host_service(
        ad, link_bytes_per_s=1e9, planner=ForcedHostPlanner(every=1), calibrate=False
    )
    reads: list[int] = []
    real_cpu = torch.Tensor.cpu

    def cpu(self: torch.Tensor, *a: Any, **kw: Any) -> torch.Tensor:
        if self.dtype == torch.int64 and self.dim() == 1:
            reads.append(1)
        return real_cpu(self, *a, **kw)

    try:
        monkeypatch.setattr(torch.Tensor, "cpu", cpu)
        got = ad.forward_logits(ids)  # under inference_mode
        monkeypatch.setattr(torch.Tensor, "cpu", real_cpu)
        assert svc.books.layers > 0
        # one routing read per layer with misses, none more for the HOST rows
        assert len(reads) == svc.books.planned_layers
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    finally:
        svc.close()
        ad.runtime.host_service = None
        ad.close()


def test_write_into_equals_an_indexed_assignment(
    tiny_checkpoints: dict[str, Path], host_issuer: object
) -> None:
    from pdflash.hybrid.block import start_host_part

    ad = load_adapter(
        tiny_checkpoints["gpt_oss"], issuer=host_issuer, cache_slots=4, max_batch_tokens=2
    )
    svc = build_host_service(
        ad, link_bytes_per_s=1e9, planner=ForcedHostPlanner(every=1), calibrate=False
    )
    try:
        assert ad.cache is not None
        k, tokens = 2, 3
        flat_np = np.array([0, 5, 5, 1, 2, 0], dtype=np.int64)
        counts = np.bincount(flat_np, minlength=ad.num_experts).astype(np.int64)
        experts = np.flatnonzero(counts)
        x = torch.randn(tokens, ad.hidden_size, generator=torch.Generator().manual_seed(2))
        part = start_host_part(svc, ad.cache, 0, x, flat_np, k, experts, counts)
        assert part is not None and part.mask.all()
        y = torch.zeros(tokens * k, ad.hidden_size)
        want = y.clone()
        part.write_into(y)
        want[part.rows] = part.job._out.to(want.dtype)
        torch.testing.assert_close(y, want, rtol=0, atol=0)
        with pytest.raises(ValueError, match="routed rows"):
            start_host_part(svc, ad.cache, 0, x, flat_np[:-1], k, experts, counts)
    finally:
        svc.close()
        ad.close()


def test_the_workers_convert_the_rows_dtype(
    tiny_checkpoints: dict[str, Path], host_issuer: object
) -> None:
    ad = load_adapter(
        tiny_checkpoints["gpt_oss"], issuer=host_issuer, cache_slots=8, dtype=torch.float32
    )
    ids = np.array([0, 3], dtype=np.int64)
    counts = [2, 3]
    x = torch.randn(5, ad.hidden_size, generator=torch.Generator().manual_seed(1))
    try:
        with HostExpertExecutor(
            ad.store.views, ad.expert_forward, dtype=torch.float32, workers=2
        ) as ex:
            want = ex.compute(ids, x, counts)
            # rows handed over in another dtype cross as they are
            low = x.to(torch.bfloat16)
            host, ready = ex.to_host(low)
            assert host.dtype == torch.bfloat16 and ready is None
            got = ex.submit(ids, low, counts).result()
            ref = ex.compute(ids, low.to(torch.float32), counts)
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
        assert got.dtype == want.dtype == torch.float32
    finally:
        ad.close()


@pytest.mark.parametrize("seed", range(4))
def test_the_split_members_equal_isin(seed: int) -> None:
    from types import SimpleNamespace

    from pdflash.hybrid import HostExpertService

    g = np.random.default_rng(seed)
    svc = HostExpertService(
        SimpleNamespace(),  # type: ignore[arg-type]  # only the split's table is used
        ForcedHostPlanner(every=2),
        num_experts=16,
        expert_nbytes=8,
        link_bytes_per_s=1e9,
    )
    layer = int(g.integers(0, 4))
    ids = np.sort(g.choice(16, size=int(g.integers(1, 17)), replace=False)) + layer * 16
    chosen = g.choice(ids, size=int(g.integers(1, ids.size + 1)), replace=False)
    want = np.isin(ids, chosen)
    np.testing.assert_array_equal(svc._members(layer, ids, chosen), want)
    # ids outside the layer: isin itself
    other = ids + 16
    np.testing.assert_array_equal(svc._members(layer, other, chosen), np.isin(other, chosen))


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_one_worker_runs_the_whole_batch_as_one_job(
    workers: int, tiny_checkpoints: dict[str, Path], host_issuer: object
) -> None:
    ad = load_adapter(tiny_checkpoints["gpt_oss"], issuer=host_issuer, cache_slots=8)
    ids = np.array([0, 3, 5], dtype=np.int64)
    counts = [2, 1, 3]
    x = torch.randn(6, ad.hidden_size, generator=torch.Generator().manual_seed(3))
    parts = x.split(counts)
    try:
        with HostExpertExecutor(
            ad.store.views, ad.expert_forward, dtype=ad.store.layout.dtype, workers=workers
        ) as ex:
            job = ex.submit(ids, x, counts)
            got = job.result()
            assert len(job.intervals) == min(workers, ids.size)
            assert [t for run in job.run_tokens for t in run] == counts
        want = torch.cat(
            [ad.expert_forward(p, ad.store.views(int(i))) for p, i in zip(parts, ids, strict=True)]
        )
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    finally:
        ad.close()
