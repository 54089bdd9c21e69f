"""The host CPU's measured cost of computing one expert, and its calibration.

:func:`calibrate_host` times the :class:`~pdflash.hybrid.executor.HostExpertExecutor`
exactly as a forward uses it (same pool, same threads, the store's packed
host weights of real experts of the model) at a few token counts, and fits
seconds per expert as ``a + b * tokens`` (both terms >= 0), and with
``job_term`` a fixed ``job_s`` per HOST job (one layer's HOST experts).

Why a job term: the planner's probes are one-expert jobs, while the
calibration times batches of several; where a lone expert costs more than
its share of a batch, seconds per expert alone price probes too high and
can keep the host out (bench/results/h100/session34-2026-12-05). With the
term each point also times batches of one expert: per repeat, the slope
between the two sizes is the point's seconds per expert and the rest of
the one-expert batch its job cost; ``job_s`` is the median over the
points. Off by default until a GPU A/B.

(The fit is :func:`fit_robust`, medians, not least squares: one bad point
of four cannot move it.) It also times the fixed per-layer round trip of a HOST batch (hidden states
device -> host, an empty pool job, results host -> device), which the
planner charges once per layer that uses the host.

Different experts are used for each timed batch (rotating through the
store), so a small model's experts are not timed hot in the CPU caches when
a forward would find them cold.

Robustness: one timed batch is a few milliseconds, so a thread team's
spin-up, a kernel's first use of a code path (AMX tile state, per thread)
or a garbage collection inside it would be the measurement. Each point is
therefore warmed with an untimed batch of its own token count first, its
``repeats`` timed batches run with Python's cyclic GC paused (collected
once before), and the point is their median; every point's spread (min,
max over the repeats) is kept in the model (:attr:`HostCostModel.spread`)
so a row shows how much one calibration can be trusted.
:func:`pdflash.hybrid.build_host_service` calibrates after the cache's
in-flight copies have landed (the link idle). What the start-up model
still gets wrong (the host under a busy link, a noisy neighbour) is
corrected during the run by :class:`OnlineHostCost`.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch

if TYPE_CHECKING:
    from pdflash.hybrid.executor import HostExpertExecutor

#: Token counts timed at start-up (a verify block routes 1..B tokens per
#: request to an expert; wide batches reach tens).
DEFAULT_TOKEN_POINTS: tuple[int, ...] = (1, 4, 16, 64)
#: timed batches per point (their median is the point)
DEFAULT_REPEATS = 5
#: with the job term, at least this many experts per calibration batch (its
#: slope is read between one expert and this many)
JOB_BATCH_EXPERTS = 4


@dataclass(frozen=True)
class HostCostModel:
    """Seconds for the host pool to compute one expert over ``n`` tokens:
    ``intercept_s + per_token_s * n`` (measured with the pool full, so it is
    the pool's time per expert, not one thread's latency), plus a fixed
    ``job_s`` of pool time per HOST job (a layer's HOST experts, whatever
    their number; :meth:`job_cost`) and a fixed ``roundtrip_s`` per layer
    that uses the host at all.

    ``points`` are the measured ``(tokens, seconds per expert)`` pairs the
    fit came from (each the median of ``repeats`` timed batches), ``spread``
    the ``(tokens, min, max)`` seconds per expert over those batches,
    ``job_points`` the ``(tokens, job seconds)`` the median ``job_s`` came
    from (empty where it was not measured); ``source`` says
    ``"calibrated"`` or ``"configured"``.
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
    spread: tuple[tuple[int, float, float], ...] = ()
    repeats: int | None = None  # timed batches per point (None: not calibrated)
    job_s: float = 0.0
    job_points: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        for name in ("intercept_s", "per_token_s", "roundtrip_s", "job_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and np.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")

    def expert_s(self, tokens: Any) -> Any:
        """Seconds per expert for ``tokens`` (scalar or array)."""
        return self.intercept_s + self.per_token_s * np.asarray(tokens, dtype=np.float64)

    def job_cost(self, tokens: Sequence[float] | npt.NDArray[np.float64]) -> float:
        """Pool seconds of one HOST job of experts with ``tokens`` rows each:
        ``job_s`` plus their :meth:`expert_s` (0 for no expert)."""
        tok = np.asarray(tokens, dtype=np.float64).reshape(-1)
        if tok.size == 0:
            return 0.0
        return self.job_s + float(np.sum(self.expert_s(tok)))

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["points"] = [list(p) for p in self.points]
        out["spread"] = [list(p) for p in self.spread]
        out["job_points"] = [list(p) for p in self.job_points]
        if not self.job_points and not self.job_s:
            # a term nobody measured or set is absent, not a measured 0
            del out["job_s"]
            out["job_s_absent"] = "no job term: calibrated or configured without one"
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


