"""Where a run's step time goes (``bench/h200/default_ab.py --profile``):
the host seconds of each engine stage per engine step and, on CUDA, the
synchronizing CUDA calls each stage makes (``torch.cuda.set_sync_debug_mode``
warnings, counted by the innermost stage they fell in).

The arm runs once to warm up, then once with the stages wrapped (a
diagnostic: the wrappers add a few microseconds a stage), counting only the
steps on the run's clock (from ``Engine.reset_stats``: a run's warm-up and
PD's verify calibration run whole steps before it, larger ones for the
calibration, which per-step figures over every step would charge to PD's
own steps). Beside the
stages, the profiled run counts what no stage shows: Python's garbage
collections and their pauses, and on CUDA the caching allocator's device
allocations and frees (``cudaMalloc``/``cudaFree``, each synchronizing).
One run does not rank arms where the host's speed drifts between runs
(``bench/results/h100/session43-2026-12-06/``):
``default_ab.py --profile --profile-repeats N`` profiles every arm ``N``
times, interleaved, and :func:`median_profile` gives the medians.
"""

from __future__ import annotations

import collections
import gc
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from pdflash.bench.engine_run import RunSpec, run_spec

from pdflash.cache.expert_cache import ExpertCache
from pdflash.engine import engine as engine_module
from pdflash.engine import pd_controller, verify_width
from pdflash.engine.fixed_step import FixedStepFeed
from pdflash.engine.prefetch import GateLookahead, StreamingPrefetcher
from pdflash.engine.target import TargetRunner
from pdflash.engine.verify import Verifier
from pdflash.models.offload import OffloadedMoE

#: (owner, method) pairs timed as stages; nested stages count in their own
#: line and in their caller's (a sync counts in the innermost)
STAGES: tuple[tuple[Any, str], ...] = (
    (engine_module.Engine, "_step"),  # the whole step: its calls count the steps
    (engine_module.Engine, "_prefill_admitted"),
    (engine_module.Engine, "_draft_stage"),
    (engine_module.Engine, "_draft_blocks"),
    (verify_width.WidthHook, "begin_step"),
    (verify_width.WidthHook, "trim"),
    (engine_module.Engine, "_predict"),
    (engine_module.Engine, "_schedule_stage"),
    (engine_module.Engine, "_prefetch_before_verify"),
    (engine_module.Engine, "_verify"),
    (Verifier, "run"),
    # the target's forwards (prefill, verify; the drafter's are its own),
    # and inside them what runs between the kernels of a routed layer
    (TargetRunner, "forward"),
    (OffloadedMoE, "forward_routed"),
    (StreamingPrefetcher, "on_routed"),
    (StreamingPrefetcher, "after_layer"),
    (GateLookahead, "after_layer"),
    (ExpertCache, "acquire"),
    (ExpertCache, "wait_ready"),
    (ExpertCache, "release"),
    (engine_module.Engine, "_record_verify"),
    (verify_width.WidthHook, "record"),
    (engine_module.Engine, "_commit_verified"),
    (engine_module.Engine, "_end_step"),
    (verify_width.WidthHook, "end_step"),
    (FixedStepFeed, "after_step"),
)

_SYNC_WARNING = "synchronizing"
#: the syncs outside every engine step (the run's setup, warm-up and books)
OUTSIDE = "outside the engine's steps"


class _Books:
    def __init__(self) -> None:
        self.host_s: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter[str] = collections.Counter()
        self.syncs: collections.Counter[str] = collections.Counter()
        self.stack: list[str] = []
        #: what clears the books at the clock's start (``Engine.reset_stats``)
        self.on_clock: list[Callable[[], None]] = []

    def clock_started(self) -> None:
        """The run's clock starts: what ran before (its warm-up, PD's verify
        calibration: whole steps of their own) is dropped."""
        self.host_s.clear()
        self.calls.clear()
        self.syncs.clear()
        for clear in self.on_clock:
            clear()


