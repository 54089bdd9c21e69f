"""The per-layer host path of the eager offloaded call as it was before the
hostpath2 branch, patched in for before/after runs (CPU and H200):
``install()`` puts back a fresh page-locked tensor per slot-table upload,
the ``[2, experts]`` phase table gathered on the device by the routing
(and the rows' slots gathered per phase), and one new CUDA event per
release / unpin (waited on and dropped by the old ``_evict``). Everything
else is the installed package's.

    python -P -c "import sys; sys.path.insert(0, 'DIR'); import hostpath2_old_path as o; o.install(); o.main()" [eager_host args]
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from pdflash._guard import exclusive
from pdflash.cache.expert_cache import ExpertCache
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


def install() -> None:
    """Patch the old path into the classes (the process's every instance)."""
    OffloadedMoE._grouped_misses_on_device = _old_grouped_misses_on_device  # type: ignore[method-assign]
    OffloadedMoE._phase_rows = _old_phase_rows  # type: ignore[method-assign,assignment]
    ExpertCache.device_slot_table = _old_device_slot_table  # type: ignore[method-assign]
    ExpertCache._record_slot_event = _old_record_slot_event  # type: ignore[method-assign]
    ExpertCache._evict = _old_evict  # type: ignore[method-assign]


def main() -> None:
    from pdflash.bench.eager_host import main as eager_main

    sys.exit(eager_main(sys.argv[1:]))