def fit_robust(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Theil-Sen ``(a, b)`` of ``y = a + b x`` with ``a, b >= 0``: ``b`` the
    median of the pairwise slopes, ``a`` the median of ``y - b x``.

    The calibration's few points are each a median of a few batches, and a
    point can still be off by several times (a batch that met a neighbour's
    burst): least squares lets that one point move the intercept, which the
    planner charges every expert, while the medians ignore one bad point of
    four. With one distinct x the slope is 0 and ``a`` is the median; a
    negative median slope is 0; a negative intercept is refitted through
    the origin (``b`` the median of ``y / x``).
    """
    if not points:
        raise ValueError("no calibration points")
    x = np.asarray([p[0] for p in points], dtype=np.float64)
    y = np.asarray([p[1] for p in points], dtype=np.float64)
    i, j = np.triu_indices(x.size, k=1)
    keep = x[i] != x[j]
    if not keep.any():
        return max(0.0, float(np.median(y))), 0.0
    b = max(0.0, float(np.median((y[j] - y[i])[keep] / (x[j] - x[i])[keep])))
    a = float(np.median(y - b * x))
    if a < 0:
        pos = x > 0
        return 0.0, max(0.0, float(np.median(y[pos] / x[pos]))) if pos.any() else 0.0
    return a, b


def _time_batch(
    executor: HostExpertExecutor,
    ids: npt.NDArray[np.int64],
    tokens: int,
    hidden: int,
    dtype: torch.dtype,
    gen: torch.Generator,
) -> float:
    """Seconds the pool computed one batch: from its first worker's start
    to its last one's end (the hand-off to the pool is the round trip's)."""
    x = torch.randn(int(ids.size) * tokens, hidden, generator=gen).to(dtype)
    counts = [tokens] * int(ids.size)
    job = executor.submit(ids, x, counts, device="cpu")
    job.result()
    return max(b for _, b in job.intervals) - min(a for a, _ in job.intervals)


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Collect now, then keep Python's cyclic GC out of the timed batches."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def calibrate_host(
    executor: HostExpertExecutor,
    *,
    num_ids: int,
    hidden_size: int,
    device: torch.device | str = "cpu",
    token_points: Sequence[int] = DEFAULT_TOKEN_POINTS,
    experts_per_batch: int | None = None,
    repeats: int = DEFAULT_REPEATS,
    seed: int = 0,
    roundtrip: bool = True,
    host_format: str = "packed",
    ids: npt.ArrayLike | None = None,
    job_term: bool = False,
) -> HostCostModel:
    """Measure the executor on real experts (flat ids ``0..num_ids-1`` of the
    store it reads, or ``ids``: e.g. the experts an expert-parallel rank's
    store packed) and fit :class:`HostCostModel`.

    Each point times ``repeats`` batches of ``experts_per_batch`` experts
    (default: 2 per pool worker, so every worker is busy, and with
    ``job_term`` at least :data:`JOB_BATCH_EXPERTS`) of ``n`` tokens each,
    after an untimed warm-up batch of the same token count (module doc); a
    batch's time is its compute span (first worker's start to last
    worker's end: what :meth:`OnlineHostCost.observe` is given in the run
    too). Seconds per expert is a batch's time over its experts, the point
    the median over the repeats, and ``job_s`` is 0. With ``job_term`` (and
    batches of two or more experts) each repeat also times a batch of one
    expert: its seconds per expert is then the slope between the two sizes
    and the one-expert batch's remainder its job cost (the point's job cost
    the median over the repeats, ``job_s`` the median over the points).
    ``roundtrip=False`` skips timing the per-layer round trip
    (``roundtrip_s`` is then 0).
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
    # without the job term, two per worker
    least = JOB_BATCH_EXPERTS if job_term else 1
    per_batch = experts_per_batch or max(least, 2 * executor.workers)
    per_batch = max(1, min(per_batch, pool.size))
    with_job = job_term and per_batch >= 2
    gen = torch.Generator().manual_seed(seed)
    dtype = executor.dtype
    cursor = 0

    def next_ids(size: int) -> npt.NDArray[np.int64]:
        nonlocal cursor
        batch = pool[(np.arange(size, dtype=np.int64) + cursor) % pool.size]
        cursor = (cursor + size) % pool.size
        return batch

    points: list[tuple[int, float]] = []
    spread: list[tuple[int, float, float]] = []
    job_points: list[tuple[int, float]] = []
    with _gc_paused():
        for n in points_in:
            # untimed: the team's spin-up, this row count's code path
            _time_batch(executor, next_ids(per_batch), n, hidden_size, dtype, gen)
            big: list[float] = []
            one: list[float] = []
            for _ in range(repeats):
                # interleaved, so a drift of the host reaches both sizes alike
                big.append(_time_batch(executor, next_ids(per_batch), n, hidden_size, dtype, gen))
                if with_job:
                    one.append(_time_batch(executor, next_ids(1), n, hidden_size, dtype, gen))
            # per repeat: seconds per expert, and the job's remainder
            per_expert = [b / per_batch for b in big]
            if with_job:
                for i, (b, o) in enumerate(zip(big, one, strict=True)):
                    slope = (b - o) / (per_batch - 1)
                    # a slope at or above the mean (one expert no dearer than
                    # its share) or below zero is noise: no job term there
                    if 0.0 < slope < per_expert[i]:
                        per_expert[i] = slope
                jobs = [max(0.0, o - e) for o, e in zip(one, per_expert, strict=True)]
                job_points.append((n, float(statistics.median(jobs))))
            points.append((n, float(statistics.median(per_expert))))
            spread.append((n, min(per_expert), max(per_expert)))
    a, b = fit_robust(points)
    job_s = float(statistics.median(p[1] for p in job_points)) if job_points else 0.0
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
        job_s=job_s,
        job_points=tuple(job_points),
        source="calibrated",
        calibration_s=time.perf_counter() - started,
        host_format=host_format,
        spread=tuple(spread),
        repeats=repeats,
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


