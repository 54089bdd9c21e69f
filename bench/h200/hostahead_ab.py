"""``--host-ahead`` certain vs weighted on the H200: tokens/s of PD, PD+host
with today's pre-verify plan (``certain``) and PD+host with the plan that
weights each predicted expert by its measured probability of being routed
(``weighted``; pdflash.hybrid.planner, "The ahead plan"), in one process,
interleaved.

Runs :func:`pdflash.bench.engine_run.run_spec` for every (repeat, point,
arm): gpt-oss-20b shape truncated to ``--layers`` MoE layers, synthetic
bf16 weights, forced acceptance, block 16; the arms are ``PD``,
``certain`` (PD+host, ``host_ahead="certain"``) and ``weighted`` (PD+host,
``host_ahead="weighted"``). Repeats are repeat-major; the arms' order
rotates each repeat and point. torch's intra-op threads are set once to
``--host-threads``, so every arm runs with the same setting.

Writes ``OUT/rows.jsonl`` (every row as it finishes, with ``ab_arm``) and
``OUT/summary.json`` (per point: median tokens/s and 95% intervals of each
arm, per-repeat ratios weighted/certain, weighted/PD and certain/PD with
their medians, verdicts from the intervals, and per arm the median host
served experts, planned-ahead experts, link bytes per token, wasted
prefetch bytes, busy fractions, the ahead plans' outcome summed over the
runs and the routed fraction each run ended with); the summary is also the
last line on stdout. ``--budget-s`` stops starting runs; the summary says
how many each point got.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from issue16 import interval  # type: ignore[import-not-found]  # bench/h200 is not a package

#: (arm, baseline, host_ahead)
ARMS: tuple[tuple[str, str, str], ...] = (
    ("PD", "PD", "certain"),
    ("certain", "PD+host", "certain"),
    ("weighted", "PD+host", "weighted"),
)
#: (numerator, denominator) arms of the per-repeat ratios and verdicts
PAIRS = (("weighted", "certain"), ("weighted", "PD"), ("certain", "PD"))


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _median_of(rows: list[dict[str, Any]], read: Any) -> float | None:
    vals = [v for v in (_num(read(r)) for r in rows) if v is not None]
    return statistics.median(vals) if vals else None


def _verdict(a: dict[str, Any], b: dict[str, Any], name_a: str) -> str:
    """``name_a`` faster / slower than the other arm where the 95% intervals
    do not overlap."""
    if "mean_ci95" not in a or "mean_ci95" not in b:
        return "too few runs"
    lo_a, hi_a = a["mean_ci95"]
    lo_b, hi_b = b["mean_ci95"]
    if lo_a > hi_b:
        return f"{name_a} faster"
    if hi_a < lo_b:
        return f"{name_a} slower"
    return "within noise"


def _service(r: dict[str, Any]) -> dict[str, Any]:
    hs = r.get("host_service")
    return hs if isinstance(hs, dict) else {}


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per point: the three arms (see the module doc)."""
    points: dict[tuple[float, int], dict[str, list[dict[str, Any]]]] = {}
    for r in rows:
        key = (r["cache_fraction"], r["concurrency"])
        points.setdefault(key, {}).setdefault(r["ab_arm"], []).append(r)
    out = []
    for (cf, conc), by in sorted(points.items()):
        tps = {
            arm: interval(
                [v for v in (_num(r.get("output_tokens_per_s")) for r in rs) if v is not None]
            )
            for arm, rs in by.items()
        }
        entry: dict[str, Any] = {"cache_fraction": cf, "concurrency": conc, "tokens_per_s": tps}
        per_rep = {
            (r["repeat"], arm): _num(r.get("output_tokens_per_s"))
            for arm, rs in by.items()
            for r in rs
        }
        reps = sorted({k[0] for k in per_rep})
        for num, den in PAIRS:
            ratios = [
                n / d
                for rep in reps
                if (d := per_rep.get((rep, den))) and (n := per_rep.get((rep, num))) is not None
            ]
            entry[f"pair_ratios_{num}_over_{den}"] = ratios
            entry[f"pair_ratio_median_{num}_over_{den}"] = (
                statistics.median(ratios) if ratios else None
            )
            entry[f"verdict_{num}_vs_{den}"] = _verdict(tps.get(num, {}), tps.get(den, {}), num)
        entry["by_arm"] = {
            arm: {
                "host_served_experts": _median_of(rs, lambda r: r.get("host_served_experts")),
                "host_planned_ahead_experts": _median_of(
                    rs, lambda r: r.get("host_planned_ahead_experts")
                ),
                "bytes_per_token": _median_of(rs, lambda r: r.get("bytes_per_token")),
                "h2d_bytes": _median_of(rs, lambda r: r.get("h2d_bytes")),
                "wasted_prefetch_bytes": _median_of(rs, lambda r: r.get("wasted_prefetch_bytes")),
                "host_wait_s": _median_of(rs, lambda r: r.get("host_wait_s")),
                # each resource's busy seconds over the run's wall, per run, then the median
                "busy_fraction": {
                    res: _median_of(
                        rs,
                        lambda r, key=key: (
                            r[key] / r["wall_s"]
                            if _num(r.get(key)) is not None and _num(r.get("wall_s"))
                            else None
                        ),
                    )
                    for res, key in (
                        ("compute", "compute_busy_s"),
                        ("link", "link_busy_s"),
                        ("host_cpu", "host_busy_s"),
                    )
                },
                # the ahead plans' HOST experts over the arm's runs: seen by
                # their layers, routed, hosted by the layer's own plan
                "ahead_outcome": {
                    k: sum(int((_service(r).get("ahead_outcome") or {}).get(k, 0)) for r in rs)
                    for k in ("seen", "routed", "hosted")
                },
                # the routed fraction each run's planner ended with (the
                # weighted arm's p; measured, not used, under certain)
                "ahead_fraction_end": [
                    (_service(r).get("ahead_fraction") or {}).get("value") for r in rs
                ],
                "host_ahead_recorded": sorted(
                    {str((_service(r).get("planner") or {}).get("ahead")) for r in rs}
                ),
            }
            for arm, rs in by.items()
        }
        out.append(entry)
    return out


