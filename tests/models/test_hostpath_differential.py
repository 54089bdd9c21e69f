"""The offloaded block's miss path against the code it replaced: the phase
rows chosen on the host from the host routing (one upload per group, no
device gather) and the rows' slots gathered once per group, versus the
per-group ``[2, experts]`` table gathered on the device and the slots
gathered per phase. Over random prompts on small caches (several groups per
layer, evictions within a layer), the logits, the slot table after each
forward and the copies submitted (experts, slots, band, in order) are the
same."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
from issuer_fixtures import token_ids

from pdflash.models import load_adapter, offload
from pdflash.models.offload import OffloadedMoE, _room

needs_grouped = pytest.mark.skipif(
    not offload.grouped_mm_works(torch.device("cpu"), torch.float32),
    reason="this torch has no CPU grouped_mm",
)


def _old_phase_rows(
    self: OffloadedMoE, flat: torch.Tensor, group: np.ndarray, ready: np.ndarray
) -> torch.Tensor:
    table = torch.zeros((2, self.num_experts), dtype=torch.bool, pin_memory=flat.is_cuda)
    host = table.numpy()
    group = np.asarray(group, dtype=np.int64)
    host[0, group[ready]] = True
    host[1, group[~ready]] = True
    return table.to(flat.device, non_blocking=True)[:, flat]


def _old_grouped_misses_on_device(
    self: OffloadedMoE,
    layer: int,
    x: torch.Tensor,
    k: int,
    flat: torch.Tensor,
    y_flat: torch.Tensor,
    experts: npt.NDArray[np.int64],
    *,
    partial: bool = False,
    **_: Any,
) -> None:
    cache = self.cache
    base = layer * self.num_experts
    i = 0
    while i < experts.size:
        room = _room(cache, layer)
        group = experts[i : i + room]
        flat_ids = base + group
        _, tickets = cache.acquire(flat_ids)
        try:
            ready = tickets < 0
            phase_rows: torch.Tensor | None = None
            for phase, waits in ((ready, False), (~ready, True)):
                if not phase.any():
                    continue
                if waits:
                    cache.wait_ready(tickets[phase])
                whole = not partial and group.size == experts.size and bool(phase.all())
                row_in = None
                if not whole:
                    if phase_rows is None:
                        phase_rows = _old_phase_rows(self, flat, group, ready)
                    row_in = phase_rows[int(waits)]
                self._grouped_rows(x, k, self._layer_slots(layer)[flat], row_in, y_flat)
        except BaseException:
            cache.abort(flat_ids)
            raise
        cache.release(flat_ids)
        i += group.size


def _drive(path: Path, issuer: object, slots: int, seed: int) -> dict[str, list[Any]]:
    ad = load_adapter(
        path, issuer=issuer, cache_slots=slots, max_batch_tokens=2, attn_implementation="eager"
    )
    cache = ad.cache
    out: dict[str, list[Any]] = {"logits": [], "tables": [], "copies": []}
    load = cache._load

    def logged(ids: Any, where: Any, band: Any) -> Any:
        out["copies"].append((np.array(ids).tolist(), np.array(where).tolist(), int(band)))
        return load(ids, where, band)

    cache._load = logged
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for step in range(6):
            ids = token_ids(int(rng.integers(1, 9)), seed=seed * 100 + step)
            out["logits"].append(ad.forward_logits(ids))
            out["tables"].append(cache.slot_of.copy())
    return out


@needs_grouped
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("slots", [4, 6])
def test_miss_path_equals_the_gathered_one(
    arch: str,
    slots: int,
    tiny_checkpoints: dict[str, Path],
    host_issuer: object,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = {"new": 0}
    new_phase_rows = OffloadedMoE._phase_rows

    def counted(self: OffloadedMoE, *args: Any) -> torch.Tensor:
        calls["new"] += 1
        return new_phase_rows(self, *args)

    for seed in (1, 2):
        with monkeypatch.context() as m:
            m.setattr(OffloadedMoE, "_grouped_misses_on_device", _old_grouped_misses_on_device)
            old = _drive(tiny_checkpoints[arch], host_issuer, slots, seed)
        with monkeypatch.context() as m:
            m.setattr(OffloadedMoE, "_phase_rows", counted)
            new = _drive(tiny_checkpoints[arch], host_issuer, slots, seed)
        for a, b in zip(old["logits"], new["logits"], strict=True):
            assert torch.equal(a, b)
        for a, b in zip(old["tables"], new["tables"], strict=True):
            assert np.array_equal(a, b)
        assert old["copies"] == new["copies"] and old["copies"]
    assert calls["new"] > 0  # partial groups ran (the rows selection was used)
