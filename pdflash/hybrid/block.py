"""The HOST part of one offloaded MoE layer, in routed-row terms.

The offloaded block (:mod:`pdflash.models.offload`) calls two things, so the
hook fits any block that has the layer's routed expert per row (``flat``,
``[T * k]`` on the device) and the routed counts on the host:

* :func:`start_host_part` right after the counts reach the host: the service
  picks the HOST experts, their rows are found on the device (no extra sync:
  how many rows each has is in the counts), gathered, sent to the host and
  the CPU starts. It returns None when the layer has no HOST expert.
* :meth:`HostPart.result` as the block's last step before the weighted sum:
  ``y[part.rows] = part.result()`` (``y`` holds one output row per routed
  row). On CUDA that write is the only GPU work that waits for the host.

The block skips the HOST experts (``part.mask`` over its distinct routed
experts) when it pins, copies and computes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from pdflash.hybrid.executor import HostJob
from pdflash.hybrid.service import HostExpertService


@dataclass
class HostPart:
    """One layer's HOST work in flight.

    Attributes:
        mask: over the block's distinct routed experts (ascending local ids):
            True where the host computes the expert.
        rows: device indices of the routed rows (``token * k + slot``) the
            host computes, sorted by expert.
    """

    mask: npt.NDArray[np.bool_]
    rows: torch.Tensor
    job: HostJob
    service: HostExpertService

    def result(self) -> torch.Tensor:
        """The HOST rows' expert outputs ``[len(rows), H]`` on the device."""
        return self.service.finish(self.job)

    def cancel(self) -> None:
        self.job.cancel()


def start_host_part(
    service: HostExpertService,
    cache: Any,
    layer: int,
    x: torch.Tensor,
    flat: torch.Tensor,
    k: int,
    experts: npt.NDArray[np.int64],
    counts: npt.NDArray[np.int64],
    *,
    routed: tuple[float, float] | None = None,
) -> HostPart | None:
    """Plan and start the layer's HOST experts (see the module doc).

    Args:
        x: the layer's MoE input ``[T, H]``.
        flat: each routed row's local expert id ``[T * k]`` (device).
        k: experts per token.
        experts: the distinct routed local ids (ascending).
        counts: rows routed to each expert, indexed by local id (host).
        routed: the ``(start, end)`` perf_counter seconds of the layer's
            routing read (the forward thread's clock, see
            :class:`~pdflash.hybrid.service.ForwardClock`).
    """
    num_experts = service.num_experts
    base = layer * num_experts
    tokens = np.asarray(counts, dtype=np.int64)[experts]
    mask = service.split(layer, base + experts, tokens, cache, routed=routed)
    if not mask.any():
        return None
    began = time.perf_counter()
    host_experts = experts[mask]
    host_counts = tokens[mask]
    n_rows = int(host_counts.sum())
    # NOTE: rows of non-HOST experts get key num_experts and sort last, so the
    # first n_rows of a stable sort are the HOST rows grouped by expert
    # (ascending id, the executor's order)
    pick = torch.zeros(num_experts, dtype=torch.bool)
    pick[torch.from_numpy(host_experts)] = True
    if flat.is_cuda:  # page-locked, so the copy does not wait for the stream
        pick = pick.pin_memory()
    pick_dev = pick.to(flat.device, non_blocking=True)
    key = torch.where(pick_dev[flat], flat, num_experts)
    rows = torch.argsort(key, stable=True)[:n_rows]
    x_rows = x[rows // k]
    job = service.start(base + host_experts, x_rows, host_counts.tolist())
    service.clock.hosted(time.perf_counter() - began)
    return HostPart(mask=mask, rows=rows, job=job, service=service)
