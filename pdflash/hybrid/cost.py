"""The host CPU's measured cost of computing one expert, and its calibration.

:func:`calibrate_host` times the :class:`~pdflash.hybrid.executor.HostExpertExecutor`
exactly as a forward uses it (same pool, same threads, the store's packed
host weights of real experts of the model) at a few token counts, and fits
seconds per expert as ``a + b * tokens`` (least squares, both terms >= 0).
It also times the fixed per-layer round trip of a HOST batch (hidden states
device -> host, an empty pool job, results host -> device), which the
planner charges once per layer that uses the host.

Different experts are used for each timed batch (rotating through the
store), so a small model's experts are not timed hot in the CPU caches when
a forward would find them cold.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch

if TYPE_CHECKING:
    from pdflash.hybrid.executor import HostExpertExecutor

#: Token counts timed at start-up (a verify block routes 1..B tokens per
#: request to an expert; wide batches reach tens).
DEFAULT_TOKEN_POINTS: tuple[int, ...] = (1, 4, 16, 64)


@dataclass(frozen=True)
class HostCostModel:
    """Seconds for the host pool to compute one expert over ``n`` tokens:
    ``intercept_s + per_token_s * n`` (measured with the pool full, so it is
    the pool's time per expert, not one thread's latency), plus a fixed
    ``roundtrip_s`` per layer that uses the host at all.

    ``points`` are the measured ``(tokens, seconds per expert)`` pairs the
    fit came from; ``source`` says ``"calibrated"`` or ``"configured"``.
    """

    intercept_s: float
    per_token_s: float
    roundtrip_s: float = 0.0
    workers: int = 1
    intra_op_threads: int = 1
    dtype: str = ""
    expert_nbytes: int = 0
    points: tuple[tuple[int, float], ...] = ()
    source: str = "configured"
    calibration_s: float | None = None  # wall time the calibration took
    #: the host weight format timed (pdflash.hybrid.kernels.HOST_FORMATS)
    host_format: str = "packed"

    def __post_init__(self) -> None:
        for name in ("intercept_s", "per_token_s", "roundtrip_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and np.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")

    def expert_s(self, tokens: Any) -> Any:
        """Seconds per expert for ``tokens`` (scalar or array)."""
        return self.intercept_s + self.per_token_s * np.asarray(tokens, dtype=np.float64)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["points"] = [list(p) for p in self.points]
        return out


def fit_affine(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``(a, b)`` of ``y = a + b x`` with ``a, b >= 0``.

    With one distinct x the slope is 0 and ``a`` is the mean. A negative
    least-squares term is clamped to 0 and the other refitted.
    """
    if not points:
        raise ValueError("no calibration points")
    x = np.asarray([p[0] for p in points], dtype=np.float64)
    y = np.asarray([p[1] for p in points], dtype=np.float64)
    if np.unique(x).size < 2:
        return max(0.0, float(y.mean())), 0.0
    b, a = np.polyfit(x, y, 1)
    if b < 0:
        return max(0.0, float(y.mean())), 0.0
    if a < 0:
        # through the origin: b = sum(xy) / sum(xx)
        return 0.0, max(0.0, float((x * y).sum() / (x * x).sum()))
    return float(a), float(b)


def _time_batch(
    executor: HostExpertExecutor,
    ids: npt.NDArray[np.int64],
    tokens: int,
    hidden: int,
    dtype: torch.dtype,
    gen: torch.Generator,
) -> float:
    x = torch.randn(int(ids.size) * tokens, hidden, generator=gen).to(dtype)
    counts = [tokens] * int(ids.size)
    t0 = time.perf_counter()
    executor.compute(ids, x, counts)
    return time.perf_counter() - t0


def calibrate_host(
    executor: HostExpertExecutor,
    *,
    num_ids: int,
    hidden_size: int,
    device: torch.device | str = "cpu",
    token_points: Sequence[int] = DEFAULT_TOKEN_POINTS,
    experts_per_batch: int | None = None,
    repeats: int = 3,
    seed: int = 0,
    roundtrip: bool = True,
    host_format: str = "packed",
    ids: npt.ArrayLike | None = None,
) -> HostCostModel:
    """Measure the executor on real experts (flat ids ``0..num_ids-1`` of the
    store it reads, or ``ids``: e.g. the experts an expert-parallel rank's
    store packed) and fit :class:`HostCostModel`.

    Each point times ``experts_per_batch`` experts (default: 2 per pool
    worker, so every worker is busy) of ``n`` tokens each; seconds per expert
    is the batch's wall time over its experts, the median of ``repeats``
    batches after one warm-up batch. ``roundtrip=False`` skips timing the
    per-layer round trip (``roundtrip_s`` is then 0).
    """
    pool = (
        np.arange(num_ids, dtype=np.int64)
        if ids is None
        else np.asarray(ids, dtype=np.int64).reshape(-1)
    )
    if ids is not None and (pool.size == 0 or pool.min() < 0 or pool.max() >= num_ids):
        raise ValueError(f"ids must be a non-empty set of flat ids in [0, {num_ids})")
    if num_ids < 1 or hidden_size < 1:
        raise ValueError(f"need num_ids >= 1 and hidden_size >= 1, got {num_ids}, {hidden_size}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    points_in = sorted({int(n) for n in token_points})
    if not points_in or points_in[0] < 1:
        raise ValueError(f"token_points must be positive, got {list(token_points)}")
    started = time.perf_counter()
    per_batch = experts_per_batch or 2 * executor.workers
    per_batch = max(1, min(per_batch, pool.size))
    gen = torch.Generator().manual_seed(seed)
    dtype = executor.dtype
    cursor = 0

    def next_ids() -> npt.NDArray[np.int64]:
        nonlocal cursor
        batch = pool[(np.arange(per_batch, dtype=np.int64) + cursor) % pool.size]
        cursor = (cursor + per_batch) % pool.size
        return batch

    _time_batch(executor, next_ids(), points_in[0], hidden_size, dtype, gen)  # warm-up
    points: list[tuple[int, float]] = []
    for n in points_in:
        times = [
            _time_batch(executor, next_ids(), n, hidden_size, dtype, gen) / per_batch
            for _ in range(repeats)
        ]
        points.append((n, float(statistics.median(times))))
    a, b = fit_affine(points)
    roundtrip_s = (
        measure_roundtrip(executor, hidden_size, device, repeats=max(3, repeats))
        if roundtrip
        else 0.0
    )
    return HostCostModel(
        intercept_s=a,
        per_token_s=b,
        roundtrip_s=roundtrip_s,
        workers=executor.workers,
        intra_op_threads=executor.intra_op_threads,
        dtype=str(dtype).removeprefix("torch."),
        expert_nbytes=executor.expert_nbytes,
        points=tuple(points),
        source="calibrated",
        calibration_s=time.perf_counter() - started,
        host_format=host_format,
    )


def measure_roundtrip(
    executor: HostExpertExecutor,
    hidden_size: int,
    device: torch.device | str,
    *,
    rows: int = 16,
    repeats: int = 5,
) -> float:
    """Median seconds of one HOST round trip with no expert work: ``rows``
    hidden states device -> host, an empty job through the pool, the result
    host -> device, synchronised (0 work on the CPU device)."""
    dev = torch.device(device)
    x = torch.zeros(rows, hidden_size, dtype=executor.dtype, device=dev)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        job = executor.submit(np.zeros(0, dtype=np.int64), x, [], device=dev)
        job.result()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
    return float(statistics.median(times[1:]))
