"""The offloaded block's per-layer host path as it was before the hostpath2
change, for differential tests (CPU and GPU): the ``[2, experts]`` phase
table gathered on the device by the routing and the rows' slots gathered
per phase, a fresh page-locked tensor per slot-table upload, one new CUDA
event per release/unpin (waited on and dropped by the eviction), plus
:func:`drive`, which records what a run of random prompts produced."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
from issuer_fixtures import token_ids

from pdflash._guard import exclusive
from pdflash.cache.expert_cache import ExpertCache
from pdflash.cache.staging import StagingRing
from pdflash.models import load_adapter
from pdflash.models.offload import OffloadedMoE, _room


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
    **unused: Any,
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
                        phase_rows = self._phase_rows(flat, group, ready)  # type: ignore[call-arg,arg-type]
                    row_in = phase_rows[int(waits)]
                self._grouped_rows(x, k, self._layer_slots(layer)[flat], row_in, y_flat)
        except BaseException:
            cache.abort(flat_ids)
            raise
        cache.release(flat_ids)
        i += group.size


def drive(
    path: Path, issuer: object, slots: int, seed: int, *, slow_cycles: int = 0, **kw: Any
) -> dict[str, list[Any]]:
    """Six forwards of random prompts (1-8 tokens) on a ``slots``-slot cache
    (``kw``: more :func:`~pdflash.models.load_adapter` arguments): each
    forward's logits, the slot table after it, and every copy submitted
    (experts, slots, band) in order. ``slow_cycles``: CUDA, a
    ``torch.cuda._sleep`` on the stream before each forward, so the host
    runs ahead of every copy it submits (a staging buffer refilled too
    early would be read late)."""
    ad = load_adapter(
        path,
        issuer=issuer,
        cache_slots=slots,
        max_batch_tokens=2,
        attn_implementation="eager",
        **kw,
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
            if slow_cycles:
                torch.cuda._sleep(slow_cycles)
            out["logits"].append(ad.forward_logits(ids).cpu())
            out["tables"].append(cache.slot_of.copy())
    out["adapter"] = [ad]
    return out


@exclusive
def _old_device_slot_table(self: ExpertCache) -> torch.Tensor:
    if self._table is None or self._table_dirty:
        if self._is_cuda:
            host = torch.empty(self.num_ids, dtype=torch.int64, pin_memory=True)
            host.numpy()[:] = self.slot_of
            self._table = host.to(self.device, non_blocking=True)
        else:
            self._table = torch.from_numpy(self.slot_of.copy())
        self._table_dirty = False
    return self._table


def _old_events(self: ExpertCache) -> npt.NDArray[np.object_]:
    """The old per-slot event array (the cache's own is the new pool's)."""
    events: npt.NDArray[np.object_] | None = self.__dict__.get("_old_events")
    if events is None:
        events = self.__dict__["_old_events"] = np.full(self.num_slots, None, dtype=object)
    return events


def _old_record_slot_event(self: ExpertCache, slots: npt.NDArray[np.int64]) -> None:
    if self._is_cuda:
        ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ev.record(torch.cuda.current_stream(self.device))
        _old_events(self)[slots] = ev


def _old_evict(self: ExpertCache, slots: npt.NDArray[np.int64]) -> None:
    if self._is_cuda:
        events = _old_events(self)
        for ev in {id(e): e for e in events[slots] if e is not None}.values():
            ev.synchronize()
        events[slots] = None
    ids, unused, unused_prefetch = self._books.evict(slots)
    self.bytes_evicted_unused += unused * self.expert_nbytes
    self.prefetch_bytes_evicted_unused += unused_prefetch * self.expert_nbytes
    self._table_dirty = True
    self.evictions += int(slots.size)
    self.policy.on_evict(ids)


class NoWaitRing(StagingRing):
    """The bug the ring exists to prevent: refill without waiting."""

    def stage(self) -> tuple[int, Any]:
        i = self._next
        saved = self._events[i]
        self._events[i] = None
        try:
            return super().stage()
        finally:
            self._events[i] = saved


#: the old path's methods: (class, attribute, the old function)
OLD_PATH: tuple[tuple[type, str, Any], ...] = (
    (OffloadedMoE, "_grouped_misses_on_device", _old_grouped_misses_on_device),
    (OffloadedMoE, "_phase_rows", _old_phase_rows),
    (ExpertCache, "device_slot_table", _old_device_slot_table),
    (ExpertCache, "_record_slot_event", _old_record_slot_event),
    (ExpertCache, "_evict", _old_evict),
)


def install_old_path(m: pytest.MonkeyPatch) -> None:
    """Patch the old host path into the classes (undone with ``m``)."""
    for cls, name, fn in OLD_PATH:
        m.setattr(cls, name, fn)
