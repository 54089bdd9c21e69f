"""The HOST part of one offloaded MoE layer, in routed-row terms.

The offloaded block (:mod:`pdflash.models.offload`) calls two things, so the
hook fits any block that has the layer's routed expert per row (read to the
host once for the routed counts, ``[T * k]``) and those counts:

* :func:`start_host_part` right after the counts reach the host: the service
  picks the HOST experts, their rows are chosen on the host from the routing
  already there (:func:`host_rows`: numpy, then one small upload and one
  gather on the device; no sync), sent to the host and the CPU starts. It
  returns None when the layer has no HOST expert.
* :meth:`HostPart.write_into` as the block's last step before the weighted
  sum: the host's rows into their rows of ``y`` (one output row per routed
  row). On CUDA that copy and write are the only GPU work that waits for the
  host. With the service's ``thread`` hand-off the forward's thread waits
  for the host there; with ``stream`` it only enqueues a device wait before
  them (:mod:`pdflash.hybrid.handoff`) and goes on.

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
            host computes, sorted by expert (distinct).
    """

    mask: npt.NDArray[np.bool_]
    rows: torch.Tensor
    job: HostJob
    service: HostExpertService

    def result(self) -> torch.Tensor:
        """The HOST rows' expert outputs ``[len(rows), H]`` on the device."""
        return self.service.finish(self.job)

    def write_into(self, y: torch.Tensor) -> None:
        """``y[rows] = result()`` (in ``y``'s dtype): one indexed copy on the
        device, ordered after the result's upload on the same stream. With
        the ``stream`` hand-off the upload follows a device wait for the job
        instead of the thread's (the same operations otherwise)."""
        if self.service.handoff == "stream" and y.is_cuda:
            out = self.service.finish_on_stream(self.job)
        else:
            out = self.result()
        y.index_copy_(0, self.rows, out.to(y.dtype))

    def cancel(self) -> None:
        self.job.cancel()


def start_host_part(
    service: HostExpertService,
    cache: Any,
    layer: int,
    x: torch.Tensor,
    flat_host: npt.NDArray[np.int64],
    k: int,
    experts: npt.NDArray[np.int64],
    counts: npt.NDArray[np.int64],
    *,
    routed: tuple[float, float] | None = None,
) -> HostPart | None:
    """Plan and start the layer's HOST experts (see the module doc).

    Args:
        x: the layer's MoE input ``[T, H]``.
        flat_host: each routed row's local expert id ``[T * k]`` on the host
            (the routing the block read for ``counts``).
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
    flat_host = np.asarray(flat_host, dtype=np.int64).reshape(-1)
    if flat_host.size != x.shape[0] * k:
        raise ValueError(f"{flat_host.size} routed rows for {x.shape[0]} tokens x {k}")
    rows, x_rows = host_rows(x, flat_host, k, host_experts, num_experts)
    job = service.start(base + host_experts, x_rows, host_counts.tolist())
    service.clock.hosted(time.perf_counter() - began)
    return HostPart(mask=mask, rows=rows, job=job, service=service)


def host_rows(
    x: torch.Tensor,
    flat_host: npt.NDArray[np.int64],
    k: int,
    host_experts: npt.NDArray[np.int64],
    num_experts: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, x_rows)``: the routed rows (``token * k + slot``) whose
    expert is one of ``host_experts``, grouped by expert in ascending id
    (the executor's order) and ascending row within an expert, as a device
    index; and those rows' inputs gathered from ``x`` on the device.

    Chosen on the host from ``flat_host`` (the layer's routed expert per row,
    already read for the counts), so the device runs one gather and, on
    CUDA, one small page-locked upload (the rows and their tokens together,
    ``non_blocking``: it waits for nothing on the stream).
    """
    pick = np.zeros(num_experts, dtype=np.bool_)
    pick[host_experts] = True
    sel = np.flatnonzero(pick[flat_host])
    # a stable sort by expert keeps each expert's rows in ascending order
    rows_np = sel[np.argsort(flat_host[sel], kind="stable")]
    n = int(rows_np.size)
    if x.is_cuda:
        both = torch.empty((2, n), dtype=torch.int64, pin_memory=True)
        host = both.numpy()
        host[0] = rows_np
        np.floor_divide(rows_np, k, out=host[1])
        both = both.to(x.device, non_blocking=True)
    else:
        both = torch.from_numpy(np.stack([rows_np, rows_np // k]))
    return both[0], x.index_select(0, both[1])
