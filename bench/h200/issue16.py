"""Issue 16 on the H200: tokens/s of PD+host (hybrid miss service) vs PD.

Runs :func:`pdflash.bench.engine_run.run_spec` in one process for every
(arch, cache fraction, concurrency, baseline, repeat): gpt-oss-20b and
Qwen3-30B-A3B shapes truncated to ``--layers`` (8 by default) MoE layers,
synthetic bf16 weights (``--synthetic-format mxfp4``: gpt-oss MXFP4 experts,
kept MXFP4 in host memory and over the link unless ``--expert-dtype
dense``), forced acceptance, block 16. The host computes from the weight
format ``--host-format`` (default ``auto``: timed at start-up; the chosen
format and every candidate's time are in each PD+host row and the summary).

``--diag`` first times the host executor against the memory-bound floor and
the bare MLP on the first arch's own experts (``bench/h200/diag_host_experts.py``,
sections ``--diag-sections``, default ``paths``: the executor's paths, cold,
over ``--diag-bytes`` of experts, and on CUDA under a concurrent H2D copy;
its summary is in the summary's ``diag``). Repeats are interleaved
(repeat-major; PD and PD+host alternate which goes first), one arch after the
other (the packed host experts of one arch are reused across its runs).

torch's intra-op threads are process-wide: they are set once to
``--host-threads`` before the first run, so PD and PD+host run with the same
setting; the host pool has ``--host-workers`` threads. Both are recorded.

Writes ``OUT/rows.jsonl`` (every row as it finishes) and ``OUT/summary.json``
(per point: median tokens/s and 95% intervals of each baseline, the speedup,
bytes per token before/after the split, the host's share of the misses, the
busy fractions of the three resources and which one binds); the summary is
also the last line on stdout. ``--budget-s`` stops starting runs; the summary
says how many repeats each point got.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306}


def interval(values: list[float]) -> dict[str, Any]:
    """Median, min/max and a t-based 95% interval of the mean."""
    if not values:
        return {"n": 0}
    out: dict[str, Any] = {
        "n": len(values),
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "values": values,
    }
    if len(values) >= 2:
        mean = statistics.fmean(values)
        half = T975.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))
        out["mean_ci95"] = [mean - half, mean + half]
    return out


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _median(rows: list[dict[str, Any]], name: str) -> float | None:
    vals = [v for v in (_num(r.get(name)) for r in rows) if v is not None]
    return statistics.median(vals) if vals else None


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    points: dict[tuple[Any, ...], dict[str, list[dict[str, Any]]]] = {}
    for r in rows:
        key = (r["arch"], r["cache_fraction"], r["concurrency"])
        points.setdefault(key, {}).setdefault(r["baseline"], []).append(r)
    out = []
    for (arch, cf, conc), by in sorted(points.items()):
        pd, host = by.get("PD", []), by.get("PD+host", [])
        tps = {
            b: interval(
                [v for v in (_num(r.get("output_tokens_per_s")) for r in rs) if v is not None]
            )
            for b, rs in by.items()
        }
        entry: dict[str, Any] = {
            "arch": arch,
            "cache_fraction": cf,
            "concurrency": conc,
            "tokens_per_s": tps,
        }
        a, b = tps.get("PD", {}), tps.get("PD+host", {})
        if a.get("n") and b.get("n"):
            entry["speedup_median"] = b["median"] / a["median"]
        if "mean_ci95" in a and "mean_ci95" in b:
            lo_a, hi_a = a["mean_ci95"]
            lo_b, hi_b = b["mean_ci95"]
            entry["verdict"] = (
                "PD+host faster"
                if lo_b > hi_a
                else ("PD+host slower" if hi_b < lo_a else "within noise")
            )
        elif a.get("n") and b.get("n"):
            # one run on a side has no interval: no verdict either way
            entry["verdict"] = "too few runs"
        bpt_pd, bpt_host = _median(pd, "bytes_per_token"), _median(host, "bytes_per_token")
        entry["bytes_per_token"] = {"PD": bpt_pd, "PD+host": bpt_host}
        if bpt_pd and bpt_host is not None:
            entry["bytes_per_token_ratio"] = bpt_host / bpt_pd
        if host:
            nbytes = float(host[0]["expert_nbytes"])
            served = _median(host, "host_served_experts") or 0.0
            copied = (_median(host, "h2d_bytes") or 0.0) / nbytes
            busy = {
                "compute": _median(host, "compute_busy_s"),
                "link": _median(host, "link_busy_s"),
                "host_cpu": _median(host, "host_busy_s"),
            }
            wall = _median(host, "wall_s") or float("nan")
            frac = {k: (v / wall if v is not None else None) for k, v in busy.items()}
            known = {k: v for k, v in frac.items() if v is not None}
            entry["pd_host"] = {
                "host_served_experts": served,
                "host_share_of_misses": served / (served + copied) if served + copied else None,
                "link_bytes_saved_per_token": _median(host, "link_bytes_saved_per_token"),
                "host_wait_s": _median(host, "host_wait_s"),
                "busy_fraction": frac,
                "binding_resource": max(known, key=lambda k: known[k]) if known else None,
                "cpu_is_bottleneck": bool(known)
                and max(known, key=lambda k: known[k]) == "host_cpu",
                "eta": _median(host, "eta"),
                "eta_phys": _median(host, "eta_phys"),
            }
        if pd:
            wall = _median(pd, "wall_s") or float("nan")
            entry["pd"] = {
                "busy_fraction": {
                    "compute": (_median(pd, "compute_busy_s") or 0.0) / wall,
                    "link": (_median(pd, "link_busy_s") or 0.0) / wall,
                },
                "eta": _median(pd, "eta"),
                "eta_phys": _median(pd, "eta_phys"),
            }
        out.append(entry)
    return out


def run_diag(args: argparse.Namespace, arch: str) -> dict[str, Any]:
    """The executor diagnostic on ``arch``'s target, loaded as the runs load
    it (so they reuse it)."""
    from pdflash.bench.engine_run import (
        RunSpec,
        load_target,
        resolve_device,
        synthetic_paths,
    )

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from diag_host_experts import diagnose  # type: ignore[import-not-found]

    spec = RunSpec(
        arch=arch,
        baseline="PD",
        layers=args.layers or None,
        synthetic_format=args.synthetic_format,
        expert_dtype=args.expert_dtype,
    )
    device = resolve_device(spec.device)
    t0 = time.perf_counter()
    path, _, dtype = synthetic_paths(spec, device)
    ad = load_target(path, device, dtype, spec.expert_dtype)
    load_s = time.perf_counter() - t0
    # cold: walk more expert bytes than the CPU's last-level cache holds
    experts = args.diag_experts or max(8, math.ceil(args.diag_bytes / ad.store.expert_nbytes))
    out = diagnose(
        ad,
        tokens=[1, 4, 16],
        formats=["packed", "out_in", "onednn", "fp32_out_in"],
        experts=experts,
        repeats=3,
        sections=[s for s in args.diag_sections.split(",") if s],
        link_load=device.type == "cuda",
        head={"arch": arch, "layers": args.layers, "load_s": round(load_s, 1)},
    )
    print(
        f"[issue16] diag done in {time.perf_counter() - t0:.0f}s (load {load_s:.0f}s)",
        file=sys.stderr,
        flush=True,
    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", default="gpt-oss-20b,qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=8, help="MoE layers (0: the shape's own)")
    ap.add_argument("--cache", default="0.2,0.5")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument(
        "--points",
        default="",
        help="explicit cache:concurrency pairs, e.g. 0.5:1,0.2:4 (instead of --cache x --concurrency)",
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--host-threads", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    ap.add_argument("--host-workers", type=int, default=1)
    ap.add_argument("--host-max-ratio", type=float, default=1.5)
    ap.add_argument("--host-max-tokens", type=int, default=16, help="0: no cap")
    ap.add_argument("--host-format", default="auto")
    ap.add_argument(
        "--host-critical-path",
        action="store_true",
        help="the planner judges the forward's critical path (RunSpec.host_critical_path)",
    )
    ap.add_argument(
        "--host-handoff",
        default="thread",
        choices=("thread", "stream"),
        help="how HOST outputs reach the device stream (RunSpec.host_handoff)",
    )
    ap.add_argument(
        "--host-affinity",
        default="off",
        choices=("off", "auto"),
        help="where the host pool's threads run (RunSpec.host_affinity)",
    )
    ap.add_argument(
        "--host-ahead",
        default="certain",
        choices=("certain", "weighted"),
        help="how the pre-verify host plan treats a predicted expert (RunSpec.host_ahead)",
    )
    ap.add_argument("--synthetic-format", default=None, choices=(None, "mxfp4"))
    ap.add_argument("--expert-dtype", default=None, choices=(None, "dense"))
    ap.add_argument("--diag", action="store_true", help="time the executor first")
    ap.add_argument("--diag-experts", type=int, default=0, help="0: --diag-bytes' worth")
    ap.add_argument("--diag-bytes", type=float, default=1.6e9, help="expert bytes walked cold")
    ap.add_argument("--diag-sections", default="paths", help="diag_host_experts.py --sections")
    ap.add_argument("--budget-s", type=float, default=250.0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    import torch
    from pdflash.bench.engine_run import RunSpec, release_targets, run_spec

    args.out.mkdir(parents=True, exist_ok=True)
    rows_path = args.out / "rows.jsonl"
    torch.set_num_threads(args.host_threads)
    archs = [a for a in args.archs.split(",") if a]
    caches = [float(c) for c in args.cache.split(",")]
    concs = [int(c) for c in args.concurrency.split(",")]
    points = [(cf, conc) for cf in caches for conc in concs]
    if args.points:
        points = [
            (float(p.split(":")[0]), int(p.split(":")[1])) for p in args.points.split(",") if p
        ]
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    cut = 0
    diag: dict[str, Any] | None = None
    if args.diag and archs:
        try:
            diag = run_diag(args, archs[0])
        except Exception as exc:  # the runs matter more: report and go on
            diag = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"[issue16] diag FAILED: {exc}", file=sys.stderr, flush=True)
    for ai, arch in enumerate(archs):
        # each arch may use its share of what is left of the budget
        arch_deadline = started + args.budget_s * (ai + 1) / len(archs)
        for rep in range(args.repeats):
            for cf, conc in points:
                order = ["PD", "PD+host"] if (rep + conc) % 2 == 0 else ["PD+host", "PD"]
                for baseline in order:
                    if time.perf_counter() > arch_deadline:
                        cut += 1
                        continue
                    spec = RunSpec(
                        arch=arch,
                        baseline=baseline,
                        block_size=16,
                        concurrency=conc,
                        cache_fraction=cf,
                        repeat=rep,
                        layers=args.layers or None,
                        max_new_tokens=args.max_new_tokens,
                        prompt_len=args.prompt_len,
                        host_threads=args.host_threads,
                        host_workers=args.host_workers,
                        host_max_ratio=args.host_max_ratio,
                        host_max_tokens=args.host_max_tokens,
                        host_format=args.host_format,
                        host_critical_path=args.host_critical_path,
                        host_handoff=args.host_handoff,
                        host_affinity=args.host_affinity,
                        host_ahead=args.host_ahead,
                        synthetic_format=args.synthetic_format,
                        expert_dtype=args.expert_dtype,
                    )
                    t0 = time.perf_counter()
                    try:
                        row = run_spec(spec).row
                    except Exception as exc:  # one failure must not lose the rest
                        errors.append({"spec": vars(spec), "error": f"{type(exc).__name__}: {exc}"})
                        print(
                            f"[issue16] FAILED {arch} {baseline} cf{cf} c{conc} r{rep}: {exc}",
                            file=sys.stderr,
                            flush=True,
                        )
                        continue
                    row["run_elapsed_s"] = time.perf_counter() - t0
                    rows.append(row)
                    with rows_path.open("a") as f:
                        f.write(json.dumps(row, default=str) + "\n")
                    print(
                        f"[issue16] {arch} {baseline} cf{cf} c{conc} r{rep}: "
                        f"tok/s={row['output_tokens_per_s']:.1f} "
                        f"B/tok={row.get('bytes_per_token') or 0:.3g} "
                        f"host={row.get('host_served_experts')} "
                        f"({time.perf_counter() - t0:.1f}s, total {time.perf_counter() - started:.0f}s)",
                        file=sys.stderr,
                        flush=True,
                    )
        release_targets()
    calibrations = {
        r["arch"]: (r.get("host_service") or {}).get("calibration")
        for r in rows
        if r["baseline"] == "PD+host"
    }
    host_weights = {
        r["arch"]: (r.get("host_service") or {}).get("host_weights")
        for r in rows
        if r["baseline"] == "PD+host"
    }
    # per PD+host run: what the planner started from and ended with
    host_runs = []
    for r in rows:
        hs = r.get("host_service") or {}
        if r["baseline"] != "PD+host" or not hs:
            continue
        cal = hs.get("calibration") or {}
        hw = hs.get("host_weights") or {}
        host_runs.append(
            {
                "concurrency": r["concurrency"],
                "cache_fraction": r["cache_fraction"],
                "repeat": r["repeat"],
                "tokens_per_s": r.get("output_tokens_per_s"),
                "host_served_experts": r.get("host_served_experts"),
                "calibration_points": cal.get("points"),
                "calibration_spread": cal.get("spread"),
                "online_cost": hs.get("online_cost"),
                "planner_decisions": hs.get("planner_decisions"),
                "critical_path": hs.get("critical_path"),
                "copy_sampled": hs.get("copy_sampled_layers"),
                # the ahead plans' HOST experts: seen by their layers, routed, hosted
                "ahead_outcome": hs.get("ahead_outcome"),
                # the planner's routed fraction of those over the run
                "ahead_fraction": hs.get("ahead_fraction"),
                "host_part_on_fraction": ((r.get("pd_parts") or {}).get("on_fraction") or {}).get(
                    "host_experts"
                ),
                "host_weights_reused": hw.get("reused"),
            }
        )
    summary = {
        "suite": "issue16",
        "command": " ".join(sys.argv),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "cpu_count": os.cpu_count(),
        "torch_intra_op_threads": torch.get_num_threads(),
        "host_workers": args.host_workers,
        "host_max_ratio": args.host_max_ratio,
        "host_max_tokens": args.host_max_tokens,
        "host_format": args.host_format,
        "host_critical_path": args.host_critical_path,
        "host_handoff": args.host_handoff,
        "host_affinity": args.host_affinity,
        "host_ahead": args.host_ahead,
        "synthetic_format": args.synthetic_format,
        "expert_dtype": args.expert_dtype,
        "layers": args.layers,
        "max_new_tokens": args.max_new_tokens,
        "prompt_len": args.prompt_len,
        "repeats_requested": args.repeats,
        "runs": len(rows),
        "runs_not_started_budget": cut,
        "errors": errors,
        "elapsed_s": time.perf_counter() - started,
        "host_calibration": calibrations,
        "host_weights": host_weights,
        "host_runs": host_runs,
        "diag": diag,
        "points": summarise(rows),
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(json.dumps(summary, default=str))
    return 1 if errors or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
