"""PD vs PD+host (makespan) vs PD+host (lag) on CPU with an emulated link:
the small gpt_oss shape (32 experts, top-4, 8 layers), cache 0.2, c=4,
arms interleaved and rotated each repeat. Relative figures only (the model
and the host pool share this machine's cores; the link is a throttled
memcpy). Writes rows.jsonl and prints a table.

    python bench/results/cpu/hostshare-2026-12-02/cpu_ab.py --out DIR \
        [--link-gbps 2] [--repeats 3] [--concurrency 4] [--cache 0.2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from pdflash.bench.engine_run import RunSpec, run_spec

ARMS: list[tuple[str, str, dict[str, Any]]] = [
    ("PD", "PD", {}),
    ("host", "PD+host", {"host_plan": "makespan"}),
    ("lag", "PD+host", {"host_plan": "lag"}),
]


def _summary(row: dict[str, Any]) -> dict[str, Any]:
    hs = row.get("host_service") or {}
    planner = hs.get("planner") or {}
    nb = float(row["expert_nbytes"])
    wall = float(row["wall_s"])
    return {
        "tok_s": row["output_tokens_per_s"],
        "copies": row["h2d_bytes"] / nb,
        "route_ahead_copies": row["route_ahead_bytes_submitted"] / nb,
        "host_served": row.get("host_served_experts"),
        "planned_ahead": row.get("host_planned_ahead_experts"),
        "exposed_share": row["exposed_fetch_s"] / wall,
        "link_busy": row["link_busy_s"] / wall,
        "host_busy": (row.get("host_busy_s") or 0.0) / wall,
        "host_on": (row.get("pd_parts") or {}).get("on_fraction", {}).get("host_experts"),
        "link_lag_ms": [round(x * 1e3, 2) for x in planner.get("link_lag_s") or []],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--link-gbps", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--cache", type=float, default=0.2)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--host-threads", type=int, default=1)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(a.host_threads)
    rows: list[dict[str, Any]] = []
    with (a.out / "rows.jsonl").open("a") as f:
        for rep in range(a.repeats):
            shift = rep % len(ARMS)
            for name, baseline, extra in ARMS[shift:] + ARMS[:shift]:
                spec = RunSpec(
                    arch="small-gpt_oss",
                    baseline=baseline,
                    concurrency=a.concurrency,
                    cache_fraction=a.cache,
                    repeat=rep,
                    prompt_len=16,
                    max_new_tokens=a.max_new_tokens,
                    emulated_link_gbps=a.link_gbps,
                    host_threads=a.host_threads,
                    host_workers=1,
                    **extra,
                )
                t0 = time.perf_counter()
                row = run_spec(spec).row
                row["arm"] = name
                f.write(json.dumps(row, default=str) + "\n")
                f.flush()
                rows.append(row)
                s = _summary(row)
                print(
                    f"r{rep} {name:5s} {time.perf_counter() - t0:5.1f}s {json.dumps(s)}", flush=True
                )
    print("\narm   n  tok/s median  [min, max]  copies  host_served  exposed  link  host")
    for name, _, _ in ARMS:
        got = [_summary(r) for r in rows if r["arm"] == name]
        if not got:
            continue
        tps = [g["tok_s"] for g in got]

        def med(key: str, got: list[dict[str, Any]] = got) -> Any:
            vals = [g[key] for g in got if g[key] is not None]
            return round(statistics.median(vals), 3) if vals else None

        print(
            f"{name:5s} {len(got)}  {statistics.median(tps):7.2f}  [{min(tps):.2f}, {max(tps):.2f}]"
            f"  {med('copies')}  {med('host_served')}  {med('exposed_share')}"
            f"  {med('link_busy')}  {med('host_busy')}"
        )
    pd = {r["repeat"]: r["output_tokens_per_s"] for r in rows if r["arm"] == "PD"}
    for name in ("host", "lag"):
        pairs = [
            r["output_tokens_per_s"] / pd[r["repeat"]]
            for r in rows
            if r["arm"] == name and r["repeat"] in pd
        ]
        if pairs:
            print(f"{name}/PD per-repeat ratios {[round(x, 3) for x in pairs]}")
    host = {r["repeat"]: r["output_tokens_per_s"] for r in rows if r["arm"] == "host"}
    pairs = [
        r["output_tokens_per_s"] / host[r["repeat"]]
        for r in rows
        if r["arm"] == "lag" and r["repeat"] in host
    ]
    if pairs:
        print(f"lag/host per-repeat ratios {[round(x, 3) for x in pairs]}")


if __name__ == "__main__":
    main()