#: upper bounds of the token buckets :class:`OnlineHostCost` corrects apart
#: (tokens per expert; the last bucket is everything above the last bound)
ONLINE_BUCKETS: tuple[int, ...] = (1, 4, 16)


@dataclass
class OnlineHostCost:
    """The start-up :class:`HostCostModel` corrected by the run's own HOST
    jobs: the planner's host cost, self-correcting.

    Every finished HOST job (a layer's HOST experts) gives ``ratio =
    measured seconds / modeled seconds``: its compute span (first worker's
    start to last worker's end, as the calibration timed its batches) over
    the calibration's :meth:`HostCostModel.job_cost` of the job (its job
    term and its experts' seconds each: the pool's time). A probe's lone
    expert is priced with the job term too (where the calibration measured
    one), so a host whose jobs cost a fixed amount each does not read as a
    slow host from its probes. Ratios are kept per token bucket
    (:data:`ONLINE_BUCKETS`, by the job's mean tokens per expert), each clamped to
    ``[1 / max_ratio, max_ratio]``, the last ``window`` of them; a bucket's
    correction is the median of its ratios together with ``prior`` ratios of
    1 (the calibration's own vote), and a bucket with no ratio yet uses all
    buckets' ratios. A median moves only when most recent jobs agree: one
    outlier (a job that met a page fault or a GC) cannot flip the plans,
    while ``prior + 1`` agreeing jobs move the correction all the way
    (``prior=2``: the third job). ``expert_s`` is the calibration's time
    times the correction, so the planner's eligibility caps and its
    makespan use the measured host.

    A too-pessimistic calibration sends nothing to the host, and so would
    never be corrected: the planner probes (see
    :class:`pdflash.hybrid.planner.CostModelPlanner`'s ``probe_every``).
    """

    base: HostCostModel
    window: int = 16
    prior: int = 2
    max_ratio: float = 8.0
    observations: int = 0
    _ratios: dict[int, deque[float]] = field(default_factory=dict, repr=False)
    #: (experts, tokens, seconds) of the recent runs, for the refit in to_json
    _recent: deque[tuple[int, int, float]] = field(
        default_factory=lambda: deque(maxlen=256), repr=False
    )
    _scales: npt.NDArray[np.float64] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.window < 1 or self.prior < 0:
            raise ValueError(f"need window >= 1 and prior >= 0, got {self.window}, {self.prior}")
        if not self.max_ratio > 1.0:
            raise ValueError(f"max_ratio must be > 1, got {self.max_ratio}")

    # -- the model ---------------------------------------------------------------

    @property
    def roundtrip_s(self) -> float:
        return self.base.roundtrip_s

    @property
    def job_s(self) -> float:
        """The calibration's job term times the correction of every bucket's
        ratios together (the term does not depend on the tokens)."""
        if not self.base.job_s:
            return 0.0
        return self.base.job_s * self._median([r for q in self._ratios.values() for r in q])

    @staticmethod
    def bucket(tokens: float) -> int:
        """Index of the token bucket ``tokens`` per expert falls in."""
        for i, hi in enumerate(ONLINE_BUCKETS):
            if tokens <= hi:
                return i
        return len(ONLINE_BUCKETS)

    def _median(self, ratios: Sequence[float]) -> float:
        return float(statistics.median([1.0] * self.prior + list(ratios))) if ratios else 1.0

    def correction(self, tokens: float) -> float:
        """Measured over modeled host time for experts of ``tokens`` tokens."""
        own = self._ratios.get(self.bucket(tokens))
        if own:
            return self._median(own)
        pooled = [r for q in self._ratios.values() for r in q]
        return self._median(pooled)

    def expert_s(self, tokens: Any) -> Any:
        """Seconds per expert for ``tokens`` (scalar or array), corrected."""
        tok = np.asarray(tokens, dtype=np.float64)
        base = self.base.expert_s(tok)
        if not self._ratios:
            return base
        if self._scales is None:  # one correction per bucket, until the next job
            self._scales = np.asarray(
                [self.correction(hi) for hi in ONLINE_BUCKETS]
                + [self.correction(ONLINE_BUCKETS[-1] + 1)],
                dtype=np.float64,
            )
        return base * self._scales[np.searchsorted(ONLINE_BUCKETS, tok, side="left")]

    # -- measurements --------------------------------------------------------------

    def observe(self, tokens: Sequence[int], seconds: float) -> None:
        """A job of experts with ``tokens`` rows each took ``seconds``."""
        tok = np.asarray(tokens, dtype=np.float64).reshape(-1)
        if tok.size == 0 or not (math.isfinite(seconds) and seconds > 0):
            return
        modeled = self.base.job_cost(tok)
        if modeled <= 0:
            return
        ratio = min(self.max_ratio, max(1.0 / self.max_ratio, seconds / modeled))
        q = self._ratios.setdefault(self.bucket(float(tok.mean())), deque(maxlen=self.window))
        q.append(ratio)
        self._recent.append((int(tok.size), int(tok.sum()), float(seconds)))
        self.observations += 1
        self._scales = None

    def to_json(self) -> dict[str, Any]:
        """The measured model: per bucket its ratios' count and correction,
        and intercept / per-token refitted from the runs' mean seconds per
        expert (absent with a reason while too few runs differ in tokens)."""
        buckets = {}
        bounds = [*ONLINE_BUCKETS, None]
        for i, hi in enumerate(bounds):
            q = self._ratios.get(i)
            lo = 1 if i == 0 else ONLINE_BUCKETS[i - 1] + 1
            label = f"{lo}-{hi}" if hi is not None else f">{ONLINE_BUCKETS[-1]}"
            buckets[label] = {
                "runs": len(q) if q else 0,
                "correction": self._median(q) if q else None,
            }
        pts = [(t / e, s / e) for e, t, s in self._recent]
        refit: dict[str, Any]
        if len({round(p[0], 3) for p in pts}) >= 2:
            a, b = fit_robust(pts)
            refit = {"intercept_s": a, "per_token_s": b, "runs": len(pts)}
        else:
            refit = {"absent": f"{len(pts)} runs, fewer than 2 distinct token counts"}
        return {
            "observations": self.observations,
            "window": self.window,
            "prior": self.prior,
            "max_ratio": self.max_ratio,
            "buckets": buckets,
            "measured_fit": refit,
        }
