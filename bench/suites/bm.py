"""``pdflash-bench bm --routine bmN`` (or ``pdflash-bench bmN``): the benchmark
gates of DESIGN §6.

* BM1 — the route-ahead router pass is cheaper than the verify forward;
* BM2 — issuance latency of a saturated block (768 expert copies, one call);
* BM3 — band ablation: on-demand latency under background load and the
  background throughput kept, bands on vs off;
* BM4 — H2D/compute overlap, measured in-process with CUDA events on the
  copy and compute streams (CUDA only);
* BM5 — native and reference paths give identical acceptance, coverage and
  waste.

Each prints one JSON object (stdout) and a one-line verdict (stderr). A
routine that cannot be measured here (no CUDA, a component not built)
reports ``"measured": false`` with the reason: never a number.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

HELP = "benchmark gates BM1-BM5 (router vs verify, issuance, band ablation, overlap, equivalence)"

ROUTINES = ("bm1", "bm2", "bm3", "bm4", "bm5")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # `pdflash-bench bm3` is `pdflash-bench bm --routine bm3`: the subcommand
    # name (the last word of the parser's prog) picks the default routine.
    name = parser.prog.split()[-1]
    default = name if name in ROUTINES else None
    parser.add_argument(
        "--routine",
        choices=ROUTINES,
        default=default,
        required=default is None,
        help="which benchmark gate",
    )
    parser.add_argument("--arch", default="tiny", help="model shape for BM1/BM5 (default tiny)")
    parser.add_argument(
        "--layers", type=int, default=None, help="truncate full-size shapes to N layers"
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--iters", type=int, default=20, help="timed iterations (medians reported)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--emulated-link-gbps",
        type=float,
        default=2.0,
        help="host copy backend rate on CPU (BM2/BM3), GB/s",
    )
    parser.add_argument(
        "--expert-mib", type=float, default=4.0, help="expert copy size for BM2-BM4"
    )


def _not_measured(routine: str, reason: str, **extra: Any) -> dict[str, Any]:
    return {"routine": routine, "measured": False, "reason": reason, **extra}


def _optional(module: str) -> tuple[Any, str]:
    """Import a sibling team's module, or return the reason it is missing."""
    try:
        return importlib.import_module(module), ""
    except ImportError as exc:
        return None, f"{module} is not available ({exc})"


def _device(requested: str) -> str:
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {requested}: no CUDA device here")
    return requested


def _median_time(fn: Callable[[], Any], iters: int, sync: Callable[[], None]) -> float:
    times = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# --------------------------------------------------------------------- BM4


