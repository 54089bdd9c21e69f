"""The hostpath2 host path on CUDA: reused page-locked staging buffers
(:class:`~pdflash.cache.staging.StagingRing`) under a stream slowed by
``torch.cuda._sleep``, so every copy runs long after the host moved on: each
upload still lands with its own values (a ring with the wait removed is
caught by the same check); the phase rows equal the old gathered table; and
the offloaded block with the new path (ring-staged slot table and phase
rows, pooled slot events) equals the old path (fresh pinned tensors, a new
event per release) in logits, slot tables and copies submitted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hostpath_reference import NoWaitRing, drive, install_old_path
from issuer_fixtures import small_gpu_overrides

from pdflash.cache.staging import StagingRing
from pdflash.models import write_synthetic_checkpoint
from pdflash.models.offload import OffloadedMoE

pytestmark = pytest.mark.gpu

#: about 50 ms of a ~2 GHz GPU's clock: the stream stays busy while the host
#: submits every upload of a test
SLOW = 100_000_000


def _uploads(cls: type[StagingRing]) -> tuple[StagingRing, int]:
    ring = cls((257,), torch.int64, torch.device("cuda"), depth=2, max_depth=3)
    rng = np.random.default_rng(0)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLOW)
    outs, wants = [], []
    for _ in range(12):
        values = rng.integers(-(2**40), 2**40, 257)
        outs.append(ring.upload(values))
        wants.append(values)
    torch.cuda.synchronize()
    bad = sum(not np.array_equal(o.cpu().numpy(), w) for o, w in zip(outs, wants, strict=True))
    return ring, bad


def test_slowed_stream_reads_each_upload_own_values() -> None:
    ring, bad = _uploads(StagingRing)
    assert bad == 0
    assert ring.depth == 3 and ring.grown == 1 and ring.waits > 0  # grew, then waited


def test_slowed_stream_catches_a_refill_without_wait() -> None:
    _, bad = _uploads(NoWaitRing)
    assert bad > 0


def test_phase_rows_on_cuda_equal_the_gathered_table() -> None:
    rng = np.random.default_rng(2)
    moe = OffloadedMoE.__new__(OffloadedMoE)
    moe.num_experts = 32
    moe._row_rings = {}
    torch.cuda.synchronize()
    torch.cuda._sleep(SLOW)
    got, want = [], []
    for _ in range(40):
        flat = rng.integers(0, 32, int(rng.choice([8, 16, 64])))
        routed = np.unique(flat)
        group = rng.choice(routed, int(rng.integers(1, routed.size + 1)), False)
        ready = rng.random(group.size) < 0.5
        got.append(moe._phase_rows(flat, group, ready, torch.device("cuda")))
        table = np.zeros((2, 32), dtype=bool)
        table[0, group[ready]] = True
        table[1, group[~ready]] = True
        want.append(table[:, flat])
    torch.cuda.synchronize()
    for g, w in zip(got, want, strict=True):
        assert g.is_cuda and g.dtype == torch.bool and np.array_equal(g.cpu().numpy(), w)
    assert sum(r.uploads for r in moe._row_rings.values()) == 40


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("slots", [8, 12])
def test_miss_path_equals_the_old_one_on_cuda(
    arch: str, slots: int, tmp_path: Path, cuda_issuer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_synthetic_checkpoint(
        tmp_path / arch,
        arch,
        num_layers=2,
        dtype=torch.bfloat16,
        config_overrides=small_gpu_overrides(arch),
    )
    kw: dict[str, Any] = {"device": "cuda", "slow_cycles": SLOW}
    for seed in (1, 2):
        with monkeypatch.context() as m:
            install_old_path(m)
            old = drive(path, cuda_issuer, slots, seed, **kw)
        new = drive(path, cuda_issuer, slots, seed, **kw)
        for a, b in zip(old["logits"], new["logits"], strict=True):
            assert torch.equal(a, b)
        for a, b in zip(old["tables"], new["tables"], strict=True):
            assert np.array_equal(a, b)
        assert old["copies"] == new["copies"] and old["copies"]
        ad = new["adapter"][0]
        assert ad.runtime.path == "grouped"
        cache = ad.cache
        assert cache._table_ring is not None and cache._table_ring.uploads > 0
        assert ad.runtime._row_rings  # the phase rows went through a ring
        events = cache._slot_events
        assert 0 < events.created <= cache.num_slots  # at most one live event per slot
        assert events.recorded > events.created  # events were reused
        assert cache.evictions > 0 and int(cache.pins.sum()) == 0
        for out in (old, new):
            out["adapter"][0].close()
