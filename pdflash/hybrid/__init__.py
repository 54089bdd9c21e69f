"""Hybrid miss service: the host CPU computes cold experts while the link
copies others (issue 16).

* :mod:`pdflash.hybrid.planner` — the :class:`MissPlanner` protocol, the
  default :class:`CostModelPlanner`, and :class:`ForcedHostPlanner`;
* :mod:`pdflash.hybrid.cost` — :class:`HostCostModel` and its start-up
  calibration on the model's own experts;
* :mod:`pdflash.hybrid.executor` — :class:`HostExpertExecutor`, the CPU pool;
* :mod:`pdflash.hybrid.service` — :class:`HostExpertService`, the hook the
  offloaded MoE block calls, and :class:`HostBooks`.

:func:`build_host_service` wires them for an adapter with an attached cache.
"""

from __future__ import annotations

from typing import Any

import torch

from pdflash.hybrid.cost import HostCostModel, calibrate_host, fit_affine
from pdflash.hybrid.executor import HostExpertExecutor, HostJob, default_host_threads
from pdflash.hybrid.planner import (
    CostModelPlanner,
    ForcedHostPlanner,
    LinkState,
    MissPlan,
    MissPlanner,
)
from pdflash.hybrid.service import HostBooks, HostExpertService

HOST_EXPERT_MODES = ("off", "auto")

__all__ = [
    "HOST_EXPERT_MODES",
    "CostModelPlanner",
    "ForcedHostPlanner",
    "HostBooks",
    "HostCostModel",
    "HostExpertExecutor",
    "HostExpertService",
    "HostJob",
    "LinkState",
    "MissPlan",
    "MissPlanner",
    "build_host_service",
    "calibrate_host",
    "default_host_threads",
    "fit_affine",
]


def build_host_service(
    adapter: Any,
    *,
    link_bytes_per_s: float,
    planner: MissPlanner | None = None,
    workers: int | None = None,
    intra_op_threads: int | None = None,
    margin: float = 0.1,
    max_host_ratio: float = 1.0,
    calibrate: bool = True,
    cost: HostCostModel | None = None,
) -> HostExpertService:
    """A :class:`HostExpertService` for ``adapter`` (its ``store`` and
    ``expert_forward``), attached to its offloaded runtime.

    The CPU is calibrated here on the adapter's own experts (unless ``cost``
    is given or ``calibrate`` is False, which needs a ``planner``).
    ``intra_op_threads`` defaults to all cores but two on CUDA and to torch's
    current setting on CPU (where the "host" is the device itself).
    """
    store = adapter.store
    device = torch.device(getattr(adapter, "device", "cpu"))
    auto_workers, auto_threads = default_host_threads()
    if intra_op_threads is None and device.type == "cuda":
        intra_op_threads = auto_threads
    executor = HostExpertExecutor(
        store.views,
        adapter.expert_forward,
        dtype=store.layout.dtype,
        expert_nbytes=store.expert_nbytes,
        workers=workers if workers is not None else auto_workers,
        intra_op_threads=intra_op_threads,
    )
    try:
        if cost is None and calibrate:
            cost = calibrate_host(
                executor,
                num_ids=store.num_ids,
                hidden_size=int(adapter.hidden_size),
                device=device,
            )
        if planner is None:
            if cost is None:
                raise ValueError("no planner given and no cost model to build one from")
            planner = CostModelPlanner(
                cost, store.expert_nbytes, margin=margin, max_host_ratio=max_host_ratio
            )
        service = HostExpertService(
            executor,
            planner,
            num_experts=int(adapter.num_experts),
            expert_nbytes=store.expert_nbytes,
            link_bytes_per_s=link_bytes_per_s,
            cost=cost,
        )
    except BaseException:
        executor.close()
        raise
    runtime = getattr(adapter, "runtime", None)
    if runtime is not None:
        runtime.host_service = service
    return service
