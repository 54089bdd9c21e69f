"""Computing experts on the host CPU from their packed host weights.

:class:`HostExpertExecutor` runs the adapter's own expert function (the same
``expert_fn(x, weights)`` the device path calls on a cache slot's views) on
views of the store's host buffer (``ExpertStore.views``), in a small thread
pool: an expert's output is the same function whichever side computes it.

One HOST batch (:meth:`HostExpertExecutor.submit`) is the rows of a layer's
HOST experts, sorted by expert:

1. the rows go device -> host into pinned memory in the model's dtype
   (``non_blocking``; an event marks their arrival; a worker converts them
   to the weights' dtype);
2. pool workers wait for that event, compute their share of the experts
   (experts split into contiguous runs of about equal token counts, one run
   per worker) and write into one pinned output buffer. With a ``batch_fn``
   (a host kernel's ``forward_many``) a worker computes its whole run in
   one call that writes straight into that buffer (for the prepared
   formats one TorchScript loop, which holds no GIL: see
   :mod:`pdflash.hybrid.kernels`); without one it calls ``expert_fn`` per
   expert and copies each result in;
3. :meth:`HostJob.result` waits for the workers on the host, then copies the
   output host -> device with a plain ``non_blocking`` copy on the caller's
   (compute) stream, so the add that consumes it is ordered after it with
   no further sync. Why not the issuer's ON_DEMAND band: the result is small
   (tokens x hidden), the issuer keeps only a window of at most a few
   chunks on the copy engine, so this copy waits at most that window (the
   same bound an ON_DEMAND copy has), and a stream-ordered copy needs no
   ticket, key or stream_wait.

Threads: torch's intra-op thread count is process-wide (setting it in a
worker thread changes it for every thread), so ``intra_op_threads`` is set
once with ``torch.set_num_threads`` when given (and the previous count given
back by :meth:`HostExpertExecutor.close`) and recorded either way.
But OpenMP's own thread count is per thread: a new thread starts with the
default (every core) and torch applies its setting to that thread only the
first time the thread itself enters one of torch's parallel loops; a oneDNN
GEMM called before that (or only GEMMs and small ops, which never enter
one) runs with a team of every core, oversubscribing the cores the
engine's and the issuer's threads use, and its barriers spin and yield.
So each pool worker applies the executor's thread count to itself when it
starts (:func:`_init_worker`; through ``torch.set_num_threads``, the one
API for it, which also re-sets torch's process-wide count to the value the
executor recorded at construction).

Placement: given ``host_cpus`` (:mod:`pdflash.hybrid.affinity`), each pool
worker places itself on those CPUs when it starts, before its first torch
call, so the OpenMP team it makes later starts there too (a new thread
inherits its creator's mask). :attr:`HostExpertExecutor.thread_ids` lists
the workers' kernel thread ids.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

ExpertFn = Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]
WeightsOf = Callable[[int], dict[str, torch.Tensor]]
#: ``(x, [weights per expert], row bounds, out)``: every expert's rows into ``out``
BatchFn = Callable[
    [torch.Tensor, Sequence[dict[str, torch.Tensor]], Sequence[int], torch.Tensor], None
]


def default_host_threads() -> tuple[int, int]:
    """``(workers, intra_op_threads)`` for this machine: one worker using all
    cores but two (one for the engine's Python thread, one for the H2D
    issuer's thread), at least one."""
    cores = os.cpu_count() or 1
    return 1, max(1, cores - 2)


class HostJob:
    """A submitted HOST batch; :meth:`result` gives its output on the device."""

    def __init__(
        self,
        futures: list[Future[tuple[float, float]]],
        out: torch.Tensor,
        device: torch.device,
        rows: int,
        run_tokens: list[list[int]] | None = None,
    ) -> None:
        self._futures = futures
        self._out = out
        self.device = device
        self.rows = rows
        #: tokens of each expert of each worker's run (aligned with intervals)
        self.run_tokens: list[list[int]] = run_tokens if run_tokens is not None else []
        #: (start, end) perf_counter seconds of each worker's compute
        self.intervals: list[tuple[float, float]] = []
        self.wait_s = 0.0  # time the caller blocked in result()
        #: perf_counter seconds the caller had it submitted (None: not noted)
        self.started_at: float | None = None
        #: the planner's modeled pool seconds for it (None: not modeled)
        self.modeled_s: float | None = None

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def on_done(self, callback: Callable[[bool], None]) -> None:
        """Call ``callback(failed)`` once, in the thread that completes the
        job's last future (this one if it is already done), after every
        worker wrote its share of the output; ``failed``: a worker raised or
        was cancelled. The ``stream`` hand-off stores the job's flag here."""
        completion = _Completion(len(self._futures), callback)
        for f in self._futures:
            f.add_done_callback(completion.one_done)

    def wait(self) -> None:
        """Block until every worker is done (raises nothing: see :meth:`collect`)."""
        for f in self._futures:
            with contextlib.suppress(Exception):
                f.exception()

    def collect(self) -> None:
        """Take the workers' intervals from a finished job without blocking
        (the ``stream`` hand-off's books); raises the first worker's error."""
        if not self.done():
            raise RuntimeError("the job is still running")
        self.intervals = [f.result() for f in self._futures]

    def output(self) -> torch.Tensor:
        """The output on the job's device WITHOUT waiting for the host: a
        ``non_blocking`` copy from the pinned buffer on the current stream,
        correct only behind a device wait for the job (the ``stream``
        hand-off, :class:`pdflash.hybrid.handoff.StreamSignals`). On the
        CPU (no stream to order it behind) the output buffer itself, valid
        once the job is done."""
        if self.device.type == "cpu":
            return self._out
        return self._out.to(self.device, non_blocking=True)

    def result(self) -> torch.Tensor:
        """Block until the CPU finished; the ``[rows, hidden]`` output on the
        job's device (a ``non_blocking`` copy on the current stream)."""
        t0 = time.perf_counter()
        try:
            self.intervals = [f.result() for f in self._futures]
        finally:
            self.wait_s = time.perf_counter() - t0
        if self.device.type == "cpu":
            return self._out
        return self._out.to(self.device, non_blocking=True)

    def cancel(self) -> None:
        """Drop the job (after a failure elsewhere): cancel what has not
        started and wait for what has, so no worker writes into freed memory."""
        for f in self._futures:
            f.cancel()
        for f in self._futures:
            if not f.cancelled():
                # the caller is already failing: only wait, keep its error
                with contextlib.suppress(Exception):
                    f.result()


class HostExpertExecutor:
    """Computes experts on the CPU from the store's packed host weights.

    Args:
        weights_of: flat expert id -> that expert's weight views on the host
            (``ExpertStore.views``).
        expert_fn: the adapter's ``expert_forward`` (``(x [n, H], weights) ->
            [n, H]``).
        dtype: the dtype hidden states are computed in (the weights' own:
            the packed dtype, or a prepared format's, see
            :mod:`pdflash.hybrid.kernels`).
        out_dtype: the outputs' dtype (default ``dtype``; the model's dtype
            when a prepared format computes in float32).
        expert_nbytes: bytes of one packed expert (recorded with the cost).
        workers: pool threads computing experts at once.
        intra_op_threads: torch intra-op threads (process-wide; None leaves
            torch's setting and records it).
        batch_fn: computes a run of experts in one call (a host kernel's
            ``forward_many``: the same function as ``expert_fn`` per
            expert); None: ``expert_fn`` per expert.
        host_cpus: the CPUs each pool worker places itself on when it
            starts (Linux; None: no affinity call).
    """

    def __init__(
        self,
        weights_of: WeightsOf,
        expert_fn: ExpertFn,
        *,
        dtype: torch.dtype,
        out_dtype: torch.dtype | None = None,
        expert_nbytes: int = 0,
        workers: int | None = None,
        intra_op_threads: int | None = None,
        batch_fn: BatchFn | None = None,
        host_cpus: Sequence[int] | None = None,
    ) -> None:
        auto_workers, _ = default_host_threads()
        workers = auto_workers if workers is None else int(workers)
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        cpus: tuple[int, ...] | None = None
        if host_cpus is not None:
            cpus = tuple(sorted({int(c) for c in host_cpus}))
            if not cpus or cpus[0] < 0:
                raise ValueError(f"host_cpus must be CPU numbers >= 0, got {list(host_cpus)}")
            if not hasattr(os, "sched_setaffinity"):
                raise ValueError("host_cpus given but this OS has no sched_setaffinity")
        #: torch's count before this executor set its own: given back by close()
        self._threads_before: int | None = None
        if intra_op_threads is not None:
            if intra_op_threads < 1:
                raise ValueError(f"intra_op_threads must be >= 1, got {intra_op_threads}")
            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(int(intra_op_threads))
        self.weights_of = weights_of
        self.expert_fn = expert_fn
        self.batch_fn = batch_fn
        self.dtype = dtype
        self.out_dtype = dtype if out_dtype is None else out_dtype
        self.expert_nbytes = int(expert_nbytes)
        self.workers = workers
        self.intra_op_threads = int(torch.get_num_threads())
        self.host_cpus = cpus
        #: the pool workers' kernel thread ids (each adds its own on start)
        self.thread_ids: list[int] = []
        self._pool = ThreadPoolExecutor(
            max_workers=workers,
            thread_name_prefix="pdflash-host",
            initializer=_init_worker,
            initargs=(self.intra_op_threads, cpus, self.thread_ids),
        )
        self._lock = threading.Lock()
        self.closed = False

    # -- the work of one worker ------------------------------------------------

    def _run(
        self,
        ids: Sequence[int],
        x: torch.Tensor,
        bounds: Sequence[int],
        out: torch.Tensor,
        ready: Callable[[], None] | None,
    ) -> tuple[float, float]:
        if ready is not None:
            ready()
        t0 = time.perf_counter()
        # the rows crossed in the model's dtype: converted here, off the
        # forward thread (exact either side: a widening or the same rounding);
        # no call when they match (each torch call hands the GIL back and forth)
        if x.dtype != self.dtype:
            x = x.to(self.dtype)
        # NOTE: grad and inference modes are per thread; the forward that
        # submitted this may run under inference_mode (its tensors are then
        # inference tensors, writable only in inference mode)
        with torch.inference_mode():
            if self.batch_fn is not None:
                self.batch_fn(x, [self.weights_of(int(g)) for g in ids], bounds, out)
            else:
                for j, g in enumerate(ids):
                    lo, hi = bounds[j], bounds[j + 1]
                    out[lo:hi] = self.expert_fn(x[lo:hi], self.weights_of(int(g)))
        return t0, time.perf_counter()

    @staticmethod
    def _runs(counts: Sequence[int], parts: int) -> list[tuple[int, int]]:
        """Split experts ``0..n`` into at most ``parts`` contiguous runs of
        about equal rows."""
        n = len(counts)
        if n == 0:
            return []
        parts = max(1, min(parts, n))
        cum = np.concatenate([[0], np.cumsum(np.asarray(counts, dtype=np.int64))])
        total = int(cum[-1])
        cuts = [0]
        for p in range(1, parts):
            j = int(np.searchsorted(cum, total * p / parts, side="left"))
            cuts.append(min(max(j, cuts[-1] + 1), n - (parts - p)))
        cuts.append(n)
        return [(a, b) for a, b in itertools.pairwise(cuts) if b > a]

    def _launch(
        self,
        ids: npt.NDArray[np.int64],
        x: torch.Tensor,
        counts: Sequence[int],
        out: torch.Tensor,
        ready: Callable[[], None] | None,
    ) -> tuple[list[Future[tuple[float, float]]], list[list[int]]]:
        """The futures of the workers' runs and each run's tokens per expert."""
        if self.closed:
            raise RuntimeError("HostExpertExecutor is closed")
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        cnt = [int(c) for c in counts]
        if len(cnt) != ids.size:
            raise ValueError(f"{ids.size} experts but {len(cnt)} token counts")
        if any(c < 1 for c in cnt):
            raise ValueError("every expert needs >= 1 token")
        if sum(cnt) != x.shape[0]:
            raise ValueError(f"token counts sum to {sum(cnt)} but x has {x.shape[0]} rows")
        bounds = [0, *itertools.accumulate(cnt)]
        if cnt and (self.workers == 1 or len(cnt) == 1):  # one run: no split, no slices
            fut = self._pool.submit(self._run, ids.tolist(), x, bounds, out, ready)
            return [fut], [cnt]
        futures = []
        run_tokens = []
        for a, b in self._runs(cnt, self.workers):
            rel = [v - bounds[a] for v in bounds[a : b + 1]]
            run_tokens.append(cnt[a:b])
            futures.append(
                self._pool.submit(
                    self._run,
                    ids[a:b].tolist(),
                    x[bounds[a] : bounds[b]],
                    rel,
                    out[bounds[a] : bounds[b]],
                    ready,
                )
            )
        return futures, run_tokens

    # -- entry points ------------------------------------------------------------

    def compute(
        self, ids: npt.NDArray[np.int64], x: torch.Tensor, counts: Sequence[int]
    ) -> torch.Tensor:
        """Synchronous: ``x`` (host, rows sorted by expert) -> outputs (host)."""
        if x.device.type != "cpu":
            raise ValueError(f"compute() takes host rows, got a {x.device} tensor")
        x = x.to(self.dtype)
        out = torch.empty(x.shape, dtype=self.out_dtype)
        for f in self._launch(ids, x, counts, out, None)[0]:
            f.result()
        return out

    def to_host(self, x: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None] | None]:
        """``x`` (device rows) -> (host copy in ``x``'s dtype, a callable that
        blocks until it has arrived; None when it already has). The workers
        convert to :attr:`dtype` (no device kernel on the forward's stream)."""
        if x.device.type == "cpu":
            return x.contiguous(), None
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        host.copy_(x, non_blocking=True)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(x.device))
        return host, event.synchronize

    def submit(
        self,
        ids: npt.NDArray[np.int64],
        x: torch.Tensor,
        counts: Sequence[int],
        *,
        device: torch.device | str | None = None,
    ) -> HostJob:
        """Start a HOST batch: ``x`` (rows sorted by expert, on any device) is
        copied to the host without a sync and computed in the pool; the
        caller goes on and calls :meth:`HostJob.result` when it needs the
        output (on ``device``, default ``x``'s)."""
        dev = torch.device(device) if device is not None else x.device
        host, ready = self.to_host(x)
        pin = dev.type == "cuda"
        out = torch.empty(host.shape, dtype=self.out_dtype, pin_memory=pin)
        if np.asarray(ids).size == 0:
            # nothing to compute (a round-trip probe): the workers still see the job
            fut: Future[tuple[float, float]] = self._pool.submit(_wait_only, ready)
            return HostJob([fut], out, dev, int(host.shape[0]))
        futures, run_tokens = self._launch(ids, host, counts, out, ready)
        return HostJob(futures, out, dev, int(host.shape[0]), run_tokens)

    def close(self) -> None:
        """Stop the pool (waits for running jobs) and give torch back the
        intra-op thread count it had before this executor set one; idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)

    def __enter__(self) -> HostExpertExecutor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _Completion:
    """Calls ``callback(failed)`` once every one of ``count`` futures is done."""

    def __init__(self, count: int, callback: Callable[[bool], None]) -> None:
        self._left = count
        self._failed = False
        self._callback = callback
        self._lock = threading.Lock()

    def one_done(self, future: Future[tuple[float, float]]) -> None:
        failed = future.cancelled() or future.exception() is not None
        with self._lock:
            self._failed = self._failed or failed
            self._left -= 1
            last = self._left == 0
        if last:
            self._callback(self._failed)


def _init_worker(threads: int, cpus: tuple[int, ...] | None, thread_ids: list[int]) -> None:
    """Place this pool thread on ``cpus`` (if given), then give its OpenMP
    team ``threads`` threads (module doc); note its id in ``thread_ids``."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)  # 0: this thread (Linux masks are per thread)
    thread_ids.append(threading.get_native_id())
    torch.set_num_threads(threads)


def _wait_only(ready: Callable[[], None] | None) -> tuple[float, float]:
    if ready is not None:
        ready()
    t = time.perf_counter()
    return t, t
