"""BM2 + BM3: H2D issue cost, copy bandwidth and band preemption under load.

Everything is measured side by side in one run on one backend:

* ``link_peak_gbps``: large pinned copies (64 MiB chunks, two in flight)
  through the same backend: the reference for every fraction below.
* ``issue_us_768``: p50 wall time of ONE ``H2DIssuer.submit`` Python call
  that queues a saturated block of 768 copies (64 KiB each, distinct keys),
  i.e. the cost the engine pays per block; chunking and issuing happen on the
  C++ worker afterwards. Measured as in serving (:func:`measure_issue_cost`,
  shared with ``pdflash-bench bm2``): blocks are pipelined two deep, so each
  timed submit meets the issuer busy copying the previous block, and every
  block is copied in full. Beside it: ``issue_us_768_idle`` (the previous
  block waited for, the issuer idle at the submit) and
  ``issue_us_768_quiescent`` (the old figure: cancelled right after the
  submit, so the worker never issues and is never woken while parked; it
  hid the wake-up cost of issue 4).
* ``naive_issue_us_768``: the same 768 copies issued by a plain per-copy
  Python loop. CUDA: ``dst[i].copy_(src[i], non_blocking=True)`` with torch
  (the MoE-Infinity-style path). Host backend (no CUDA API to call): one
  ``H2DIssuer.submit`` call per copy. ``per_copy_submit_us_768`` reports the
  latter on both backends.
* ``expert_copy_gbps``: expert-sized copies (``--expert-mib``) through the
  issuer with its default window and chunk sizes.
* ``on_demand_alone_us``: p50 latency (submit to ``wait`` returning) of one
  ON_DEMAND copy on an idle issuer; ``on_demand_under_load_us``: the same
  copy submitted while a BACKGROUND backlog (``--background-mib``) is queued
  and running (p50 over ``--load-reps``; ``on_demand_under_load_p90_us`` too);
  ``background_gbps_under_load``: backlog bytes / time from its submit to its
  last completion (the on-demand copy's link time included).
  NOTE: the on-demand copy arrives at a random moment (seeded) between one
  and two ``lead`` times after the backlog, not at a fixed delay: the wait
  depends on where in the running chunk it lands, and a fixed delay samples
  one phase of the periodic chunk pattern only (runs 1-2 on the H200 did, so
  their per-setting ratios were biased by up to a chunk either way).
* ``naive_priority_under_load_us`` (CUDA only): the same scenario with two
  CUDA streams of different priority and no issuer (torch copies; the
  backlog as 8 MiB copies on the low-priority stream).

On a CPU machine the host backend runs with an emulated link (default
0.5 GB/s: far below memcpy speed, and chunks of ~2 ms, so that thread
scheduling delays on a busy CPU stay small next to a chunk) and every size scaled down by ``--host-scale`` (default 4: a 4 MiB
on-demand copy under a 128 MiB backlog with 1 MiB chunks): the time ratios,
not the absolute numbers, are the comparable part.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Any

HELP = "H2D issuer: issue cost, copy bandwidth, on-demand latency under background load"

MiB = 1 << 20
#: (chunk MiB, window MiB, just-in-time lead as a fraction of one chunk's
#: link time; 0 = off) for --sweep (sizes before --host-scale).
SWEEP = [
    (2.0, 4.0, 0.0),
    (4.0, 8.0, 0.0),
    (4.0, 8.0, 0.25),
    (4.5, 9.0, 0.22),
    (5.0, 10.0, 0.0),
    (5.0, 10.0, 0.2),
    (6.0, 12.0, 0.0),
    (6.0, 12.0, 0.1),
    (6.0, 12.0, 0.17),
    (6.0, 12.0, 0.25),
    (8.0, 16.0, 0.0),
    (8.0, 16.0, 0.13),
    (8.0, 16.0, 0.25),
    (16.0, 32.0, 0.0),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend", choices=["auto", "cuda", "host"], default="auto", help="issuer backend"
    )
    parser.add_argument("--device", type=int, default=0, help="CUDA device")
    parser.add_argument(
        "--emulated-gbps", type=float, default=0.5, help="host backend: emulated link GB/s"
    )
    parser.add_argument(
        "--host-scale",
        type=int,
        default=4,
        help="host backend: divide the scenario sizes (chunk, window, copies) by this",
    )
    parser.add_argument(
        "--chunk-mib", type=float, default=None, help="chunk size (default: H2DIssuer's)"
    )
    parser.add_argument(
        "--window-mib", type=float, default=None, help="window bytes (default: H2DIssuer's)"
    )
    parser.add_argument("--expert-mib", type=float, default=9.0, help="expert copy size")
    parser.add_argument("--on-demand-mib", type=float, default=16.0, help="on-demand copy size")
    parser.add_argument("--background-mib", type=int, default=512, help="background backlog")
    parser.add_argument("--reps", type=int, default=7, help="repetitions of each copy scenario")
    parser.add_argument(
        "--load-reps",
        type=int,
        default=61,
        help="on-demand arrivals (random phase) per under-load measurement (and copies alone)",
    )
    parser.add_argument("--issue-reps", type=int, default=301, help="repetitions of issue timing")
    parser.add_argument(
        "--issue-lead-us",
        type=float,
        default=None,
        help="just-in-time issue lead in us (default: H2DIssuer's: 20 on CUDA, a tenth of a "
        "chunk's emulated-link time on host)",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="also run the on-demand scenario for several (chunk, window) sizes",
    )
    parser.add_argument("--out", default=None, help="also write the JSON result to this path")


def _p50(values: list[float]) -> float:
    return float(statistics.median(values))


class _Memory:
    """Pinned host source pool and a destination pool (device or host)."""

    def __init__(self, issuer: Any, nbytes: int, device: int) -> None:
        import numpy as np

        self.src = issuer.pinned_array(nbytes)
        self.src[::4096] = np.arange(self.src[::4096].size, dtype=np.uint8)
        self.torch_dst: Any = None
        if issuer.backend == "cuda":
            import torch

            self.torch_dst = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
            self.dst_ptr = int(self.torch_dst.data_ptr())
            issuer.register_destination(self.dst_ptr, nbytes)
        else:  # the issuer's pinned buffers are destinations on the host backend
            self.host_dst = issuer.pinned_array(nbytes)
            self.dst_ptr = int(self.host_dst.ctypes.data)
        self.src_ptr = int(self.src.ctypes.data)
        self.nbytes = nbytes

    def lend_to(self, issuer: Any) -> None:
        """Make both pools valid for another issuer (a copy may only read and
        write regions its issuer was given); its close() forgets them."""
        issuer.register_source(self.src_ptr, self.nbytes)
        issuer.register_destination(self.dst_ptr, self.nbytes)


def _copies(mem: _Memory, n: int, size: int, offset: int = 0) -> tuple[Any, Any]:
    import numpy as np

    if offset + n * size > mem.nbytes:
        raise ValueError(f"{n} x {size} B at {offset} exceed the {mem.nbytes} B pool")
    off = offset + np.arange(n, dtype=np.int64) * size
    return mem.src_ptr + off, mem.dst_ptr + off


def _timed_copy(issuer: Any, src: Any, dst: Any, size: int, keys: Any, band: Any) -> float:
    t0 = time.perf_counter()
    tickets = issuer.submit(src, dst, size, keys, band)
    issuer.wait(tickets)
    return time.perf_counter() - t0


def run(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    from pdflash.h2d import DEFAULT_CHUNK_BYTES, DEFAULT_WINDOW_BYTES, H2DIssuer, cuda_available
    from pdflash.metrics import NotMeasured, metrics_to_json, ratio
    from pdflash.protocols import Band

    backend = args.backend
    if backend == "auto":
        backend = "cuda" if cuda_available() else "host"
    scale = 1 if backend == "cuda" else max(1, args.host_scale)
    chunk_mib = args.chunk_mib or DEFAULT_CHUNK_BYTES / MiB
    window_mib = args.window_mib or DEFAULT_WINDOW_BYTES / MiB
    chunk = int(chunk_mib * MiB) // scale
    window = int(window_mib * MiB) // scale
    expert = int(args.expert_mib * MiB) // scale
    on_demand = int(args.on_demand_mib * MiB) // scale
    background = args.background_mib * MiB // scale
    link_kwargs: dict[str, Any] = {}
    if backend == "host":
        link_kwargs["emulated_link_gbps"] = args.emulated_gbps
    # room for the backlog plus what the link moves before the on-demand copy
    pool = max(2 * background + on_demand, 768 * (64 << 10)) + 2 * chunk

    metrics: dict[str, Any] = {}
    keybase = [1 << 40]

    def keys(n: int) -> Any:
        k = np.arange(keybase[0], keybase[0] + n, dtype=np.int64)
        keybase[0] += n
        return k

    # ---- link peak: large copies through the same backend --------------
    with H2DIssuer(
        backend=backend,
        device=args.device,
        chunk_bytes=64 * MiB // scale,
        window_bytes=128 * MiB // scale,
        **link_kwargs,
    ) as big:
        mem = _Memory(big, pool, args.device)
        n_big = max(2, background // (64 * MiB // scale))
        size = 64 * MiB // scale
        src, dst = _copies(mem, n_big, size)
        _timed_copy(big, src, dst, size, keys(n_big), Band.BACKGROUND)  # warm-up
        peak = [
            n_big * size / _timed_copy(big, src, dst, size, keys(n_big), Band.BACKGROUND) / 1e9
            for _ in range(3)
        ]
        metrics["link_peak_gbps"] = _p50(peak)
        del mem

    lead_arg: float | None = args.issue_lead_us  # None: the issuer's default
    with H2DIssuer(
        backend=backend,
        device=args.device,
        chunk_bytes=chunk,
        window_bytes=window,
        issue_lead_us=lead_arg,
        **link_kwargs,
    ) as issuer:
        lead_us = issuer.issue_lead_us
        mem = _Memory(issuer, pool, args.device)

        # ---- issue cost of a saturated 768-copy block --------------------
        small = 64 << 10
        src, dst = _copies(mem, 768, small)
        # NOTE: every waited block is copied in full: ~1 ms on the H200, but
        # 100 ms on the default 0.5 GB/s emulated link, hence fewer there.
        waited_reps = args.issue_reps if backend == "cuda" else max(5, args.issue_reps // 10)
        cost = measure_issue_cost(issuer, src, dst, small, keys, waited_reps, args.issue_reps)
        metrics.update(cost)

        per_copy = []
        for _ in range(max(3, args.issue_reps // 10)):
            k = keys(768)
            t0 = time.perf_counter()
            ts = [
                issuer.submit(src[i : i + 1], dst[i : i + 1], small, k[i : i + 1], Band.ROUTE_AHEAD)
                for i in range(768)
            ]
            per_copy.append(time.perf_counter() - t0)
            issuer.cancel()
            _drain(issuer, np.concatenate(ts))
        metrics["per_copy_submit_us_768"] = _p50(per_copy) * 1e6

        if backend == "cuda":
            metrics["naive_issue_us_768"] = _torch_naive_issue_us(mem, small, args.issue_reps)
            naive_how = "torch dst[i].copy_(src[i], non_blocking=True) per copy"
        else:
            metrics["naive_issue_us_768"] = metrics["per_copy_submit_us_768"]
            naive_how = "one H2DIssuer.submit call per copy (no CUDA API on the host backend)"

        # ---- expert-sized copies through the issuer ---------------------
        n_exp = max(4, background // expert)
        exp_src, exp_dst = _copies(mem, n_exp, expert)

        def expert_gbps(iss: Any) -> float:
            rates = [
                n_exp
                * expert
                / _timed_copy(iss, exp_src, exp_dst, expert, keys(n_exp), Band.ROUTE_AHEAD)
                / 1e9
                for _ in range(args.reps)
            ]
            return _p50(rates)

        metrics["expert_copy_gbps"] = expert_gbps(issuer)

        # ---- on-demand alone and under a background backlog ----------------
        # NOTE: the backlog is submitted lead_s before the on-demand copy (so
        # the window is in steady state) and sized so that >= `background`
        # bytes are still queued when the on-demand copy arrives (reported).
        lead_s = 1e-3 if backend == "cuda" else 4e-3
        # arrivals in [lead_s, 2 lead_s): the backlog covers the longer one
        backlog = background + int(2.5 * lead_s * metrics["link_peak_gbps"] * 1e9)
        n_bg = max(8, backlog // expert)
        bg_size = backlog // n_bg
        scenario = _BandScenario(mem, keys, on_demand, background, n_bg, bg_size, lead_s)
        load_reps = max(1, args.load_reps)
        alone_us, under_us, bg_gbps = scenario.run(issuer, args.reps, load_reps)
        metrics["on_demand_alone_us"] = alone_us
        metrics["on_demand_under_load_us"] = under_us
        metrics["on_demand_under_load_p90_us"] = scenario.under_p90_us
        metrics["background_gbps_under_load"] = bg_gbps
        metrics["background_queued_bytes_at_on_demand"] = scenario.queued_at_submit
        stats = issuer.stats()

        if backend == "cuda":
            metrics["naive_priority_under_load_us"] = _torch_priority_under_load_us(
                mem, on_demand, n_bg * bg_size, lead_s, args.reps
            )
        else:
            metrics["naive_priority_under_load_us"] = NotMeasured(
                "CUDA stream priorities exist only on the CUDA backend"
            )
        sweep: list[dict[str, Any]] = []
        if args.sweep:
            for chunk_mib, window_mib, lead_frac in SWEEP:
                c, w = int(chunk_mib * MiB) // scale, int(window_mib * MiB) // scale
                lead = lead_frac * c / (metrics["link_peak_gbps"] * 1e9) * 1e6
                with H2DIssuer(
                    backend=backend,
                    device=args.device,
                    chunk_bytes=c,
                    window_bytes=w,
                    issue_lead_us=lead,
                    **link_kwargs,
                ) as other:
                    mem.lend_to(other)
                    a_us, u_us, g = scenario.run(other, args.reps, load_reps)
                    e = expert_gbps(other)
                sweep.append(
                    {
                        "chunk_bytes": c,
                        "window_bytes": w,
                        "issue_lead_us": lead,
                        "expert_copy_gbps": e,
                        "expert_copy_fraction_of_peak": e / metrics["link_peak_gbps"],
                        "on_demand_alone_us": a_us,
                        "on_demand_under_load_us": u_us,
                        "on_demand_under_load_ratio": u_us / a_us,
                        "on_demand_under_load_p90_us": scenario.under_p90_us,
                        "background_gbps_under_load": g,
                        "background_fraction_of_peak": g / metrics["link_peak_gbps"],
                    }
                )
        del mem

    peak_gbps = metrics["link_peak_gbps"]
    metrics["expert_copy_fraction_of_peak"] = ratio(
        metrics["expert_copy_gbps"], peak_gbps, "no link bandwidth measured"
    )
    metrics["on_demand_under_load_ratio"] = ratio(
        metrics["on_demand_under_load_us"], metrics["on_demand_alone_us"], "no alone latency"
    )
    metrics["background_fraction_of_peak"] = ratio(
        metrics["background_gbps_under_load"], peak_gbps, "no link bandwidth measured"
    )
    metrics["issue_speedup_vs_naive"] = ratio(
        metrics["naive_issue_us_768"], metrics["issue_us_768"], "issue time not measured"
    )
    result: dict[str, Any] = metrics_to_json(metrics)
    result.update(
        {
            "backend": backend,
            "device": _device_name(backend, args.device),
            "naive_issue_method": naive_how,
            "emulated_link_gbps": args.emulated_gbps if backend == "host" else None,
            "size_scale": f"1/{scale}" if scale > 1 else "1",
            "issue_lead_us": lead_us,
            "scenario_bytes": {
                "chunk": chunk,
                "window": window,
                "expert": expert,
                "on_demand": on_demand,
                "background": background,
                "issue_block": [768, 64 << 10],
            },
            "issuer_link_busy_s": stats["link_busy_s"],
            "targets_h200": {
                "issue_us_768_max": 25.0,
                "expert_copy_fraction_of_peak_min": 0.95,
                "on_demand_under_load_ratio_max": 1.25,
                "background_fraction_of_peak_min": 0.90,
            },
            "build": _build_info(),
        }
    )
    if sweep:
        result["sweep"] = sweep
    if args.out:
        import json

        with open(args.out, "w") as f:
            json.dump(result, f, indent=2, sort_keys=True)
    return result


class _BandScenario:
    """An ON_DEMAND copy alone, then submitted at a random moment in
    ``[lead_s, 2 lead_s)`` after a BACKGROUND backlog (which must still be
    running then). The arrival times come from a fixed seed, so every setting
    of a sweep sees the same ones."""

    def __init__(
        self,
        mem: _Memory,
        keys: Any,
        on_demand: int,
        background: int,
        n_bg: int,
        bg_size: int,
        lead_s: float,
    ) -> None:
        self.keys = keys
        self.on_demand = on_demand
        self.od_src, self.od_dst = _copies(mem, 1, on_demand, offset=n_bg * bg_size)
        self.bg_src, self.bg_dst = _copies(mem, n_bg, bg_size)
        self.n_bg, self.bg_size, self.lead_s = n_bg, bg_size, lead_s
        self.queued_at_submit = 0.0
        self.under_p90_us = 0.0

    def run(self, issuer: Any, reps: int, load_reps: int) -> tuple[float, float, float]:
        import numpy as np

        from pdflash.protocols import Band

        arrival_s = self.lead_s * (1.0 + np.random.default_rng(0).random(load_reps))

        alone = [
            _timed_copy(
                issuer, self.od_src, self.od_dst, self.on_demand, self.keys(1), Band.ON_DEMAND
            )
            for _ in range(max(5, reps * 2, load_reps))
        ]
        under, bg_rates, queued = [], [], []
        for delay_s in arrival_s:
            t0 = time.perf_counter()
            bg = issuer.submit(
                self.bg_src, self.bg_dst, self.bg_size, self.keys(self.n_bg), Band.BACKGROUND
            )
            _sleep_until(t0 + float(delay_s))  # the backlog is queued and running
            queued.append(issuer.stats()["queued_bytes"])
            t1 = time.perf_counter()
            od = issuer.submit(
                self.od_src, self.od_dst, self.on_demand, self.keys(1), Band.ON_DEMAND
            )
            issuer.wait(od)
            under.append(time.perf_counter() - t1)
            if not (issuer.states(bg) < 2).any():
                raise RuntimeError("the background backlog finished before the on-demand copy")
            issuer.wait(bg)
            bg_rates.append(self.n_bg * self.bg_size / (time.perf_counter() - t0) / 1e9)
        self.queued_at_submit = _p50(queued)
        self.under_p90_us = float(np.quantile(under, 0.9)) * 1e6
        return _p50(alone) * 1e6, _p50(under) * 1e6, _p50(bg_rates)


ISSUE_BLOCK = 768


def measure_issue_cost(
    issuer: Any,
    src: Any,
    dst: Any,
    nbytes: int,
    next_keys: Any,
    reps: int,
    quiescent_reps: int | None = None,
) -> dict[str, float]:
    """Wall time of one ``issuer.submit`` Python call queueing a 768-copy
    block (``src``/``dst``: int64 address arrays, ``nbytes`` each, fresh keys
    from ``next_keys(n)`` as int64), in three situations (p50, microseconds):

    * ``issue_us_768`` (with ``issue_us_768_p90``): as in serving, blocks
      pipelined two deep: submit block i while block i-1 is still being
      copied, then wait for block i-1. ``reps`` timed blocks.
    * ``issue_us_768_idle``: the previous block waited for, so the issuer is
      idle (its worker parked) at the submit. ``reps`` blocks.
    * ``issue_us_768_quiescent``: every block cancelled right after its
      submit (nothing is copied). ``quiescent_reps`` (default ``reps``).
    * ``issue_lock_wait_us_768`` / ``issue_locked_us_768``: in the busy
      case, the mean time the native submit waited for and held the
      issuer's lock (from the issuer's stats).

    Arguments are passed as the engine passes them (scalar ``nbytes``, int64
    keys), so their conversion is part of the cost. Used by ``pdflash-bench
    h2d`` and ``pdflash-bench bm2`` alike.
    """
    import numpy as np

    from pdflash.protocols import Band

    def timed_submit() -> tuple[float, Any]:
        k = next_keys(ISSUE_BLOCK)
        t0 = time.perf_counter()
        tickets = issuer.submit(src, dst, nbytes, k, Band.ROUTE_AHEAD)
        return time.perf_counter() - t0, tickets

    busy: list[float] = []
    _, previous = timed_submit()  # warm-up, and the block the first one meets
    before = issuer.stats()
    for _ in range(reps):
        dt, tickets = timed_submit()
        busy.append(dt)
        issuer.wait(previous)
        previous = tickets
    after = issuer.stats()
    issuer.wait(previous)
    calls = max(1, after["submit_calls"] - before["submit_calls"])

    idle: list[float] = []
    for _ in range(reps):
        dt, tickets = timed_submit()
        idle.append(dt)
        issuer.wait(tickets)

    quiescent: list[float] = []
    for _ in range(reps if quiescent_reps is None else quiescent_reps):
        dt, tickets = timed_submit()
        quiescent.append(dt)
        issuer.cancel()
        _drain(issuer, tickets)
    return {
        "issue_us_768": _p50(busy) * 1e6,
        "issue_us_768_p90": float(np.quantile(busy, 0.9)) * 1e6,
        "issue_us_768_idle": _p50(idle) * 1e6,
        "issue_us_768_quiescent": _p50(quiescent) * 1e6,
        # the busy submits' mean time waiting for and holding the issuer lock
        # (the rest of issue_us_768 is the Python call around it)
        "issue_lock_wait_us_768": (after["submit_lock_wait_s"] - before["submit_lock_wait_s"])
        / calls
        * 1e6,
        "issue_locked_us_768": (after["submit_locked_s"] - before["submit_locked_s"]) / calls * 1e6,
    }


def _device_name(backend: str, device: int) -> str:
    import os
    import platform

    if backend == "cuda":
        import torch

        return str(torch.cuda.get_device_name(device))
    return f"{platform.machine()} CPU, {os.cpu_count()} cores (emulated link)"


def _build_info() -> dict[str, Any]:
    from pdflash._native import load_native

    info: dict[str, Any] = load_native("_build_info").summary()
    return info


def _sleep_until(t: float) -> None:
    # NOTE: time.sleep overshoots by ~50 us (timer slack); the last 200 us
    # spin, so an arrival time is met within a few microseconds.
    while True:
        left = t - time.perf_counter()
        if left <= 0:
            return
        if left > 2e-4:
            time.sleep(min(left - 1.5e-4, 1e-3))


def _drain(issuer: Any, tickets: Any) -> None:
    from pdflash.h2d import CopyCancelledError

    with contextlib.suppress(CopyCancelledError):
        issuer.wait(tickets)


def _torch_naive_issue_us(mem: _Memory, size: int, reps: int) -> float:
    import torch

    src = torch.from_numpy(mem.src[: 768 * size]).view(768, size)
    dst = mem.torch_dst[: 768 * size].view(768, size)
    stream = torch.cuda.Stream(device=dst.device)
    samples = []
    with torch.cuda.stream(stream):
        for _ in range(max(5, reps // 4)):
            torch.cuda.synchronize(dst.device)
            t0 = time.perf_counter()
            for i in range(768):
                dst[i].copy_(src[i], non_blocking=True)
            samples.append(time.perf_counter() - t0)
    torch.cuda.synchronize(dst.device)
    return _p50(samples) * 1e6


def _torch_priority_under_load_us(
    mem: _Memory, on_demand: int, background: int, lead_s: float, reps: int
) -> float:
    """Two CUDA streams (least / greatest priority), no issuer: the backlog as
    8 MiB copies on the low stream, then the on-demand copy on the high one;
    latency from its issue to its completion (host wall time)."""
    import torch

    dev = mem.torch_dst.device
    a, b = torch.cuda.Stream.priority_range()  # type: ignore[call-arg]
    low_prio, high_prio = max(a, b), min(a, b)  # a lower number is a higher priority
    low = torch.cuda.Stream(device=dev, priority=low_prio)
    high = torch.cuda.Stream(device=dev, priority=high_prio)
    src = torch.from_numpy(mem.src[: background + on_demand])
    dst = mem.torch_dst[: background + on_demand]
    piece = 8 * MiB
    samples = []
    for _ in range(reps):
        torch.cuda.synchronize(dev)
        with torch.cuda.stream(low):
            for off in range(0, background, piece):
                dst[off : off + piece].copy_(src[off : off + piece], non_blocking=True)
        _sleep_until(time.perf_counter() + lead_s)
        done = torch.cuda.Event()
        t1 = time.perf_counter()
        with torch.cuda.stream(high):
            dst[background:].copy_(src[background:], non_blocking=True)
            done.record(high)
        done.synchronize()
        samples.append(time.perf_counter() - t1)
    torch.cuda.synchronize(dev)
    return _p50(samples) * 1e6
