"""``pdflash-bench`` with no arguments: the embedded default benchmark.

A tiny synthetic MoE model, every baseline (B0 B1 B2 B3 PD) at concurrency 1
and 4, on the GPU if there is one, otherwise on the CPU with the host copy
backend throttled to an emulated PCIe link. Shows progress bars, prints a
result table and the verdict, and writes rows (JSONL), the report (JSON, CSV,
Markdown) and PNG plots into a results folder it names.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from . import _common as common
from . import matrix

HELP = "the default benchmark: tiny synthetic model, all baselines, concurrency 1 and 4"

#: The CPU stand-in for PCIe: the host backend copies at this rate (GB/s).
#: NOTE: low on purpose. The tiny model's experts are a few KB while a CPU
#: forward costs milliseconds, so at a PCIe-like rate every baseline would be
#: compute-bound and the copy link would never matter; 50 MB/s makes expert
#: copies a visible share of the run while the engine's per-run link probe
#: (32 MiB through the issuer) stays near a second.
CPU_EMULATED_LINK_GBPS = 0.05

#: Set (to anything but 0) to make a bare ``pdflash-bench`` run ``--quick``.
QUICK_ENV = "PDFLASH_BENCH_QUICK"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="results folder (default pdflash-bench-results/<UTC>)",
    )
    parser.add_argument(
        "--quick", action="store_true", help=f"a much smaller run (smoke test); also ${QUICK_ENV}=1"
    )
    parser.add_argument("--concurrency", type=common.positive_ints("--concurrency"), default=[1, 4])
    parser.add_argument("--cache-fraction", type=common.fractions, default=[0.25])
    parser.add_argument("--device", default="auto", help="auto (GPU if present), cpu or cuda")
    parser.add_argument(
        "--emulated-link-gbps",
        type=float,
        default=None,
        help=f"host-backend link rate on CPU (default {CPU_EMULATED_LINK_GBPS} GB/s)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def _cuda_present(device: str) -> bool:
    if device == "cpu":
        return False
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return bool(torch.cuda.is_available())


def default_specs(args: argparse.Namespace, on_gpu: bool) -> list[dict[str, Any]]:
    """The default matrix: tiny synthetic, all baselines, the given concurrencies."""
    link = args.emulated_link_gbps
    if link is None and not on_gpu:
        link = CPU_EMULATED_LINK_GBPS
    ns = argparse.Namespace(
        arch=["tiny"],
        weights="synthetic",
        draft="synthetic",
        seed=0,
        slo=2.0 if not args.quick else 5.0,
        layers=None,
        # NOTE: sized for < 3 minutes on a 2-core CPU; --quick for tests
        num_requests=None,
        prompt_len=16 if args.quick else 32,
        max_new_tokens=8 if args.quick else 96,
        device="cuda" if on_gpu else "cpu",
        emulated_link_gbps=link,
        acceptance="auto",
        mean_tau=None,
        eviction="auto",
        block_sizes=[8 if args.quick else 16],
        concurrency=args.concurrency,
        cache_fraction=args.cache_fraction,
        baselines=["B0", "B1", "B2", "B3", "PD"],
        repeats=1,
    )
    specs = matrix.plan(ns)
    for spec in specs:
        spec["num_requests"] = spec["concurrency"] * (1 if args.quick else 4)
    return specs


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pdflash.report import load_rows, write_report
    from pdflash.report.writers import rows_table

    if os.environ.get(QUICK_ENV, "") not in ("", "0"):
        args.quick = True

    on_gpu = _cuda_present(args.device)
    out = Path(args.out or Path("pdflash-bench-results") / common.utc_stamp())
    specs = default_specs(args, on_gpu)
    where = (
        "GPU"
        if on_gpu
        else f"CPU (host copy backend at {specs[0]['emulated_link_gbps']} GB/s emulated link)"
    )
    print(f"pdflash-bench default: tiny synthetic model, {len(specs)} runs on {where}")
    print(f"results folder: {out}")
    summary = matrix.run_matrix(specs, out, show_progress=not args.no_progress)
    rows = load_rows(out / matrix.ROWS_FILE) if (out / matrix.ROWS_FILE).exists() else []
    command = "pdflash-bench" + (" --quick" if args.quick else "")
    if args.out is not None:
        command += f" --out {args.out}"
    evaluation = write_report(rows, out, title="pdflash-bench default", command=command)
    print()
    print(rows_table(rows))
    print()
    verdict = evaluation["verdict"]
    print(f"verdict: {verdict['label']} — {verdict['reasons'][0] if verdict['reasons'] else ''}")
    if evaluation["problems"]:
        print(f"{len(evaluation['problems'])} validation problem(s); see {out / 'report.md'}")
    print(
        f"wrote {', '.join(sorted(Path(p).name for p in evaluation['files'].values()))} into {out}"
    )
    return {
        "out": str(out),
        "device": "cuda" if on_gpu else "cpu",
        "runs": summary["ran"],
        "failed": summary["failed"],
        "valid": evaluation["valid"],
        "verdict": verdict["label"],
        "files": evaluation["files"],
        "elapsed_s": summary["elapsed_s"],
        # a failed run or invalid rows fail the command; a NO-GO verdict does not
        "exit_code": 1 if summary["failed"] or not rows or not evaluation["valid"] else 0,
    }