def _intervals_union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def interval_overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total time covered by both interval sets (each merged first)."""
    ua, ub = _intervals_union(a), _intervals_union(b)
    i = j = 0
    total = 0.0
    while i < len(ua) and j < len(ub):
        lo, hi = max(ua[i][0], ub[j][0]), min(ua[i][1], ub[j][1])
        if hi > lo:
            total += hi - lo
        if ua[i][1] < ub[j][1]:
            i += 1
        else:
            j += 1
    return total


def bm4(args: argparse.Namespace) -> dict[str, Any]:
    """Copies on a copy stream while matmuls run on the compute stream; CUDA
    events bracket every copy and every matmul; overlap = time both streams
    were busy / copy-busy time."""
    import torch

    if _device(args.device) == "cpu" or not torch.cuda.is_available():
        return _not_measured("bm4", "CUDA events need a CUDA device; none here")
    dev = torch.device("cuda")
    nbytes = int(args.expert_mib * (1 << 20))
    copies = 32
    src = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(copies)]
    dst = [torch.empty(nbytes, dtype=torch.uint8, device=dev) for _ in range(copies)]
    copy_stream = torch.cuda.Stream(device=dev)
    compute_stream = torch.cuda.Stream(device=dev)
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)

    def timed(stream: Any, ops: list[Callable[[], Any]], origin: Any) -> list[tuple[Any, Any]]:
        events = []
        with torch.cuda.stream(stream):
            for op in ops:
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record(stream)
                op()
                end.record(stream)
                events.append((start, end))
        return events

    def copy_op(s: Any, d: Any) -> Callable[[], Any]:
        return lambda: d.copy_(s, non_blocking=True)

    copy_ops = [copy_op(s, d) for s, d in zip(src, dst, strict=True)]

    def mm() -> Any:
        return a @ b

    # calibrate: how many matmuls take about as long as all the copies
    for _ in range(3):
        mm()
    torch.cuda.synchronize()
    t_copy = _median_time(lambda: [op() for op in copy_ops], 3, torch.cuda.synchronize)
    t_mm = _median_time(mm, 10, torch.cuda.synchronize)
    n_mm = max(1, int(1.5 * t_copy / t_mm))
    mm_ops = [mm] * n_mm

    results = []
    for _ in range(max(1, args.iters // 5)):
        torch.cuda.synchronize()
        origin = torch.cuda.Event(enable_timing=True)
        origin.record(torch.cuda.current_stream())
        copy_stream.wait_event(origin)
        compute_stream.wait_event(origin)
        c_ev = timed(copy_stream, copy_ops, origin)
        m_ev = timed(compute_stream, mm_ops, origin)
        torch.cuda.synchronize()
        ci = [(origin.elapsed_time(s) / 1e3, origin.elapsed_time(e) / 1e3) for s, e in c_ev]
        mi = [(origin.elapsed_time(s) / 1e3, origin.elapsed_time(e) / 1e3) for s, e in m_ev]
        copy_busy = sum(e - s for s, e in _intervals_union(ci))
        compute_busy = sum(e - s for s, e in _intervals_union(mi))
        wall = max(end for _, end in ci + mi)
        overlap = interval_overlap(ci, mi)
        results.append(
            {
                "copy_busy_s": copy_busy,
                "compute_busy_s": compute_busy,
                "wall_s": wall,
                "overlap_s": overlap,
                "overlap_fraction": overlap / copy_busy if copy_busy else None,
                "eta": max(copy_busy, compute_busy) / wall,
                "copy_gbps": copies * nbytes / copy_busy / 1e9 if copy_busy else None,
            }
        )
    med = {
        k: statistics.median([r[k] for r in results if r[k] is not None])
        for k in results[0]
        if any(r[k] is not None for r in results)
    }
    frac = med.get("overlap_fraction")
    return {
        "routine": "bm4",
        "measured": True,
        "device": torch.cuda.get_device_name(dev),
        "copies": copies,
        "copy_nbytes": nbytes,
        "matmuls": n_mm,
        "trials": len(results),
        **med,
        "target": "overlap_fraction >= 0.9 (copies hidden behind compute)",
        "pass": frac is not None and frac >= 0.9,
    }


# --------------------------------------------------------------------- others


def bm1(args: argparse.Namespace) -> dict[str, Any]:
    return _pending("bm1", "pdflash.routeahead", args)


def bm2(args: argparse.Namespace) -> dict[str, Any]:
    return _pending("bm2", "pdflash.h2d", args)


def bm3(args: argparse.Namespace) -> dict[str, Any]:
    return _pending("bm3", "pdflash.h2d", args)


def bm5(args: argparse.Namespace) -> dict[str, Any]:
    return _pending("bm5", "pdflash.routeahead", args)


def _pending(routine: str, module: str, args: argparse.Namespace) -> dict[str, Any]:
    mod, reason = _optional(module)
    if mod is None:
        return _not_measured(routine, reason)
    return _not_measured(routine, f"{routine} is not wired to {module} yet")


def verdict_line(result: dict[str, Any]) -> str:
    routine = result["routine"].upper()
    if not result.get("measured"):
        return f"{routine}: NOT MEASURED — {result.get('reason')}"
    status = "PASS" if result.get("pass") else "FAIL"
    return f"{routine}: {status} — {result.get('summary') or result.get('target')}"


def run(args: argparse.Namespace) -> dict[str, Any]:
    routine = {"bm1": bm1, "bm2": bm2, "bm3": bm3, "bm4": bm4, "bm5": bm5}[args.routine]
    result = routine(args)
    result["verdict"] = verdict_line(result)
    print(result["verdict"], file=sys.stderr)
    return result
