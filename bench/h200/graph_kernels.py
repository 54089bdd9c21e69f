"""Where a CUDA-graph replay's device time goes, kernel by kernel.

Runs one ``pdflash-bench`` command in this process under ``torch.profiler``
(CUDA activity), then groups the GPU kernels by the ``cudaGraphLaunch`` that
ran them (the kernel's correlation id is its launch's) and, for each distinct
replay (its kernel-name sequence), prints and writes the median of each
kernel's duration and of the idle gap before it, over the replays of that
sequence. Also the kernels launched outside any graph, by total time. On the
lent GPU, e.g. the all-hit MXFP4 block at 256 tokens:

    python3 -P bench/h200/graph_kernels.py --out $OUT/kernels256.json -- \\
        moe --json --arch gpt-oss-20b --synthetic-format mxfp4 --layers 1 --tokens 16 \\
        --repeats 1 --cache-fraction 1.0 --all-hit-tokens 256 --all-hit-iters 20 \\
        --all-hit-rounds 3 --compressed-gemm fused --resident-graphs on
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import statistics
import sys
import tempfile
from collections import defaultdict
from typing import Any


def _replays(trace: dict[str, Any]) -> tuple[list[list[dict[str, Any]]], list[dict[str, Any]]]:
    """The kernels of each graph launch (in start order) and the kernels
    launched outside graphs."""
    events = trace.get("traceEvents", [])
    launches = {
        e["args"]["correlation"]
        for e in events
        if e.get("ph") == "X"
        and e.get("name") == "cudaGraphLaunch"
        and "correlation" in e.get("args", {})
    }
    by_launch: dict[int, list[dict[str, Any]]] = defaultdict(list)
    loose: list[dict[str, Any]] = []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") != "kernel":
            continue
        corr = e.get("args", {}).get("correlation")
        if corr in launches:
            by_launch[corr].append(e)
        else:
            loose.append(e)
    replays = [sorted(ks, key=lambda e: float(e["ts"])) for ks in by_launch.values()]
    return replays, loose


#: kernel kinds by name (first match wins), for each replay's split
KINDS = (
    ("expert GEMM (CUDA MXFP4)", re.compile(r"mxfp4_moe_kernel")),
    ("expert GEMM (other)", re.compile(r"qgemm|grouped_mm|fused_moe", re.I)),
    ("row plan", re.compile(r"row_plan")),
    ("combine", re.compile(r"weighted_combine")),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|softmax", re.I)),
    ("dense GEMM", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|sm90_", re.I)),
)


def kind_of(name: str) -> str:
    """The :data:`KINDS` entry a kernel name falls in, else ``other``."""
    return next((kind for kind, pattern in KINDS if pattern.search(name)), "other")


def summarize(trace: dict[str, Any]) -> dict[str, Any]:
    replays, loose = _replays(trace)
    groups: dict[tuple[str, ...], list[list[dict[str, Any]]]] = defaultdict(list)
    for ks in replays:
        groups[tuple(k["name"] for k in ks)].append(ks)
    out = []
    for names, runs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        kernels = []
        by_kind: dict[str, float] = defaultdict(float)
        gaps_total = 0.0
        for i, name in enumerate(names):
            durs = [float(r[i]["dur"]) for r in runs]
            gaps = [
                float(r[i]["ts"]) - (float(r[i - 1]["ts"]) + float(r[i - 1]["dur"]))
                for r in runs
                if i > 0
            ]
            dur = statistics.median(durs)
            gap = statistics.median(gaps) if gaps else None
            by_kind[kind_of(name)] += dur
            gaps_total += gap or 0.0
            kernels.append({"name": name, "dur_us": dur, "gap_before_us": gap})
        spans = [float(r[-1]["ts"]) + float(r[-1]["dur"]) - float(r[0]["ts"]) for r in runs]
        busy = [sum(float(k["dur"]) for k in r) for r in runs]
        out.append(
            {
                "replays": len(runs),
                "kernels": kernels,
                "span_us": statistics.median(spans),
                "busy_us": statistics.median(busy),
                # sums of the kernels' median durations by kind, and of the
                # median gaps between them
                "by_kind_us": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
                "gaps_us": gaps_total,
            }
        )
    totals: dict[str, list[float]] = defaultdict(list)
    for e in loose:
        totals[e["name"]].append(float(e["dur"]))
    outside = sorted(
        ({"name": n, "calls": len(d), "total_us": sum(d)} for n, d in totals.items()),
        key=lambda r: -float(r["total_us"]),
    )
    return {"graphs": out, "outside_graphs": outside[:40]}


def _print(summary: dict[str, Any], top: int) -> None:
    for g in summary["graphs"][:top]:
        print(
            f"== graph: {g['replays']} replays, span {g['span_us']:.1f} us, "
            f"kernels busy {g['busy_us']:.1f} us, {len(g['kernels'])} kernels"
        )
        split = ", ".join(f"{kind} {us:.1f}" for kind, us in g["by_kind_us"].items())
        print(f"   by kind (us): {split}; gaps {g['gaps_us']:.1f}")
        for k in g["kernels"]:
            gap = "" if k["gap_before_us"] is None else f"{k['gap_before_us']:7.1f}"
            print(f"  {k['dur_us']:8.1f} {gap:>7}  {k['name'][:110]}")
    print("== outside graphs (top 15 by total)")
    for r in summary["outside_graphs"][:15]:
        print(f"  {r['total_us']:10.1f} us {r['calls']:6d}x  {r['name'][:100]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, help="summary JSON")
    parser.add_argument("--top", type=int, default=4, help="graphs printed")
    parser.add_argument("bench", nargs=argparse.REMAINDER, help="-- pdflash-bench arguments")
    args = parser.parse_args()
    argv = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    import torch
    from pdflash.bench.cli import main as bench_main
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with contextlib.redirect_stdout(io.StringIO()):
            rc = bench_main(argv)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    summary = {"command": argv, "bench_rc": rc, **summarize(trace)}
    _print(summary, args.top)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