def _fmt(x: Any, spec: str = ".2f") -> str:
    return "-" if _num(x) is None else format(x, spec)


def table(summary: dict[str, Any]) -> list[str]:
    """The compact table (the log's last lines): per point and arm the median
    tokens/s (runs), then the per-repeat ratio medians with their verdicts,
    and per PD+host arm the host served / planned-ahead experts, MB per
    token, link and host busy, the ahead outcome and the end fraction."""
    lines = [
        f"hostahead_ab: {summary.get('device')}, runs {summary.get('runs')}, not started "
        f"(budget) {summary.get('runs_not_started_budget')}, errors {len(summary.get('errors', []))}"
    ]
    for p in summary.get("points", []):
        tps = p.get("tokens_per_s", {})
        head = " | ".join(
            f"{arm} {_fmt(tps.get(arm, {}).get('median'), '.1f')} ({tps.get(arm, {}).get('n', 0)})"
            for arm, _, _ in ARMS
        )
        lines.append(f"cache {p['cache_fraction']} c={p['concurrency']}: {head}")
        for num, den in PAIRS:
            lines.append(
                f"  {num}/{den}: median {_fmt(p.get(f'pair_ratio_median_{num}_over_{den}'))} "
                f"({p.get(f'verdict_{num}_vs_{den}')})"
            )
        for arm in ("certain", "weighted"):
            b = (p.get("by_arm") or {}).get(arm)
            if not b:
                continue
            busy = b.get("busy_fraction") or {}
            bpt = _num(b.get("bytes_per_token"))
            fr = [f for f in b.get("ahead_fraction_end", []) if _num(f) is not None]
            lines.append(
                f"  {arm}: host {_fmt(b.get('host_served_experts'), '.0f')} "
                f"planned-ahead {_fmt(b.get('host_planned_ahead_experts'), '.0f')} "
                f"MB/tok {_fmt(None if bpt is None else bpt / 1e6, '.1f')} "
                f"link {_fmt(busy.get('link'))} host {_fmt(busy.get('host_cpu'))} "
                f"ahead {b.get('ahead_outcome')} "
                f"p_end {_fmt(statistics.median(fr) if fr else None)} "
                f"recorded {b.get('host_ahead_recorded')}"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--arch", default="gpt-oss-20b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--points", default="0.2:4,0.2:1", help="cache:concurrency,...")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--host-threads", type=int, default=14)
    ap.add_argument("--host-workers", type=int, default=1)
    ap.add_argument("--host-format", default="auto")
    ap.add_argument("--budget-s", type=float, default=130.0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    import torch
    from pdflash.bench.engine_run import RunSpec, release_targets, run_spec

    args.out.mkdir(parents=True, exist_ok=True)
    rows_path = args.out / "rows.jsonl"
    torch.set_num_threads(args.host_threads)
    points = [(float(p.split(":")[0]), int(p.split(":")[1])) for p in args.points.split(",") if p]
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    cut = 0
    for rep in range(args.repeats):
        for pi, (cf, conc) in enumerate(points):
            shift = (rep + pi) % len(ARMS)
            for arm, baseline, ahead in ARMS[shift:] + ARMS[:shift]:
                if time.perf_counter() - started > args.budget_s:
                    cut += 1
                    continue
                spec = RunSpec(
                    arch=args.arch,
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
                    host_format=args.host_format,
                    host_ahead=ahead,
                )
                t0 = time.perf_counter()
                try:
                    row = run_spec(spec).row
                except Exception as exc:  # one failure must not lose the rest
                    errors.append({"spec": vars(spec), "error": f"{type(exc).__name__}: {exc}"})
                    print(
                        f"[hostahead_ab] FAILED {arm} cf{cf} c{conc} r{rep}: {exc}",
                        file=sys.stderr,
                    )
                    continue
                row["ab_arm"] = arm
                row["run_elapsed_s"] = time.perf_counter() - t0
                rows.append(row)
                with rows_path.open("a") as f:
                    f.write(json.dumps(row, default=str) + "\n")
                frac = (_service(row).get("ahead_fraction") or {}).get("value")
                print(
                    f"[hostahead_ab] {arm} cf{cf} c{conc} r{rep}: "
                    f"tok/s={row['output_tokens_per_s']:.1f} host={row.get('host_served_experts')} "
                    f"ahead={_service(row).get('ahead_outcome')} p={frac} "
                    f"({time.perf_counter() - t0:.1f}s, total {time.perf_counter() - started:.0f}s)",
                    file=sys.stderr,
                    flush=True,
                )
    release_targets()
    summary = {
        "suite": "hostahead_ab",
        "command": " ".join(["bench/h200/hostahead_ab.py", *(argv or sys.argv[1:])]),
        "synthetic_weights": True,
        "forced_acceptance": True,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "arch": args.arch,
        "layers": args.layers,
        "max_new_tokens": args.max_new_tokens,
        "host_threads": args.host_threads,
        "host_workers": args.host_workers,
        "host_format": args.host_format,
        "repeats_requested": args.repeats,
        "runs": len(rows),
        "runs_not_started_budget": cut,
        "errors": errors,
        "elapsed_s": time.perf_counter() - started,
        "points": summarise(rows),
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    for line in table(summary):
        print(line, file=sys.stderr)
    print(json.dumps(summary, default=str))
    return 0 if rows and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
