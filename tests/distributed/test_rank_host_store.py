"""Per-rank host memory under expert parallelism: each rank's host store packs
only the experts its placement gives it (the same bytes as the full store's,
a 1/N share of them for a balanced placement), and asking a rank's store for
another rank's expert fails loudly, leaving the cache unchanged."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pdflash.distributed import (
    RankGroup,
    distributed_available,
    install_expert_parallel,
    launch,
    owned_experts_of,
    owned_mask,
    placement_for,
)
from pdflash.h2d import H2DIssuer
from pdflash.models import ForeignExpertError, load_adapter, write_synthetic_checkpoint


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("rank-store") / "target"
    write_synthetic_checkpoint(path, "qwen3_moe", "tiny", num_layers=3, dtype=torch.float32, seed=5)
    return path


def _grid(path: Path) -> tuple[int, int]:
    cfg = json.loads((path / "config.json").read_text())
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    return int(cfg["num_hidden_layers"]), int(experts)


def _skewed(path: Path) -> np.ndarray:
    return np.random.default_rng(2).zipf(1.5, size=_grid(path)).astype(np.float64)


@pytest.mark.parametrize("placement", ["round_robin", "frequency"])
def test_each_rank_packs_only_its_experts_with_the_full_stores_bytes(
    target: Path, placement: str
) -> None:
    world = 2
    freq = _skewed(target) if placement == "frequency" else None
    full = load_adapter(target).store
    layers, experts = _grid(target)
    table = placement_for(placement, layers, experts, world, freq).owner_table()
    seen = np.zeros((layers, experts), dtype=np.int64)
    for rank in range(world):
        store = load_adapter(
            target, owned_experts=owned_experts_of(placement, rank, world, freq)
        ).store
        mine = table == rank
        assert store.owned is not None and np.array_equal(store.owned, mine)
        # a balanced placement: half of the model's expert bytes per rank
        assert store.num_packed == int(mine.sum()) == layers * experts // world
        assert store.packed_nbytes == full.packed_nbytes // world
        assert store.buffer.numel() == store.packed_nbytes
        assert store.total_nbytes == full.total_nbytes  # the model's, for the books
        for g in np.flatnonzero(mine.reshape(-1)).tolist():
            assert torch.equal(store.packed(g), full.packed(g))
            ptr = int(store.host_ptrs([g])[0])
            assert store.buffer.data_ptr() <= ptr < store.buffer.data_ptr() + store.packed_nbytes
        seen += mine
    assert (seen == 1).all()  # the ranks' stores partition the model's experts


def test_a_foreign_expert_fails_loudly_and_changes_nothing(target: Path) -> None:
    owned = owned_experts_of("round_robin", 1, 2)
    adapter = load_adapter(target, owned_experts=owned)
    store = adapter.store
    layers, experts = _grid(target)
    foreign = int(np.flatnonzero(~owned(layers, experts).reshape(-1))[0])
    mine = int(np.flatnonzero(owned(layers, experts).reshape(-1))[0])
    layer, expert = divmod(foreign, experts)
    match = rf"expert {foreign} \(layer {layer}, expert {expert}\) is not packed"
    for ask in (store.packed, store.views, lambda g: store.host_ptrs([mine, g])):
        with pytest.raises(ForeignExpertError, match=match):
            ask(foreign)
    with pytest.raises(ValueError, match="out of range"):
        store.packed(layers * experts)  # out of the grid: the range error, as before
    with pytest.raises(ForeignExpertError):
        store.stacked(0, "cpu")  # a resident layer needs every expert of it
    issuer = H2DIssuer(backend="host")
    try:
        # a cache over the partial store that was not restricted to the rank's
        # experts: the store refuses the copy before the cache changes
        cache = adapter.attach_new_cache(issuer, num_slots=4)
        with pytest.raises(ForeignExpertError, match=match):
            cache.ensure_resident(np.array([mine, foreign]))
        assert not cache.resident_mask().any() and int(np.asarray(cache.pins).sum()) == 0
        assert cache.stats()["bytes_in"] == 0
        slot = cache.ensure_resident(np.array([mine]))
        assert torch.equal(cache.slot_tensor(int(slot[0])), store.packed(mine))
        cache.release(np.array([mine]))
    finally:
        issuer.close()


def test_store_owned_mask_is_checked(target: Path) -> None:
    layers, experts = _grid(target)
    with pytest.raises(ValueError, match="bool"):
        load_adapter(target, owned_experts=np.ones((layers, experts), dtype=np.int64))
    with pytest.raises(ValueError, match="bool"):
        load_adapter(target, owned_experts=np.ones((experts, layers + 1), dtype=np.bool_))
    with pytest.raises(ValueError, match="out of range"):
        owned_experts_of("round_robin", 2, 2)
    # a wholly owned layer still stacks (a resident layer from a partial store)
    mask = np.zeros((layers, experts), dtype=np.bool_)
    mask[1] = True
    part = load_adapter(target, owned_experts=mask).store
    full = load_adapter(target).store
    for name, t in part.stacked(1, "cpu").items():
        assert torch.equal(t, full.stacked(1, "cpu")[name])


def test_install_refuses_a_store_missing_the_ranks_experts(target: Path) -> None:
    # the check runs before any collective or state change: no process group needed
    layers, experts = _grid(target)
    adapter = load_adapter(target, owned_experts=owned_experts_of("round_robin", 0, 2))
    placement = placement_for("round_robin", layers, experts, 2)
    group = RankGroup(
        rank=1, world_size=2, local_rank=1, device=torch.device("cpu"), backend="gloo"
    )
    issuer = H2DIssuer(backend="host")
    try:
        cache = adapter.attach_new_cache(issuer, num_slots=4)
        with pytest.raises(ValueError, match=r"rank 1 owns expert .* did not pack"):
            install_expert_parallel(adapter, cache, placement, group)
        assert cache.owned is None  # refused: the cache was not restricted
    finally:
        issuer.close()


def _rank_probe(group: RankGroup, path: str) -> dict[str, Any]:
    """On each rank: load with this rank's share, install the runtime, and ask
    for an expert of the other rank through the store and the cache."""
    from pdflash.distributed.worker import expert_parallel_stack

    torch.set_num_threads(1)
    owned = owned_experts_of("round_robin", group.rank, group.world_size)
    adapter: Any = load_adapter(path, owned_experts=owned)
    issuer = H2DIssuer(backend="host")
    try:
        cache = adapter.attach_new_cache(issuer, num_slots=4)
        layers, experts = adapter.num_layers, adapter.num_experts
        placement = placement_for("round_robin", layers, experts, group.world_size)
        _, view, _ = expert_parallel_stack(adapter, cache, group, placement)
        foreign = int(np.flatnonzero(~view.owned.reshape(-1))[0])
        errors = []
        for ask in (lambda: adapter.store.host_ptrs([foreign]), lambda: cache.acquire([foreign])):
            try:
                ask()
                errors.append(None)
            except ValueError as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
        return {
            "packed": int(adapter.store.packed_nbytes),
            "model": int(adapter.store.total_nbytes),
            "owned_match": bool(
                np.array_equal(adapter.store.owned, owned_mask(placement, group.rank))
            ),
            "errors": errors,
            "resident": int(np.asarray(cache.resident_mask()).sum()),
        }
    finally:
        issuer.close()


@pytest.mark.skipif(not distributed_available(), reason="torch.distributed with gloo needed")
@pytest.mark.timeout(300)
def test_two_gloo_ranks_pack_half_and_refuse_foreign_experts(target: Path) -> None:
    ranks = launch(_rank_probe, 2, str(target), device="cpu")
    assert sum(r["packed"] for r in ranks) == ranks[0]["model"]
    for r in ranks:
        assert r["owned_match"]
        assert r["packed"] == r["model"] // 2
        store_error, cache_error = r["errors"]
        assert store_error is not None and store_error.startswith("ForeignExpertError")
        assert cache_error is not None and "restrict_to" in cache_error
        assert r["resident"] == 0


def test_a_ranks_host_executor_prepares_and_times_only_its_experts(target: Path) -> None:
    from pdflash.hybrid import build_host_service, host_weights_for
    from pdflash.hybrid.kernels import host_kernel_for, prepare_all

    layers, experts = _grid(target)
    owned = owned_experts_of("round_robin", 0, 2)(layers, experts).reshape(-1)
    mine = np.flatnonzero(owned)
    foreign = int(np.flatnonzero(~owned)[0])
    full = load_adapter(target)
    kernel = host_kernel_for(full, "fp32_out_in")
    assert kernel is not None
    every = prepare_all(kernel, full.store.views, range(full.store.num_ids))
    assert every is not None
    issuer = H2DIssuer(backend="host")
    try:
        adapter = load_adapter(target, owned_experts=owned.reshape(layers, experts))
        adapter.attach_new_cache(issuer, num_slots=4)
        hw = host_weights_for(adapter, "fp32_out_in", budget_bytes=1 << 30)
        assert hw.nbytes == every.nbytes // 2  # the rank's half of the prepared copy
        for g in mine.tolist():
            for name, t in hw.weights_of(g).items():
                assert torch.equal(t, every.of(g)[name])
        with pytest.raises(ForeignExpertError, match=f"expert {foreign} has no prepared"):
            hw.weights_of(foreign)
        # the calibration times the rank's own experts (a foreign one would raise)
        svc = build_host_service(adapter, link_bytes_per_s=1e9, host_format="packed")
        try:
            assert svc.cost is not None and svc.cost.source == "calibrated"
        finally:
            svc.close()
    finally:
        issuer.close()
