"""``pdflash-bench`` with no arguments: the embedded default benchmark.

A tiny synthetic MoE model, every baseline (B0 B1 B2 B3 PD) at concurrency 1
and 4, on the GPU if there is one, otherwise on the CPU with the host copy
backend throttled to an emulated PCIe link. Shows progress bars, prints a
result table and the verdict, and writes rows (JSONL), the report (JSON, CSV,
Markdown) and PNG plots into a results folder it names.

The workload makes PD's scheduler decide (issue 15): at concurrency ``c``,
``2c`` requests are live (``max_running``) while a verify step takes ``c``
blocks (the token budget), and PD's byte budget M is the bytes the link
moves while one verify computes (``byte_budget_from="verify"``); on the CPU
the emulated link is slow enough that M is below a step's missing expert
bytes. The suite prints how often PD's 2-D batch differed from the one the
token-only scheduler would have chosen.
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
#: NOTE: low on purpose. The tiny model's experts are 6 KB (16 of them, 98
#: KB) while a CPU verify costs milliseconds, so at a PCIe-like rate every
#: baseline would be compute-bound and the copy link would never matter. At
#: 10 MB/s, M = link x verify compute (5-7 ms on a 2-core CPU) is 50-70 KB:
#: about the missing experts of one step, so the byte budget binds (at 50
#: MB/s M exceeded every expert's bytes). The engine's link probe shrinks to
#: a quarter second on an emulated link.
CPU_EMULATED_LINK_GBPS = 0.01

#: Live requests per unit of concurrency: ``max_running = 2c`` while a
#: verify step takes ``c`` blocks (token budget ``c x block``), so the
#: scheduler chooses which half verifies.
LIVE_PER_CONCURRENCY = 2

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
    parser.add_argument(
        "--marginal-rule",
        default="verify",
        choices=["off", "verify"],
        help="PD's marginal rule (M soft against shared experts; off: M hard, the rule before)",
    )


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
        conc = spec["concurrency"]
        spec["num_requests"] = conc * (2 if args.quick else 4)
        # the scheduler must decide: more live requests than a step takes,
        # and M from the step (see the module docstring)
        spec["max_running"] = LIVE_PER_CONCURRENCY * conc
        spec["byte_budget_from"] = "verify"
        marginal_rule = getattr(args, "marginal_rule", "verify")
        if marginal_rule != "verify":
            spec["marginal_rule"] = marginal_rule
    return specs


def _marginal(row: dict[str, Any]) -> str:
    """How hard M was: the marginal rule's F, or M hard."""
    from pdflash.report.writers import fmt

    fixed = row.get("fixed_step_bytes")
    if fixed is None:
        return "M hard"
    return f"M soft against shared experts (marginal rule, F = {fmt(fixed)} B)"


def scheduler_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One line per PD row: the limits that bind and how often the 2-D batch
    differed from the token-only scheduler's choice."""
    from pdflash.report.writers import fmt

    out = []
    for r in rows:
        if r.get("baseline") != "PD":
            continue
        frac = r.get("token_only_differing_step_fraction")
        if frac is None:
            why = (r.get("not_measured") or {}).get("token_only_differing_step_fraction", "")
            out.append(f"PD c={r.get('concurrency')}: 2-D vs token-only not measured ({why})")
            continue
        out.append(
            f"PD c={r.get('concurrency')}: {r.get('max_running')} live requests, a step takes "
            f"{r.get('token_budget')} tokens (blocks of {r.get('block_size')}); M = "
            f"{fmt(r.get('byte_budget'))} B (link x verify compute "
            f"{fmt(r.get('byte_budget_verify_compute_s'), 3)} s), "
            + _marginal(r)
            + ": the 2-D batch differed from "
            f"the token-only one in {100 * frac:.0f}% of {r.get('steps')} steps (predicted "
            f"missing bytes {fmt(r.get('batch_missing_bytes_2d'))} vs "
            f"{fmt(r.get('batch_missing_bytes_token_only'))})" + _executed(r)
        )
    return out


def _executed(row: dict[str, Any]) -> str:
    """How often the PD controller ran the 2-D batch and route-ahead, and
    its switches."""
    parts = row.get("pd_parts")
    if not isinstance(parts, dict):
        return ""
    frac = (parts.get("on_fraction") or {}).get("scheduler_2d")
    if frac is None:
        return ""
    switched = [
        f"{d['part']} {'on' if d['on'] else 'off'} at step {d['step']}"
        for d in parts.get("decisions") or []
        if d.get("switched")
    ]
    route = (parts.get("on_fraction") or {}).get("route_ahead")
    route_text = "" if route is None else f", route-ahead in {100 * route:.0f}%"
    return (
        f"; the PD controller executed the 2-D batch in {100 * frac:.0f}% of steps"
        f"{route_text} (switched: {', '.join(switched) if switched else 'nothing'})"
    )


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
    binds = scheduler_lines(rows)
    for line in binds:
        print(line)
    if binds:
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
        "scheduler": binds,
        # a failed run or invalid rows fail the command; a NO-GO verdict does not
        "exit_code": 1 if summary["failed"] or not rows or not evaluation["valid"] else 0,
    }
