"""``pdflash-bench scale``: SIMULATED tokens/s of measured single-GPU rows on
N expert-parallel GPUs (issue 18). Reads rows files (``rows.jsonl`` of
``engine --out`` or the matrix), writes one simulated row per (row, N) and a
table; every output row says ``"simulated": true``. The model and its stated
parameters: :mod:`pdflash.distributed.simulate`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from . import _common as common

HELP = "SIMULATED multi-GPU scaling of measured single-GPU rows (expert parallelism)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("rows", nargs="+", type=Path, help="rows .jsonl files (measured, 1 GPU)")
    parser.add_argument("--gpus", type=common.positive_ints("--gpus"), default=[1, 2, 4])
    parser.add_argument("--baselines", default="PD", help="comma-separated (default PD)")
    parser.add_argument("--arch", default=None, help="only rows of this arch")
    parser.add_argument("--cache-fraction", type=float, default=None, help="only rows of this one")
    parser.add_argument("--concurrency", type=common.positive_ints("--concurrency"), default=None)
    parser.add_argument("--interconnect", default="nvlink", choices=["nvlink", "pcie"])
    parser.add_argument("--peer-gbps", type=float, default=None, help="override the profile's")
    parser.add_argument("--latency-us", type=float, default=None, help="override the profile's")
    parser.add_argument("--imbalance", type=float, default=1.0)
    parser.add_argument("--moe-compute-share", type=float, default=0.0)
    parser.add_argument(
        "--bytes-model", default="same_bytes", choices=["same_bytes", "aggregate_cache"]
    )
    parser.add_argument(
        "--hidden-size", type=int, default=None, help="for shapes the model's table lacks"
    )
    parser.add_argument("--out", type=Path, default=None, help="write OUT.jsonl and OUT.md")


def _rows(paths: list[Path]) -> list[dict[str, Any]]:
    from pdflash.report.writers import read_jsonl

    return [row for path in paths for row in read_jsonl(path)]


def _table(sim: list[dict[str, Any]]) -> str:
    lines = [
        "SIMULATED (not measured): pdflash.distributed.simulate on measured 1-GPU rows",
        "",
        "| arch | baseline | c | cache/GPU | GPUs | measured tok/s (1 GPU) | simulated tok/s "
        "| speedup | link s/rank | all-to-all share |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sim:
        if "not_simulated" in r:
            tps = speed = link = share = f"not simulated: {r['not_simulated']}"
        else:
            tps = f"{r['simulated_tokens_per_s_low']:.1f}-{r['simulated_tokens_per_s_high']:.1f}"
            speed = f"{r['simulated_speedup_low']:.2f}-{r['simulated_speedup_high']:.2f}x"
            link = f"{r['simulated_link_busy_s_per_rank']:.3f}"
            share = f"{r['simulated_all_to_all_share']:.3f}"
        measured = r["measured_tokens_per_s_1gpu"]
        lines.append(
            f"| {r['arch']} | {r['baseline']} | {r['concurrency']} | "
            f"{r['cache_fraction_per_gpu']} | {r['gpus']} | "
            f"{'null' if measured is None else f'{measured:.1f}'} | {tps} | {speed} | {link} "
            f"| {share} |"
        )
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pdflash.distributed.simulate import ScaleParams, simulate_row

    params = ScaleParams(
        interconnect=args.interconnect,
        peer_gbps=args.peer_gbps,
        latency_s=None if args.latency_us is None else args.latency_us * 1e-6,
        imbalance=args.imbalance,
        moe_compute_share=args.moe_compute_share,
        bytes_model=args.bytes_model,
        hidden_size=args.hidden_size,
    )
    params.resolved()  # bad parameters fail before any work
    rows = _rows(args.rows)
    baselines = {b.strip() for b in args.baselines.split(",") if b.strip()}
    picked = [
        r
        for r in rows
        if r.get("baseline") in baselines
        and int(r.get("gpus", 1)) == 1
        and (args.arch is None or r.get("arch") == args.arch)
        and (args.cache_fraction is None or r.get("cache_fraction") == args.cache_fraction)
        and (args.concurrency is None or r.get("concurrency") in args.concurrency)
    ]
    if not picked:
        raise SystemExit("no measured single-GPU row matches the filters")
    sim = [simulate_row(r, n, params, rows) for r in picked for n in args.gpus]
    table = _table(sim)
    print(table, file=sys.stderr)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        Path(f"{args.out}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sim))
        Path(f"{args.out}.md").write_text(table)
    return {"suite": "scale", "simulated": True, "rows": sim, "table": table}
