"""Per-layer kernel table of a verify forward from a torch-profiler Chrome
trace (gzipped JSON) of an EAGER B3 run, and the kernels' GPU time summed by
part, for the session-8 Qwen3-30B-A3B B3 timeline (c=16, 8 layers, graphs
off; tree 635cafc, before this branch's changes).

A layer window is the kernels after one MoE layer's down-projection grouped
GEMM up to and including the next one's (so it starts with the previous
layer's write-back/combine tail, the same for every layer). Verify forwards
are the 8-layer runs whose gate/up grouped GEMM takes > 200 us (256 rows x
top-8); their first layer (after the drafter) and the other forwards are
left out. PARTS maps the kernel positions of that tree's layer (113 kernels
in the same order in every middle layer, checked) to parts.

    python3 timeline_layers.py /work/s8_qwen_b3_eager_timeline.json.gz [--list N]
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import statistics
from collections import defaultdict
from typing import Any

#: (first, last) kernel position in a layer window -> part
PARTS = [
    ((0, 3), "split: 2nd call's masked write-back (prev layer)"),
    ((4, 5), "combine: weights x rows, sum over k"),
    ((6, 6), "residual add"),
    ((7, 14), "norms: input RMSNorm"),
    ((15, 15), "attention: q/k/v/o projections"),
    ((16, 23), "norms: q_norm"),
    ((24, 24), "attention: q/k/v/o projections"),
    ((25, 32), "norms: k_norm"),
    ((33, 33), "attention: q/k/v/o projections"),
    ((34, 38), "attention: rotary"),
    ((39, 40), "attention: KV write"),
    ((41, 46), "attention: KV gathers + SDPA"),
    ((47, 47), "attention: q/k/v/o projections"),
    ((48, 48), "residual add"),
    ((49, 56), "norms: post-attention RMSNorm"),
    ((57, 64), "router: logits mm, softmax, top-k, renorm, casts"),
    ((65, 65), "router: routed-grid mark"),
    ((66, 81), "sort/permute: slot lookup, masks, sort, offsets, x gather"),
    ((82, 83), "expert GEMMs (grouped_mm gate_up)"),
    ((84, 85), "activation: silu, mul"),
    ((86, 87), "expert GEMMs (grouped_mm down)"),
    ((88, 91), "scatter back: masked indexed write"),
    ((92, 112), "split: 2nd call (1-slot window: sort, tiny GEMMs, act)"),
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--list", type=int, default=None, help="print layer window N's kernels")
    args = ap.parse_args()
    with gzip.open(args.trace) as f:
        d = json.load(f)
    ev = d["traceEvents"]
    k = sorted(
        [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")],
        key=lambda e: e["ts"],
    )
    cpu = sorted([e for e in ev if e.get("cat") == "cpu_op"], key=lambda e: e["ts"])
    by_ext: dict[int, dict[str, Any]] = {}
    for e in cpu:
        by_ext.setdefault(e["args"]["External id"], e)
    gm = [
        i for i, e in enumerate(k) if e["name"].startswith("_ZN7cutlass") and "Group" in e["name"]
    ]
    # 4 grouped GEMM kernels per layer in that tree: gate_up, down, then the
    # 1-slot 2nd call's two
    layers = len(gm) // 4
    windows = [(gm[4 * (j - 1) + 3] + 1, gm[4 * j + 3] + 1) for j in range(1, layers)]
    verify = [
        n
        for n, (a, b) in enumerate(windows, start=1)
        if k[gm[4 * n]]["dur"] > 200 and n % 8 != 0 and b - a == 113
    ]
    if args.list is not None:
        a, b = windows[args.list - 1]
        for i in range(a, b):
            e = k[i]
            op = by_ext.get(e["args"].get("External id"))
            name = op["name"] if op else "?"
            kname = e["name"] if e["name"].startswith("_Z") else re.sub(r"<.*", "", e["name"])
            print(f"{i - a:3d} {e['dur']:7.1f} {kname[:50]:50s} {name}")
    # the anchors PARTS relies on, in every window used
    anchors = {45: "sdpa", 77: "radixSort", 83: "cutlass", 87: "cutlass", 102: "radixSort"}
    for n in verify:
        a, _ = windows[n - 1]
        for pos, word in anchors.items():
            assert word in k[a + pos]["name"], (n, pos, k[a + pos]["name"][:60])
    sums: dict[str, list[float]] = defaultdict(list)
    totals = []
    for n in verify:
        a, _ = windows[n - 1]
        part_us: dict[str, float] = defaultdict(float)
        for (lo, hi), part in PARTS:
            part_us[part] += sum(k[a + i]["dur"] for i in range(lo, hi + 1))
        for part, us in part_us.items():
            sums[part].append(us)
        totals.append(sum(part_us.values()))
    print(f"{len(verify)} middle layers of verify forwards; GPU us per layer (mean, eager)")
    for part, vals in sorted(sums.items(), key=lambda kv: -statistics.mean(kv[1])):
        print(f"  {statistics.mean(vals):7.1f}  {part}")
    print(f"  {statistics.mean(totals):7.1f}  total per layer")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
