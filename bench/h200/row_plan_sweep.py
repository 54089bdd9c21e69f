"""The row plan's launch tuning on the lent GPU: device µs of one
``row_plan`` (pdflash.models.fused_moe_triton) per plan (``ordered``, the
stable one; ``atomic``, ``ordered=False``), row count, key count, warps and
one-hot cells a program holds, each timed as a CUDA graph of 20
back-to-back plans (3 rounds, the median), each plan checked against the
counting sort once per setting (the ordered one exactly, the atomic one as a
valid plan). Prints a table and writes JSON:

    python3 -P bench/h200/row_plan_sweep.py --out $OUT/row_plan_sweep.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from functools import partial
from typing import Any

import torch


def _graph_us(plan: Any) -> float:
    """Device µs of one call, from a CUDA graph of 20 (median of 3 replays)."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            plan()
    times = []
    for _ in range(3):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / 20)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", default="64,256,1024,4096")
    parser.add_argument("--widths", default="32,128")
    parser.add_argument("--warps", default="4,8,16")
    parser.add_argument("--cells", default="2048,4096,8192,16384")
    parser.add_argument(
        "--orders", default="ordered,atomic", help="which plans: ordered (stable), atomic"
    )
    args = parser.parse_args()
    from pdflash.models import fused_moe_triton as kernels
    from pdflash.models.compressed_gemm import pick_block_m
    from pdflash.models.offload import sort_rows

    rows_out: list[dict[str, Any]] = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for width in (int(w) for w in args.widths.split(",")):
        k = 4 if width <= 32 else 8
        for n in (int(r) for r in args.rows.split(",")):
            ids = torch.randint(0, width, (n,), device="cuda", generator=g)
            keys = torch.randperm(width, device="cuda", generator=g)
            block_m = pick_block_m(n, width)
            rows = sort_rows(keys[ids], width, k)
            for order in args.orders.split(","):
                ordered = order == "ordered"
                if not kernels.row_plan_fits(n, width, ordered=ordered):
                    continue
                for warps in (int(w) for w in args.warps.split(",")):
                    for cells in (int(c) for c in args.cells.split(",")):
                        plan = partial(
                            kernels.row_plan, ids, keys, width, k, block_m, width,
                            chunk_cells=cells, num_warps=warps, ordered=ordered,
                        )  # fmt: skip
                        got = plan()
                        place = got.position.long()
                        keys_at = torch.empty_like(place)
                        keys_at[place] = keys[ids]
                        ok = torch.equal(keys_at, rows.key_sorted()) and torch.equal(
                            got.token.long()[place], torch.arange(n, device="cuda") // k
                        )
                        if ordered:  # the stable order exactly
                            ok = ok and torch.equal(place, rows.position)
                        us = _graph_us(plan)
                        rows_out.append(
                            {"order": order, "width": width, "rows": n, "warps": warps,
                             "cells": cells, "us": us, "ok": ok}
                        )  # fmt: skip
                        print(f"{order:8s} width {width:4d} rows {n:5d} warps {warps:2d} "
                              f"cells {cells:6d}: {us:7.2f} us {'ok' if ok else 'WRONG'}",
                              flush=True)  # fmt: skip
    best: dict[str, dict[str, Any]] = {}
    for r in rows_out:
        key = f"{r['order']} {r['width']}x{r['rows']}"
        if r["ok"] and (key not in best or r["us"] < best[key]["us"]):
            best[key] = r
    print("best:", json.dumps(best))
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows_out, "best": best}, f)
    return 0 if all(r["ok"] for r in rows_out) else 1


if __name__ == "__main__":
    sys.exit(main())