@contextmanager
def _wrapped(books: _Books) -> Iterator[None]:
    """The stages wrapped to add their host seconds to ``books``."""
    saved: list[tuple[Any, str, Callable[..., Any]]] = []

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            books.stack.append(name)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                books.host_s[name] += time.perf_counter() - start
                books.calls[name] += 1
                books.stack.pop()

        return run

    try:
        for owner, method in STAGES:
            fn = getattr(owner, method)
            saved.append((owner, method, fn))
            setattr(owner, method, timed(f"{owner.__name__}.{method}", fn))
        after = pd_controller.after_step
        saved.append((pd_controller, "after_step", after))
        pd_controller.after_step = timed("pd_controller.after_step", after)
        reset = engine_module.Engine.reset_stats
        saved.append((engine_module.Engine, "reset_stats", reset))

        def reset_and_clear(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = reset(self, *args, **kwargs)
            books.clock_started()
            return out

        engine_module.Engine.reset_stats = reset_and_clear  # type: ignore[method-assign]
        yield
    finally:
        for owner, method, fn in reversed(saved):
            setattr(owner, method, fn)


class _ProcessEvents:
    """Garbage collections by generation and their pause seconds, those that
    ran inside an engine step (``in_step``) only (the run's explicit
    collections before its clock are not the steps'), while counting
    (``gc.callbacks``); on CUDA the caching allocator's device allocations
    and frees over the run (``torch.cuda.memory_stats`` deltas)."""

    #: ``torch.cuda.memory_stats`` counters read (absent on a torch without them)
    CUDA_KEYS = ("num_device_alloc", "num_device_free")

    def __init__(self, cuda: bool, in_step: Callable[[], bool] = lambda: True) -> None:
        self.cuda = cuda
        self.in_step = in_step
        self.collections = [0, 0, 0]
        self.pause_s = 0.0
        self._start: float | None = None
        self._cuda0: dict[str, int] = {}
        self.cuda_counts: dict[str, int] | None = None

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter() if self.in_step() else None
            return
        if self._start is None:
            return
        self.collections[int(info["generation"])] += 1
        self.pause_s += time.perf_counter() - self._start

    def _cuda_stats(self) -> dict[str, int]:
        stats = torch.cuda.memory_stats()
        return {k: int(stats[k]) for k in self.CUDA_KEYS if k in stats}

    @contextmanager
    def counting(self) -> Iterator[None]:
        if self.cuda:
            self._cuda0 = self._cuda_stats()
        gc.callbacks.append(self._on_gc)
        try:
            yield
        finally:
            gc.callbacks.remove(self._on_gc)
            if self.cuda:
                now = self._cuda_stats()
                self.cuda_counts = {k: now[k] - self._cuda0[k] for k in now if k in self._cuda0}

    def clear_collections(self) -> None:
        """Forget the collections counted so far (the clock's start)."""
        self.collections = [0, 0, 0]
        self.pause_s = 0.0

    def per_step(self, steps: int) -> dict[str, float]:
        out = {f"gc_gen{g}": n / steps for g, n in enumerate(self.collections)}
        out["gc_pause_ms"] = 1e3 * self.pause_s / steps
        for k, v in (self.cuda_counts or {}).items():
            out[k] = v / steps
        return out


def profile_arm(spec: dict[str, Any], cuda: bool, warm: bool = True) -> dict[str, Any]:
    """One profiled run of ``spec`` (after one unprofiled run where ``warm``)."""
    if warm:
        run_spec(RunSpec(**spec))  # the measured run's caches and kernels
    books = _Books()
    events = _ProcessEvents(cuda, in_step=lambda: "Engine._step" in books.stack)
    books.on_clock.append(events.clear_collections)
    with _wrapped(books), events.counting(), warnings.catch_warnings():
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")

            def on_warning(message: Any, *args: Any, **kwargs: Any) -> None:
                if _SYNC_WARNING in str(message):
                    books.syncs[books.stack[-1] if books.stack else OUTSIDE] += 1

            warnings.showwarning = on_warning
        try:
            row = run_spec(RunSpec(**spec)).row
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(0)
    engine_steps = books.calls["Engine._step"]
    steps = max(1, engine_steps)
    return {
        "tokens_per_s": row["output_tokens_per_s"],
        "measured_steps": row["steps"],
        "engine_steps": engine_steps,
        "note": "engine steps on the run's clock (from Engine.reset_stats); device "
        "allocations over the whole run",
        # the row's own spans (CUDA events on CUDA) per measured step, to set
        # beside the host ms of the stages that enclose them
        "span_ms_per_measured_step": {
            key: 1e3 * row[f"{key}_s"] / max(1, row["steps"])
            for key in ("wall", "draft", "verify", "predict", "prefill")
            if row.get(f"{key}_s") is not None
        },
        "host_ms_per_engine_step": {k: 1e3 * v / steps for k, v in books.host_s.items()},
        "calls_per_engine_step": {k: v / steps for k, v in books.calls.items()},
        "syncs_per_engine_step": (
            {k: v / steps for k, v in books.syncs.items() if k != OUTSIDE} if cuda else None
        ),
        "syncs_outside_steps": books.syncs[OUTSIDE] if cuda else None,
        # collections inside engine steps, device allocations over the run
        "process_events_per_engine_step": events.per_step(steps),
    }


class MeasuredWindow:
    """A run's ``progress`` callback that opens a profile window at the
    run's first measured step and counts the steps completed inside it, so
    the window leaves out the run's setup (a warm-up, PD's verify
    calibration: whole steps of their own) and its first step. ``profiler``
    is anything with ``start()``/``stop()`` (a ``torch.profiler.profile``)."""

    def __init__(self, profiler: Any) -> None:
        self.profiler = profiler
        self.steps = 0
        self.opened = False
        self.closed = False
        self.cpu_before: dict[int, tuple[str, int]] | None = None
        self.cpu_after: dict[int, tuple[str, int]] | None = None
        self._t_open = self._t_last = 0.0
        # the calling (main) thread's CPU seconds at the opening and at the
        # last step's end: the window exactly, where the other threads' are
        # read at close (after the run's own end)
        self._cpu_open = self._cpu_last = 0.0

    def __call__(self, done: int, total: int) -> None:
        if not self.opened:
            self.profiler.start()
            self.opened = True
            self.cpu_before = thread_cpu_ns()
            self._t_open = self._t_last = time.perf_counter()
            self._cpu_open = self._cpu_last = time.thread_time()
            return
        self.steps += 1
        self._t_last = time.perf_counter()
        self._cpu_last = time.thread_time()

    def close(self) -> None:
        """Stop the profiler (once; a run that never stepped opened none)."""
        if self.opened and not self.closed:
            self.cpu_after = thread_cpu_ns()
            self.profiler.stop()
            self.closed = True

    @property
    def wall_s(self) -> float:
        """Seconds from the window's opening to its last step's end."""
        return self._t_last - self._t_open

    @property
    def main_cpu_s(self) -> float:
        """The calling thread's CPU seconds over the same span as :attr:`wall_s`."""
        return self._cpu_last - self._cpu_open


def cuda_api_profile_arm(spec: dict[str, Any], warm: bool = True) -> dict[str, Any]:
    """One run of ``spec`` with the CUDA profiler (CUPTI only, no operator
    tracing) over its measured steps after the first (:class:`MeasuredWindow`;
    after one unprofiled run where ``warm``), summarized by
    :func:`summarize_cuda_api`. A diagnostic of where a launch-bound step's
    time goes: slower launches, more synchronizing calls, or device work
    that grew."""
    from torch.profiler import ProfilerActivity, profile

    if warm:
        run_spec(RunSpec(**spec))
    window = MeasuredWindow(profile(activities=[ProfilerActivity.CUDA]))
    try:
        row = run_spec(RunSpec(**spec), progress=window).row
    finally:
        window.close()
    if window.steps == 0:
        raise RuntimeError("the run had no measured step after its first: nothing profiled")
    threads = thread_cpu_delta(
        window.cpu_before, window.cpu_after, window.steps, threading.get_native_id()
    )
    records = [
        ApiRecord(
            ev.name,
            ev.device_type.name == "CUDA",
            int(ev.thread),
            float(ev.time_range.elapsed_us()),
        )
        for ev in window.profiler.events()
    ]
    return {
        "tokens_per_s": row["output_tokens_per_s"],
        "run_steps": row["steps"],
        "measured_steps": window.steps,
        "wall_ms_per_step": 1e3 * window.wall_s / window.steps,
        "main_cpu_ms_per_step": 1e3 * window.main_cpu_s / window.steps,
        # every thread from the window's opening to the run's end (its
        # books and the collection after its steps included)
        "thread_cpu_ms_per_step": threads,
        **summarize_cuda_api(records, window.steps),
    }


def thread_cpu_ns() -> dict[int, tuple[str, int]] | None:
    """Every thread of this process: its name and the nanoseconds it has
    run on a CPU (Linux ``/proc/self/task/*/schedstat``; None elsewhere)."""
    root = Path("/proc/self/task")
    if not root.is_dir():
        return None
    out: dict[int, tuple[str, int]] = {}
    for task in root.iterdir():
        try:
            name = (task / "comm").read_text().strip()
            run_ns = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
            continue
        out[int(task.name)] = (name, run_ns)
    return out


def thread_cpu_delta(
    before: dict[int, tuple[str, int]] | None,
    after: dict[int, tuple[str, int]] | None,
    steps: int,
    main_tid: int | None = None,
) -> dict[str, dict[str, float]] | None:
    """CPU milliseconds per ``steps`` each thread name's threads ran between
    two :func:`thread_cpu_ns` snapshots, and how many threads ran at all (a
    thread that started meanwhile counts from zero; one that ended is lost).
    Thread ``main_tid`` is named ``main`` (unnamed native threads share
    the process's name)."""
    if before is None or after is None:
        return None
    steps = max(1, steps)
    by_name: dict[str, dict[str, float]] = {}
    for tid, (name, run_ns) in after.items():
        ran = run_ns - before.get(tid, (name, 0))[1]
        if ran <= 0:
            continue
        if tid == main_tid:
            name = "main"
        entry = by_name.setdefault(name, {"threads": 0.0, "cpu_ms_per_step": 0.0})
        entry["threads"] += 1
        entry["cpu_ms_per_step"] += 1e-6 * ran / steps
    return dict(sorted(by_name.items(), key=lambda kv: -kv[1]["cpu_ms_per_step"]))


class ApiRecord(NamedTuple):
    """One profiler event: a runtime call on a host thread, or device work."""

    name: str
    on_device: bool
    thread: int
    us: float


#: the most frequent kernels :func:`summarize_cuda_api` names
KERNEL_NAMES_KEPT = 40


def summarize_cuda_api(records: list[ApiRecord], steps: int) -> dict[str, Any]:
    """Per measured step: each CUDA runtime/driver call's count and mean
    microseconds on the thread that launches the kernels (the Python
    thread) and on every other thread (the native copy threads), the
    device's kernel and copy (``Memcpy``/``Memset``) time, and the kernels."""
    steps = max(1, steps)
    # the profiler's thread ids are its own: the launching thread is found
    # as the one with the most kernel launches
    launches = collections.Counter(r.thread for r in records if r.name.startswith("cudaLaunch"))
    main = launches.most_common(1)[0][0] if launches else None
    api: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    threads: set[int] = set()
    kernel_us = copy_us = 0.0
    kernels = 0
    by_kernel: collections.Counter[str] = collections.Counter()
    for r in records:
        if r.on_device:
            if r.name.startswith(("Memcpy", "Memset")):
                copy_us += r.us
            else:
                kernel_us += r.us
                kernels += 1
                by_kernel[r.name[:120]] += 1
            continue
        if not r.name.startswith("cu"):
            continue
        threads.add(r.thread)
        entry = api[r.name]
        at = 0 if r.thread == main else 2
        entry[at] += 1
        entry[at + 1] += r.us
    return {
        "note": "per profiled step: the run's measured steps after its first",
        "threads_calling_cuda": len(threads),
        "device": {
            "kernel_ms_per_step": 1e-3 * kernel_us / steps,
            "copy_ms_per_step": 1e-3 * copy_us / steps,
            "kernels_per_step": kernels / steps,
            # which kernels an arm launches more of (names cut to 120 chars)
            "top_kernels_per_step": {
                name: n / steps for name, n in by_kernel.most_common(KERNEL_NAMES_KEPT)
            },
        },
        "api_per_step": {
            name: {
                "main_calls": n_main / steps,
                "main_us_per_call": us_main / n_main if n_main else None,
                "other_calls": n_other / steps,
                "other_us_per_call": us_other / n_other if n_other else None,
            }
            for name, (n_main, us_main, n_other, us_other) in sorted(api.items())
        },
    }


def print_cuda_api(name: str, prof: dict[str, Any]) -> None:
    """:func:`cuda_api_profile_arm`'s result, the costliest calls first."""
    dev = prof["device"]
    main_cpu = prof.get("main_cpu_ms_per_step")
    print(
        f"{name}: {prof['tokens_per_s']:.1f} tok/s, wall {prof['wall_ms_per_step']:.3f} ms/step"
        + (f" (main thread CPU {main_cpu:.3f})" if main_cpu is not None else "")
        + f"; kernels {dev['kernel_ms_per_step']:.3f} ms ({dev['kernels_per_step']:.0f}), "
        f"copies {dev['copy_ms_per_step']:.3f} ms a step; {prof['threads_calling_cuda']} threads"
    )

    def cost(item: tuple[str, dict[str, Any]]) -> float:
        d = item[1]
        return d["main_calls"] * (d["main_us_per_call"] or 0.0) + d["other_calls"] * (
            d["other_us_per_call"] or 0.0
        )

    for thread, t in (prof.get("thread_cpu_ms_per_step") or {}).items():
        print(
            f"  threads {thread!r:24s} x{t['threads']:.0f}: {t['cpu_ms_per_step']:.3f} CPU ms a step"
        )
    for call, d in sorted(prof["api_per_step"].items(), key=lambda kv: -cost(kv))[:14]:
        main = f"{d['main_calls']:8.1f} x {d['main_us_per_call'] or 0.0:6.2f} us"
        other = f"{d['other_calls']:8.1f} x {d['other_us_per_call'] or 0.0:6.2f} us"
        print(f"  {call:32s} main {main}   other threads {other}")


def median_profile(profiles: list[dict[str, Any]]) -> dict[str, Any]:
    """Per key, the median over ``profiles`` (one arm's repeats) of the
    per-step figures (a stage missing from a repeat counts there as 0), and
    how many repeats it holds."""

    def median_of(key: str) -> dict[str, float] | None:
        maps = [p[key] for p in profiles if p[key] is not None]
        if not maps:
            return None
        names = sorted({k for m in maps for k in m})
        return {k: float(np.median([m.get(k, 0.0) for m in maps])) for k in names}

    syncs_outside = [p["syncs_outside_steps"] for p in profiles]
    return {
        "repeats": len(profiles),
        "tokens_per_s": float(np.median([p["tokens_per_s"] for p in profiles])),
        "engine_steps": int(np.median([p["engine_steps"] for p in profiles])),
        "host_ms_per_engine_step": median_of("host_ms_per_engine_step"),
        "calls_per_engine_step": median_of("calls_per_engine_step"),
        "syncs_per_engine_step": median_of("syncs_per_engine_step"),
        "syncs_outside_steps": (None if None in syncs_outside else int(np.median(syncs_outside))),
        "span_ms_per_measured_step": median_of("span_ms_per_measured_step"),
        "process_events_per_engine_step": median_of("process_events_per_engine_step"),
    }


def print_profile(name: str, prof: dict[str, Any]) -> None:
    """One line per stage of ``profile_arm``'s result, the costliest first."""
    runs = f" (medians of {prof['repeats']} runs)" if prof.get("repeats", 1) > 1 else ""
    print(f"{name}: {prof['tokens_per_s']:.1f} tok/s, {prof['engine_steps']} engine steps{runs}")
    spans = ", ".join(f"{k} {v:.3f}" for k, v in prof["span_ms_per_measured_step"].items())
    print(f"  spans, ms per measured step: {spans}")
    syncs_by_stage = prof["syncs_per_engine_step"] or {}
    for stage, ms in sorted(prof["host_ms_per_engine_step"].items(), key=lambda kv: -kv[1]):
        syncs = syncs_by_stage.get(stage)
        extra = "" if syncs is None else f"  syncs/step {syncs:.2f}"
        print(f"  {stage:40s} {ms:7.3f} ms/step{extra}")
    if prof["syncs_outside_steps"] is not None:
        print(f"  {OUTSIDE}: {prof['syncs_outside_steps']} syncs")
    events = prof.get("process_events_per_engine_step")
    if events:
        print("  per engine step: " + ", ".join(f"{k} {v:.3g}" for k, v in events.items()))
