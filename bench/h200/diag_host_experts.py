"""Where the host executor's time per expert goes (issue 16), JSON lines on stdout.

Loads a synthetic target (``pdflash.bench.engine_run``'s cache: the same
weights the issue-16 runs use) and times, per expert, at each token count:

* ``raw_in_out`` / ``raw_out_in``: the bare MLP (two GEMMs and a SiLU-mul,
  no biases) over the expert's dense weights ``[in, out]`` (``x @ w``) and
  ``[out, in]`` (``F.linear``), in the model dtype — the floor torch gives;
* ``expert_fn``: the adapter's own ``expert_forward`` on the store's packed
  views, called in this thread (what the executor ran before host formats);
* ``kernel[F]``: the host kernel of format F on its prepared weights, called
  in this thread;
* ``executor[F]``: ``HostExpertExecutor.compute`` with format F (pool hand-off
  included), two experts per batch as the calibration times them;
* ``executor_busy_caller[F]``: the same through ``submit`` while this thread
  keeps launching small ops (as the engine's thread does during a forward:
  GIL and CPU contention included), cold only.

* ``paths[...]`` (``--sections paths``): where the executor's time goes, per
  format (``out_in``, ``onednn``, ``native``, ``native_mxfp4`` for MXFP4
  stores, ``native_fp8`` for FP8 ones: :data:`PATH_FORMATS`; and
  ``native_avx512``, the native kernel held to its AVX-512 BF16 loops, where
  it would run AMX), all in one shuffled round per repeat
  (``--repeats`` x 3 rounds, medians, cold): ``read_floor`` (the expert's
  bytes streamed once by a reduction: the memory-bound floor;
  ``read_floor_mxfp4`` / ``read_floor_fp8``: the same over ``native_mxfp4``'s
  / ``native_fp8``'s codes and scales),
  ``raw_out_in`` (bare MLP), ``kernel:F`` (the kernel, this thread, one
  call per expert), ``executor_loop:F`` (the pool, ``forward`` per expert
  and a copy into the output: the executor before batching),
  ``executor_batch:F`` (the pool, ``forward_many``: the whole batch in one
  call), each over ``--batch`` experts per job, and the two executor paths
  again with a busy caller (``*_busy``: this thread runs Python and small
  torch ops while the pool computes, as the engine's thread does), and
  ``executor_dispatch_only`` (the same jobs computing nothing: the pool
  hand-off, argument checks and output allocation, per expert).
  The summary's ``paths_over_floor`` divides each by ``read_floor``.
  ``--clock cpu`` times them in process CPU seconds instead of wall seconds
  (for a shared machine whose other load deschedules the threads; the busy
  caller's own work would count, so ``*_busy`` is left out).
  ``--link-load`` (CUDA only) repeats the read floor and the batch path while a side stream
  copies pinned host memory to the GPU in a loop: the CPU's and the DMA's
  reads share host memory bandwidth (``paths_link_load``).

* ``interleaved[...]``: the bare ``[out, in]`` MLP, ``kernel[out_in]``,
  ``kernel[onednn]`` and ``kernel[native]`` again, one cold pass each per round in a shuffled order
  (``--repeats`` x 3 rounds, medians): the sections above run one after
  another, so a drift of the machine over the run reads as a difference
  between them; these three compare directly.

Every measurement walks through ``--experts`` different experts (``cold``:
their weights are not in the CPU caches when a forward finds them) and
repeats one expert (``hot``). Each format's prepared copy is made, timed and
dropped before the next. The last line is a summary: per format and token
count the cold microseconds per expert and the executor's overhead over
the raw MLP.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

#: the host formats the paths and interleaved sections compare (each where
#: it exists here: oneDNN's where torch has it, the native kernel for bf16
#: models on CPUs with AVX-512 BF16)
PATH_FORMATS: tuple[str, ...] = ("out_in", "onednn", "native", "native_mxfp4", "native_fp8")


def _us(fn: Callable[[int], Any], ids: list[int], repeats: int) -> float:
    """Median over ``repeats`` passes of the mean microseconds per call of
    ``fn(id)`` over ``ids``."""
    fn(ids[0])
    passes = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for g in ids:
            fn(g)
        passes.append((time.perf_counter() - t0) / len(ids))
    return statistics.median(passes) * 1e6


def _cpu_model() -> dict[str, Any]:
    """The CPU's model name and the flags that decide torch's bf16 GEMM path."""
    out: dict[str, Any] = {}
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return out
    for line in text.splitlines():
        if line.startswith("model name") and "model" not in out:
            out["model"] = line.split(":", 1)[1].strip()
        if line.startswith("flags") and "flags" not in out:
            flags = set(line.split(":", 1)[1].split())
            out["flags"] = sorted(
                flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}
            )
    out["sockets"] = len({ln for ln in text.splitlines() if ln.startswith("physical id")})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="gpt-oss-20b")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--dtype", default=None, help="synthetic weights' dtype (default: run_spec's)")
    ap.add_argument("--synthetic-format", default=None, choices=(None, "mxfp4"))
    ap.add_argument("--expert-dtype", default=None, choices=(None, "dense", "fp8"))
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    ap.add_argument("--tokens", default="1,4,16")
    ap.add_argument("--formats", default="packed,out_in,onednn,fp32_out_in,fp32_in_out")
    ap.add_argument("--experts", type=int, default=16, help="experts walked per cold pass")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="where the target loads (cpu or cuda)")
    ap.add_argument(
        "--sections",
        default="formats,interleaved,paths",
        help="which parts to run (comma list of formats, interleaved, paths)",
    )
    ap.add_argument("--batch", type=int, default=4, help="experts per executor job in paths")
    ap.add_argument("--link-load", action="store_true", help="paths under H2D load (CUDA)")
    ap.add_argument("--clock", default="wall", choices=("wall", "cpu"), help="paths' clock")
    args = ap.parse_args(argv)

    from pdflash.bench.engine_run import RunSpec, load_target, synthetic_paths

    from pdflash.serve.build import resolve_device

    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    spec = RunSpec(
        arch=args.arch,
        baseline="PD",
        layers=args.layers or None,
        dtype=args.dtype,
        synthetic_format=args.synthetic_format,
        expert_dtype=args.expert_dtype,
        device=str(device),
    )
    t0 = time.perf_counter()
    path, _, dtype = synthetic_paths(spec, device)
    ad = load_target(path, device, dtype, args.expert_dtype)
    diagnose(
        ad,
        tokens=[int(t) for t in args.tokens.split(",") if t],
        formats=[f for f in args.formats.split(",") if f],
        experts=args.experts,
        repeats=args.repeats,
        sections=[x for x in args.sections.split(",") if x],
        batch=args.batch,
        link_load=args.link_load,
        cpu_clock=args.clock == "cpu",
        head={
            "arch": args.arch,
            "layers": args.layers,
            "load_s": round(time.perf_counter() - t0, 1),
        },
    )
    return 0


def diagnose(
    ad: Any,
    *,
    tokens: list[int],
    formats: list[str],
    experts: int = 16,
    repeats: int = 3,
    head: dict[str, Any] | None = None,
    sections: list[str] | None = None,
    batch: int = 4,
    link_load: bool = False,
    cpu_clock: bool = False,
) -> dict[str, Any]:
    """Time ``ad``'s experts as the module doc says; prints JSON lines and
    returns the summary (also the last line printed)."""
    from pdflash.hybrid import HostExpertExecutor, host_kernel_for
    from pdflash.hybrid.kernels import batched_kernels_error, prepare_all
    from pdflash.hybrid.native import native_unavailable_reason

    sections = ["formats", "interleaved", "paths"] if sections is None else sections
    store = ad.store
    ids = list(range(min(experts, store.num_ids)))
    hot = [ids[0]] * len(ids)
    gen = torch.Generator().manual_seed(0)
    head = {
        "diag": "host_experts",
        **(head or {}),
        "store_format": store.layout.format,
        "dtype": str(store.layout.dtype),
        "expert_nbytes": store.expert_nbytes,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "experts_walked": len(ids),
        "walked_bytes": len(ids) * store.expert_nbytes,
        "sections": sections,
        "paths_clock": "process_cpu" if cpu_clock else "wall",
        "scripted_batches": batched_kernels_error() or "yes",
        "native_kernel": native_unavailable_reason(store.layout.dtype) or "yes",
        "cpu": _cpu_model(),
        "synthetic": True,
    }
    with HostExpertExecutor(store.views, ad.expert_forward, dtype=store.layout.dtype) as probe:
        # torch's intra-op threads as the pool's worker sees them
        head["worker_threads"] = probe._pool.submit(torch.get_num_threads).result()
    print(json.dumps(head), flush=True)
    rows: list[dict[str, Any]] = []

    def prepared(fmt: str) -> Any:
        """(kernel, weights_of) of ``fmt`` over the walked experts only
        (ids are 0..k-1, so position = flat id), or None."""
        kernel = host_kernel_for(ad, fmt)
        if kernel is None:
            return None
        if fmt == "packed":
            return kernel, store.views
        done = prepare_all(kernel, store.views, ids)
        assert done is not None
        return kernel, done.of

    def emit(what: str, n: int, cold: float, hot_us: float | None = None) -> None:
        row = {"what": what, "tokens": n, "cold_us": round(cold, 1)}
        if hot_us is not None:
            row["hot_us"] = round(hot_us, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)

    # the caller's small ops in executor_busy_caller (on the GPU where there is one)
    spin = torch.zeros(16, device="cuda" if torch.cuda.is_available() else "cpu")
    xs = {
        n: torch.randn(n, int(ad.hidden_size), generator=gen).to(store.layout.dtype) for n in tokens
    }
    if "paths" in sections:
        executor_paths(
            ad, ids, xs, repeats, emit, batch=batch, link_load=link_load, cpu_clock=cpu_clock
        )
    with torch.inference_mode():
        out_in = prepared("out_in") if "formats" in sections else None
        # the bare MLP over dense weights, both layouts (from the out_in format:
        # for a dense gpt-oss store its w1/w2 are the packed weights transposed)
        if out_in is not None:
            dense_oi = [out_in[1](g) for g in ids]
            # contiguous [in, out] (a transposed view would run as [out, in])
            dense_io = [
                {k: v.t().contiguous() for k, v in w.items() if v.dim() == 2} for w in dense_oi
            ]

            def raw_oi(g: int, x: torch.Tensor) -> torch.Tensor:
                w = dense_oi[g]
                h = F.linear(x, w["w1"])
                i = h.shape[-1] // 2
                return F.linear(F.silu(h[:, :i]) * h[:, i:], w["w2"])

            def raw_io(g: int, x: torch.Tensor) -> torch.Tensor:
                w = dense_io[g]
                h = x @ w["w1"]
                i = h.shape[-1] // 2
                return (F.silu(h[:, :i]) * h[:, i:]) @ w["w2"]

            for n in tokens:
                for name, fn in (("raw_out_in", raw_oi), ("raw_in_out", raw_io)):

                    def call(g: int, fn: Any = fn, x: torch.Tensor = xs[n]) -> Any:
                        return fn(g, x)

                    emit(name, n, _us(call, ids, repeats), _us(call, hot, repeats))
            del dense_oi, dense_io, out_in
        for n in tokens if "formats" in sections else []:

            def packed(g: int, x: torch.Tensor = xs[n]) -> Any:
                return ad.expert_forward(x, store.views(g))

            emit("expert_fn", n, _us(packed, ids, repeats), _us(packed, hot, repeats))
    for fmt in formats if "formats" in sections else []:
        t1 = time.perf_counter()
        hw = prepared(fmt)
        if hw is None:
            print(json.dumps({"format": fmt, "skipped": "no kernel"}), flush=True)
            continue
        kernel, weights_of = hw
        print(
            json.dumps(
                {
                    "format": fmt,
                    "prepare_s_per_expert": round((time.perf_counter() - t1) / len(ids), 4),
                }
            ),
            flush=True,
        )
        with HostExpertExecutor(
            weights_of,
            kernel.forward,
            dtype=kernel.dtype,
            out_dtype=store.layout.dtype,
            workers=1,
        ) as ex:
            for n in tokens:
                x = xs[n].to(kernel.dtype)

                def direct(g: int, x: torch.Tensor = x, hw: Any = hw) -> torch.Tensor:
                    return hw[0].forward(x, hw[1](g))

                with torch.inference_mode():
                    emit(f"kernel[{fmt}]", n, _us(direct, ids, repeats), _us(direct, hot, repeats))
                pairs = [ids[i : i + 2] for i in range(0, len(ids) - 1, 2)]
                xx = xs[n].repeat(2, 1)

                def pair(p: list[int], xx: torch.Tensor = xx, n: int = n) -> None:
                    ex.compute(np.asarray(p, dtype=np.int64), xx, [n, n])

                cold = _us(pair, pairs, repeats) / 2  # type: ignore[arg-type]
                hot_pairs = [[ids[0], ids[0]]] * len(pairs)
                emit(f"executor[{fmt}]", n, cold, _us(pair, hot_pairs, repeats) / 2)  # type: ignore[arg-type]

                def busy_batch(p: list[int], xx: torch.Tensor = xx, n: int = n) -> None:
                    # as in a forward: the engine's thread keeps launching
                    # small ops (and taking the GIL) while the pool computes
                    job = ex.submit(np.asarray(p, dtype=np.int64), xx, [n, n], device="cpu")
                    while not job.done():
                        spin.add_(1.0)
                    job.result()

                emit(f"executor_busy_caller[{fmt}]", n, _us(busy_batch, pairs, repeats) / 2)  # type: ignore[arg-type]
    if "interleaved" in sections:
        interleaved(ad, ids, xs, repeats, emit)
    by = {(r["what"], r["tokens"]): r["cold_us"] for r in rows}
    summary: dict[str, Any] = {"diag_summary": "host_experts", **head, "cold_us": {}}
    for (what, n), us in by.items():
        summary["cold_us"].setdefault(what, {})[n] = us
    over = {}
    for (what, n), us in by.items():
        floor = by.get(("raw_out_in", n))
        if what.startswith("executor[") and floor:
            over[f"{what}@{n}"] = round(us / floor, 2)
    summary["executor_over_raw_out_in"] = over
    summary["interleaved_over_raw"] = {
        f"{what}@{n}": round(us / by[("interleaved[raw_out_in]", n)], 3)
        for (what, n), us in by.items()
        if what.startswith("interleaved[kernel") and by.get(("interleaved[raw_out_in]", n))
    }
    summary["paths_over_floor"] = {
        f"{what}@{n}": round(us / by[("paths[read_floor]", n)], 3)
        for (what, n), us in by.items()
        if what.startswith("paths[") and by.get(("paths[read_floor]", n))
    }
    floor = {n: by[("paths[read_floor]", n)] for (w, n) in by if w == "paths[read_floor]"}
    if floor:
        summary["read_floor_gb_per_s"] = {
            n: round(store.expert_nbytes / (us * 1e3), 1) for n, us in floor.items()
        }
    print(json.dumps(summary), flush=True)
    return summary


def _busy_wait(job: Any, spin: torch.Tensor) -> None:
    """Wait for ``job`` as the engine's thread would: Python work and small
    torch ops (each releases the GIL briefly) until it is done."""
    while not job.done():
        acc = 0
        for i in range(200):
            acc += i * i
        spin.add_(1.0)
    job.result()


def _no_compute(x: Any, ws: Any, bounds: Any, out: Any) -> None:
    """A batch function that computes nothing (the executor's dispatch alone)."""


class _LinkLoad:
    """A side CUDA stream copying pinned host memory to the GPU in a loop
    (the link's DMA reads host memory while the CPU computes)."""

    def __init__(self, nbytes: int = 256 << 20) -> None:
        self.src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.stream = torch.cuda.Stream()
        self.stop = False
        self.copied = 0
        self.thread: Any = None

    def _loop(self) -> None:
        with torch.cuda.stream(self.stream):
            while not self.stop:
                self.dst.copy_(self.src, non_blocking=True)
                self.stream.synchronize()
                self.copied += self.src.numel()

    def __enter__(self) -> _LinkLoad:
        import threading

        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.t0 = time.perf_counter()
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop = True
        self.thread.join()
        self.gb_per_s = self.copied / (time.perf_counter() - self.t0) / 1e9


def executor_paths(
    ad: Any,
    ids: list[int],
    xs: dict[int, torch.Tensor],
    repeats: int,
    emit: Callable[..., None],
    *,
    batch: int = 4,
    link_load: bool = False,
    cpu_clock: bool = False,
) -> None:
    """The ``paths[...]`` section of the module doc."""
    clock = time.process_time if cpu_clock else time.perf_counter
    import random

    from pdflash.hybrid import HostExpertExecutor, host_kernel_for
    from pdflash.hybrid.kernels import prepare_all

    store = ad.store
    prepared: dict[str, tuple[Any, list[dict[str, torch.Tensor]]]] = {}
    for fmt in PATH_FORMATS:
        kernel = host_kernel_for(ad, fmt)
        if kernel is None or kernel.dtype != store.layout.dtype:
            continue
        done = prepare_all(kernel, store.views, ids)
        assert done is not None
        prepared[fmt] = (kernel, done.experts)
    native = prepared.get("native")
    if native is not None:
        from pdflash.hybrid.native import cpu_has_amx_bf16

        if cpu_has_amx_bf16():
            # the same packed weights through the AVX-512 BF16 loops only (the
            # native kernel runs AMX where it can): which is faster at few rows
            prepared["native_avx512"] = (native[0].with_isa("avx512_bf16"), native[1])
    if "out_in" not in prepared:
        print(json.dumps({"paths": "skipped: no out_in kernel"}), flush=True)
        return
    dense = prepared["out_in"][1]

    def raw(x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        h = F.linear(x, w["w1"])
        i = h.shape[-1] // 2
        return F.linear(F.silu(h[:, :i]) * h[:, i:], w["w2"])

    def read(w: dict[str, torch.Tensor]) -> None:
        for t in (w["w1"], w["w2"]):
            flat = t.reshape(-1)
            (flat.view(torch.int64) if flat.numel() * flat.element_size() % 8 == 0 else flat).sum()

    batches = [ids[i : i + batch] for i in range(0, len(ids) - batch + 1, batch)] or [ids]
    spin = torch.zeros(16, device="cuda" if torch.cuda.is_available() else "cpu")
    executors: dict[str, HostExpertExecutor] = {}
    for fmt, (kernel, ws) in prepared.items():
        for mode in ("loop", "batch"):
            executors[f"{mode}:{fmt}"] = HostExpertExecutor(
                ws.__getitem__,
                kernel.forward,
                dtype=kernel.dtype,
                out_dtype=store.layout.dtype,
                workers=1,
                batch_fn=kernel.forward_many if mode == "batch" else None,
            )
    # the executor's own cost per job: the same jobs with nothing to compute
    kernel0, ws0 = prepared["out_in"]
    executors["dispatch_only"] = HostExpertExecutor(
        ws0.__getitem__,
        kernel0.forward,
        dtype=kernel0.dtype,
        out_dtype=store.layout.dtype,
        workers=1,
        batch_fn=_no_compute,
    )
    try:
        for n, x in xs.items():
            calls: dict[str, Callable[[], None]] = {}

            def read_all() -> None:
                for w in dense:
                    read(w)

            def raw_all(x: torch.Tensor = x) -> None:
                for w in dense:
                    raw(x, w)

            calls["read_floor"] = read_all
            for stored in ("mxfp4", "fp8"):
                if f"native_{stored}" not in prepared:
                    continue

                def read_stored(ws: Any = prepared[f"native_{stored}"][1]) -> None:
                    for w in ws:
                        for key in ("q1", "s1", "q2", "s2"):
                            w[key].view(torch.int64).sum()

                calls[f"read_floor_{stored}"] = read_stored
            calls["raw_out_in"] = raw_all
            for fmt, (kernel, ws) in prepared.items():

                def kernel_all(x: torch.Tensor = x, k: Any = kernel, ws: Any = ws) -> None:
                    for w in ws:
                        k.forward(x, w)

                calls[f"kernel:{fmt}"] = kernel_all
            xx = x.repeat(batch, 1)
            for key, ex in executors.items():

                def jobs(
                    ex: HostExpertExecutor = ex,
                    busy: bool = False,
                    xx: torch.Tensor = xx,
                    n: int = n,
                ) -> None:
                    for b in batches:
                        xb = xx[: n * len(b)]
                        if busy:
                            _busy_wait(
                                ex.submit(np.asarray(b), xb, [n] * len(b), device="cpu"), spin
                            )
                        else:
                            ex.compute(np.asarray(b), xb, [n] * len(b))

                calls[f"executor_{key}"] = jobs
                if not cpu_clock:
                    calls[f"executor_{key}_busy"] = functools.partial(jobs, busy=True)
            walked = sum(len(b) for b in batches)
            per = {k: (walked if k.startswith("executor_") else len(ids)) for k in calls}
            rng = random.Random(n)
            times: dict[str, list[float]] = {k: [] for k in calls}
            with torch.inference_mode():
                for fn in calls.values():
                    fn()  # warm-up (scripted loops compile and profile here)
                for _ in range(3 * repeats):
                    order = list(calls)
                    rng.shuffle(order)
                    for k in order:
                        t0 = clock()
                        calls[k]()
                        times[k].append((clock() - t0) / per[k])
            for k, ts in times.items():
                emit(f"paths[{k}]", n, statistics.median(ts) * 1e6)
            if link_load and torch.cuda.is_available():
                loaded = ["read_floor"] + [
                    k for k in calls if k.startswith("executor_batch") and "busy" not in k
                ]
                for key in loaded:
                    ts = []
                    with _LinkLoad() as load, torch.inference_mode():
                        for _ in range(3 * repeats):
                            t0 = time.perf_counter()
                            calls[key]()
                            ts.append((time.perf_counter() - t0) / per[key])
                    emit(f"paths_link_load[{key}]", n, statistics.median(ts) * 1e6)
                    print(json.dumps({"link_load_gb_per_s": round(load.gb_per_s, 1)}), flush=True)
    finally:
        for ex in executors.values():
            ex.close()
    prepared.clear()


def interleaved(
    ad: Any,
    ids: list[int],
    xs: dict[int, torch.Tensor],
    repeats: int,
    emit: Callable[..., None],
) -> None:
    """The bare MLP and the kernels of :data:`PATH_FORMATS` (where they
    exist) in shuffled order, one cold pass each per round (module doc)."""
    import random

    from pdflash.hybrid import host_kernel_for
    from pdflash.hybrid.kernels import prepare_all

    calls: dict[str, tuple[Callable[..., torch.Tensor], list[dict[str, torch.Tensor]]]] = {}
    for fmt in PATH_FORMATS:
        kernel = host_kernel_for(ad, fmt)
        if kernel is None or kernel.dtype != ad.store.layout.dtype:
            continue
        done = prepare_all(kernel, ad.store.views, ids)
        assert done is not None
        calls[f"kernel[{fmt}]"] = (kernel.forward, done.experts)
    if "kernel[out_in]" not in calls:
        return

    def raw(x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        h = F.linear(x, w["w1"])
        i = h.shape[-1] // 2
        return F.linear(F.silu(h[:, :i]) * h[:, i:], w["w2"])

    calls["raw_out_in"] = (raw, calls["kernel[out_in]"][1])
    rng = random.Random(0)
    with torch.inference_mode():
        for n, x in xs.items():
            for fn, ws in calls.values():
                fn(x, ws[0])
            times: dict[str, list[float]] = {k: [] for k in calls}
            for _ in range(3 * repeats):
                order = list(calls)
                rng.shuffle(order)
                for k in order:
                    fn, ws = calls[k]
                    t0 = time.perf_counter()
                    for w in ws:
                        fn(x, w)
                    times[k].append((time.perf_counter() - t0) / len(ws))
            for k, ts in times.items():
                emit(f"interleaved[{k}]", n, statistics.median(ts) * 1e6)
    calls.clear()


if __name__ == "__main__":
    sys.exit(main())
