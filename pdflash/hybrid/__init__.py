"""Hybrid miss service: the host CPU computes cold experts while the link
copies others (issue 16).

* :mod:`pdflash.hybrid.planner` — the :class:`MissPlanner` protocol, the
  default :class:`CostModelPlanner`, and :class:`ForcedHostPlanner`;
* :mod:`pdflash.hybrid.cost` — :class:`HostCostModel` and its start-up
  calibration on the model's own experts;
* :mod:`pdflash.hybrid.executor` — :class:`HostExpertExecutor`, the CPU pool;
* :mod:`pdflash.hybrid.kernels` — host weight formats: experts prepared once
  in a compute-friendly layout/dtype and the MLP over them;
* :mod:`pdflash.hybrid.native` — the ``native`` format: pdflash's C++ expert
  MLP (AMX / AVX-512 BF16, a thread team over output columns);
* :mod:`pdflash.hybrid.prepare` — choosing the format (timed) and preparing
  a store's experts in it, within a host-memory budget;
* :mod:`pdflash.hybrid.service` — :class:`HostExpertService`, the hook the
  offloaded MoE block calls, and :class:`HostBooks`;
* :mod:`pdflash.hybrid.handoff` — how HOST outputs reach the device stream
  (``thread``: the forward's thread waits; ``stream``: a device-side wait
  on a host-set flag, :class:`StreamSignals`).

:func:`build_host_service` wires them for an adapter with an attached cache.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterable
from typing import Any

import torch

from pdflash.hybrid.affinity import (
    DEFAULT_HOST_AFFINITY,
    HOST_AFFINITY_CHOICES,
    HostPlacement,
    PlacedThreads,
    ThreadedKernel,
    plan_placement,
    rank_cpus,
)
from pdflash.hybrid.cost import (
    HostCostModel,
    OnlineHostCost,
    calibrate_host,
    fit_affine,
    fit_robust,
)
from pdflash.hybrid.executor import HostExpertExecutor, HostJob, default_host_threads
from pdflash.hybrid.handoff import HANDOFF_CHOICES, HostHandoffError, StreamSignals
from pdflash.hybrid.kernels import (
    HOST_FORMATS,
    HostKernel,
    PreparedWeights,
    host_kernel_for,
    kernel_detail,
)
from pdflash.hybrid.planner import (
    DEFAULT_MAX_HOST_RATIO,
    DEFAULT_MAX_HOST_TOKENS,
    DEFAULT_PROBE_EVERY,
    HOST_AHEAD_CHOICES,
    HOST_AHEAD_FROM_CHOICES,
    AccountingMissPlanner,
    AheadObservingMissPlanner,
    CostModelPlanner,
    ForcedHostPlanner,
    LinkState,
    MissPlan,
    MissPlanner,
    ObservingMissPlanner,
    ReportingMissPlanner,
    RoutedFraction,
)
from pdflash.hybrid.prepare import (
    HostWeights,
    default_weight_budget,
    host_weights_for,
    release_host_weights,
)
from pdflash.hybrid.service import HostBooks, HostExpertService

HOST_EXPERT_MODES = ("off", "auto")
#: host weight formats build_host_service accepts
HOST_FORMAT_CHOICES = ("auto", *HOST_FORMATS)

__all__ = [
    "DEFAULT_HOST_AFFINITY",
    "DEFAULT_MAX_HOST_RATIO",
    "DEFAULT_MAX_HOST_TOKENS",
    "DEFAULT_PROBE_EVERY",
    "HANDOFF_CHOICES",
    "HOST_AFFINITY_CHOICES",
    "HOST_AHEAD_CHOICES",
    "HOST_AHEAD_FROM_CHOICES",
    "HOST_EXPERT_MODES",
    "HOST_FORMATS",
    "HOST_FORMAT_CHOICES",
    "AccountingMissPlanner",
    "AheadObservingMissPlanner",
    "CostModelPlanner",
    "ForcedHostPlanner",
    "HostBooks",
    "HostCostModel",
    "HostExpertExecutor",
    "HostExpertService",
    "HostHandoffError",
    "HostJob",
    "HostKernel",
    "HostPlacement",
    "HostWeights",
    "LinkState",
    "MissPlan",
    "MissPlanner",
    "ObservingMissPlanner",
    "OnlineHostCost",
    "PreparedWeights",
    "ReportingMissPlanner",
    "RoutedFraction",
    "StreamSignals",
    "build_host_service",
    "calibrate_host",
    "default_host_threads",
    "default_weight_budget",
    "fit_affine",
    "fit_robust",
    "host_kernel_for",
    "host_weights_for",
    "plan_host_threads",
    "plan_placement",
    "rank_cpus",
    "rank_host_share",
    "release_host_weights",
]


def rank_host_share(local_rank: int, ranks_on_host: int) -> dict[str, Any]:
    """:func:`build_host_service` keywords for one of ``ranks_on_host``
    expert-parallel ranks on one host: its share of the cores
    (:func:`~pdflash.hybrid.affinity.rank_cpus`: its threads are planned
    there) and of the memory prepared weights may take (the default budget
    split evenly), so the ranks' services do not each claim the whole host."""
    return {
        "cpus": rank_cpus(local_rank, ranks_on_host),
        "weight_budget_bytes": default_weight_budget() // ranks_on_host,
    }


