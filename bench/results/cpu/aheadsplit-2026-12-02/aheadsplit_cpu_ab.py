"""PD vs PD+host vs PD+host splitting the stream's copies
(``host_ahead_from=stream``) on CPU with an emulated link: the small gpt_oss
shape (32 experts, top-4, 8 layers), cache 0.2, c=4, arms interleaved and
rotated each repeat. Relative figures only (the model and the host pool
share this machine's cores; the link is a throttled memcpy). Writes
rows.jsonl and prints a table: per arm the medians of tokens/s, expert
copies per run, host-served experts, the host share of misses (served /
(served + copies)), link bytes per committed token, the exposed-fetch,
link-busy and host-busy shares of the wall, and the lookahead layers split.

    python bench/results/cpu/aheadsplit-2026-12-02/aheadsplit_cpu_ab.py --out DIR \
        [--link-gbps 0.5] [--repeats 4] [--concurrency 4] [--cache 0.2] \
        [--max-new-tokens 24] [--ahead-exposed F]

``--ahead-exposed`` sets the engine's gate on planning ahead
(``RunSpec.host_ahead_min_exposed``, default 0.2: plan ahead only while forwards
waited for misses at least that share of the time) for every arm; 0 plans
ahead before every verify (the split's mechanism without the gate).
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
    ("host", "PD+host", {}),
    ("split", "PD+host", {"host_ahead_from": "stream"}),
]


def _summary(row: dict[str, Any]) -> dict[str, Any]:
    hs = row.get("host_service") or {}
    nb = float(row["expert_nbytes"])
    wall = float(row["wall_s"])
    copies = row["h2d_bytes"] / nb
    served = row.get("host_served_experts")
    return {
        "tok_s": row["output_tokens_per_s"],
        "copies": copies,
        "host_served": served,
        "host_share": None if served is None else served / max(1.0, served + copies),
        "mb_per_token": None
        if row.get("bytes_per_token") is None
        else row["bytes_per_token"] / 1e6,
        "exposed_share": row["exposed_fetch_s"] / wall,
        "link_busy": row["link_busy_s"] / wall,
        "host_busy": (row.get("host_busy_s") or 0.0) / wall,
        "planned_ahead": row.get("host_planned_ahead_experts"),
        "lookahead_split": (hs.get("lookahead_split") or {}).get("layers"),
        "lookahead_planned": (hs.get("lookahead_split") or {}).get("planned"),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--link-gbps", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--cache", type=float, default=0.2)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--host-threads", type=int, default=1)
    ap.add_argument("--ahead-exposed", type=float, default=None)
    a = ap.parse_args()
    gate: dict[str, Any] = (
        {} if a.ahead_exposed is None else {"host_ahead_min_exposed": a.ahead_exposed}
    )
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
                    **gate,
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
    keys = (
        "copies",
        "host_served",
        "host_share",
        "mb_per_token",
        "exposed_share",
        "link_busy",
        "host_busy",
        "planned_ahead",
        "lookahead_split",
        "lookahead_planned",
    )
    print("\narm   n  tok/s median [min, max]  " + "  ".join(keys))
    for name, _, _ in ARMS:
        got = [_summary(r) for r in rows if r["arm"] == name]
        if not got:
            continue
        tps = [g["tok_s"] for g in got]

        def med(key: str, got: list[dict[str, Any]] = got) -> Any:
            vals = [g[key] for g in got if g[key] is not None]
            return round(statistics.median(vals), 3) if vals else None

        print(
            f"{name:5s} {len(got)}  {statistics.median(tps):7.2f} [{min(tps):.2f}, {max(tps):.2f}]  "
            + "  ".join(str(med(k)) for k in keys)
        )
    by = {(r["arm"], r["repeat"]): r["output_tokens_per_s"] for r in rows}
    for num, den in (("host", "PD"), ("split", "PD"), ("split", "host")):
        pairs = [
            by[(num, rep)] / by[(den, rep)]
            for rep in range(a.repeats)
            if (num, rep) in by and (den, rep) in by
        ]
        if pairs:
            print(f"{num}/{den} per-repeat ratios {[round(x, 3) for x in pairs]}")


if __name__ == "__main__":
    main()