def plan_host_threads(
    host_affinity: str | HostPlacement, device: torch.device, cpus: Iterable[int] | None = None
) -> tuple[HostPlacement, int]:
    """Where a host service on ``device`` places its threads, and its
    default intra-op thread count (CUDA), within ``cpus`` (default: all of
    this process's): see :func:`build_host_service`."""
    share = None if cpus is None else tuple(sorted({int(c) for c in cpus}))
    if share is not None and not share:
        raise ValueError("cpus is empty: give the service at least one CPU")
    if isinstance(host_affinity, HostPlacement):
        placement = host_affinity
    elif host_affinity == "auto" and device.type != "cuda":
        placement = HostPlacement(
            "auto", reason=f"the model computes on {device.type}: the host is the device"
        )
    else:
        placement = plan_placement(host_affinity, allowed=share)  # raises on an unknown mode
    threads = default_host_threads()[1] if share is None else max(1, len(share) - 2)
    return placement, threads


def build_host_service(
    adapter: Any,
    *,
    link_bytes_per_s: float,
    planner: MissPlanner | None = None,
    workers: int | None = None,
    intra_op_threads: int | None = None,
    margin: float = 0.1,
    max_host_ratio: float = DEFAULT_MAX_HOST_RATIO,
    max_host_tokens: int | None = DEFAULT_MAX_HOST_TOKENS,
    calibrate: bool = True,
    cost: HostCostModel | None = None,
    host_format: str = "auto",
    weight_budget_bytes: int | None = None,
    online: bool = True,
    probe_every: int | None = DEFAULT_PROBE_EVERY,
    critical_path: bool = False,
    host_queued: bool = False,
    host_job_term: bool = False,
    host_affinity: str | HostPlacement = DEFAULT_HOST_AFFINITY,
    handoff: str = "thread",
    host_ahead: str = "certain",
    host_ahead_from: str = "predicted",
    cpus: Iterable[int] | None = None,
) -> HostExpertService:
    """A :class:`HostExpertService` for ``adapter`` (its ``store`` and
    ``expert_forward``), attached to its offloaded runtime.

    The CPU is calibrated here on the adapter's own experts (unless ``cost``
    is given or ``calibrate`` is False, which needs a ``planner``).
    ``intra_op_threads`` defaults to all cores but two on CUDA and to torch's
    current setting on CPU (where the "host" is the device itself); with
    ``cpus`` given, to all of those but two. It is process-wide: the
    service's :meth:`~HostExpertService.close` gives torch back the count it
    had before (as does a build that fails).

    ``host_format`` (:data:`HOST_FORMAT_CHOICES`): how the host holds the
    experts it computes (:mod:`pdflash.hybrid.kernels`); ``auto`` times the
    candidates and keeps the fastest whose prepared copy fits
    ``weight_budget_bytes`` (default: a share of the memory available, see
    :func:`default_weight_budget`). Without calibration (``calibrate=False``)
    ``auto`` means ``packed``: nothing is timed.

    The prepared weights (and ``auto``'s choice) are kept with the store and
    reused by the next service with the same settings
    (:func:`pdflash.hybrid.prepare.host_weights_for`;
    :func:`release_host_weights` frees them); the row's ``host_weights``
    says ``reused``. The calibration runs once the cache's in-flight copies
    have landed, so it times the host with the link idle.

    ``margin``, ``max_host_ratio``, ``max_host_tokens``, ``online`` and
    ``probe_every`` go to the default :class:`CostModelPlanner` (see
    :mod:`pdflash.hybrid.planner` for when HOST pays, why the caps, and how
    it corrects the calibration from the run's own HOST jobs).
    ``critical_path`` sets :attr:`HostExpertService.critical_path` (off by
    default: the planner judges the link's makespan), ``host_queued``
    :attr:`HostExpertService.host_queued` (off by default: queued copies
    stay copies). ``host_job_term`` (off by default: not yet measured on a
    GPU) has the calibration measure a fixed cost per HOST job beside the
    seconds per expert (:func:`calibrate_host`'s ``job_term``; off: seconds
    per expert alone). ``handoff``
    (:data:`~pdflash.hybrid.handoff.HANDOFF_CHOICES`): how HOST outputs
    reach the device stream (:meth:`HostExpertService.set_handoff`;
    ``stream`` falls back to ``thread`` where it cannot run, with the reason
    recorded).

    ``host_ahead`` (:data:`HOST_AHEAD_CHOICES`) goes to the default
    :class:`CostModelPlanner` as its ``ahead`` rule: how the plan made
    before a verify from the route-ahead prediction treats a predicted
    expert (``certain``, the default: as routed; ``weighted``: routed with
    the run's measured probability; see :mod:`pdflash.hybrid.planner`, "The
    ahead plan"). A given ``planner`` keeps its own.

    ``host_ahead_from`` (:data:`HOST_AHEAD_FROM_CHOICES`) sets
    :attr:`HostExpertService.ahead_from`: which copies the ahead plans split
    (``predicted``, the default: the route-ahead prediction only;
    ``stream``: also the streaming prefetcher's own copies, its fetch set
    before the verify and its gate lookahead's next layer during the
    forward; :mod:`pdflash.hybrid.service`, "Splitting the stream's copies").

    ``host_affinity`` (:data:`HOST_AFFINITY_CHOICES`, or a
    :class:`HostPlacement` already planned): ``auto`` places the host pool's
    threads (its workers and the native kernel's team) on one set of cores
    and the engine's (the thread calling this, which runs the forward, and
    the cache's issuer thread) on another, on CUDA only (on a CPU model the
    host is the device itself), and is the default
    (:data:`DEFAULT_HOST_AFFINITY`); ``off`` makes no affinity call.
    The service's :meth:`~HostExpertService.close` gives every thread it
    placed its mask back (see :mod:`pdflash.hybrid.affinity`).

    ``cpus``: the CPUs this service may plan its threads on (default: all
    of this process's). An expert-parallel rank of several on one host
    passes its share (:func:`~pdflash.hybrid.affinity.rank_cpus`), so the
    ranks' pools do not all spin on the same cores.
    """
    if handoff not in HANDOFF_CHOICES:
        raise ValueError(f"handoff must be one of {HANDOFF_CHOICES}, got {handoff!r}")
    if host_ahead not in HOST_AHEAD_CHOICES:
        raise ValueError(f"host_ahead must be one of {HOST_AHEAD_CHOICES}, got {host_ahead!r}")
    if host_ahead_from not in HOST_AHEAD_FROM_CHOICES:
        raise ValueError(
            f"host_ahead_from must be one of {HOST_AHEAD_FROM_CHOICES}, got {host_ahead_from!r}"
        )
    store = adapter.store
    device = torch.device(getattr(adapter, "device", "cpu"))
    placement, auto_threads = plan_host_threads(host_affinity, device, cpus)
    auto_workers, _ = default_host_threads()
    if intra_op_threads is None and device.type == "cuda":
        intra_op_threads = auto_threads
    if intra_op_threads is not None and intra_op_threads < 1:
        raise ValueError(f"intra_op_threads must be >= 1, got {intra_op_threads}")
    pool = workers if workers is not None else auto_workers
    if host_format not in HOST_FORMAT_CHOICES:
        raise ValueError(f"host_format must be one of {HOST_FORMAT_CHOICES}, got {host_format!r}")
    # torch's intra-op thread count is process-wide: set for the service's
    # life and given back by its close(), or below when building it fails
    threads_before = torch.get_num_threads()
    if intra_op_threads is not None:
        torch.set_num_threads(int(intra_op_threads))  # before any format is timed
    executor: HostExpertExecutor | None = None
    placed = PlacedThreads(placement)
    try:
        fmt = "packed" if host_format == "auto" and not calibrate and cost is None else host_format
        t0 = time.perf_counter()
        weights = host_weights_for(adapter, fmt, workers=pool, budget_bytes=weight_budget_bytes)
        weights_s = time.perf_counter() - t0
        calibrate_s: float | None = None
        executor = HostExpertExecutor(
            weights.weights_of,
            weights.kernel.forward,
            dtype=weights.kernel.dtype,
            out_dtype=store.layout.dtype,
            expert_nbytes=store.expert_nbytes,
            workers=pool,
            intra_op_threads=intra_op_threads,
            batch_fn=weights.kernel.forward_many,
            host_cpus=placement.host_cpus if placement.applied else None,
        )
        if placement.applied and isinstance(weights.kernel, ThreadedKernel):
            # placed before the calibration, so it times the host as it will run
            placed.pin_host(weights.kernel.thread_ids())
        if cost is None and calibrate:
            t0 = time.perf_counter()
            _link_idle(adapter)
            cost = calibrate_host(
                executor,
                num_ids=store.num_ids,
                ids=store.packed_ids(),  # a rank's store: only its own experts
                hidden_size=int(adapter.hidden_size),
                device=device,
                host_format=weights.format,
                job_term=host_job_term,
            )
            calibrate_s = time.perf_counter() - t0
        if planner is None:
            if cost is None:
                raise ValueError("no planner given and no cost model to build one from")
            planner = CostModelPlanner(
                cost,
                store.expert_nbytes,
                margin=margin,
                max_host_ratio=max_host_ratio,
                max_host_tokens=max_host_tokens,
                online=online,
                probe_every=probe_every,
                ahead=host_ahead,
            )
        service = HostExpertService(
            executor,
            planner,
            num_experts=int(adapter.num_experts),
            expert_nbytes=store.expert_nbytes,
            link_bytes_per_s=link_bytes_per_s,
            cost=cost,
        )
        service.critical_path = bool(critical_path)
        service.host_queued = bool(host_queued)
        service.host_job_term = bool(host_job_term)
        service.ahead_from = host_ahead_from
        service.set_handoff(handoff, device)
        service.host_weights = weights.describe()
        # what building it cost: getting the weights (format selection and
        # preparation, or a lookup when reused) and the calibration
        service.setup_s = {"host_weights": weights_s}
        if calibrate_s is not None:
            service.setup_s["calibrate"] = calibrate_s
        service.kernel_detail = functools.partial(kernel_detail, weights.kernel)
        service.intra_op_threads_before = threads_before
        placed.pin_engine(_engine_thread_ids(adapter))
        service.placement = placed
    except BaseException:
        if executor is not None:
            executor.close()
        placed.restore()
        torch.set_num_threads(threads_before)
        raise
    runtime = getattr(adapter, "runtime", None)
    if runtime is not None:
        runtime.host_service = service
    return service


def _engine_thread_ids(adapter: Any) -> list[int]:
    """The calling (forward) thread's id and the cache's issuer thread's,
    where it reports one."""
    tids = [threading.get_native_id()]
    issuer = getattr(getattr(adapter, "cache", None), "issuer", None)
    tid = int(getattr(issuer, "worker_tid", 0) or 0)
    if tid > 0:
        tids.append(tid)
    return tids


def _link_idle(adapter: Any) -> None:
    """Wait for the adapter's cache's in-flight copies (the link and the
    issuer's thread idle) before the host is timed."""
    cache = getattr(adapter, "cache", None)
    drain = getattr(cache, "drain_inflight", None)
    if callable(drain):
        drain()
    device = torch.device(getattr(adapter, "device", "cpu"))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
