"""``--host-affinity`` off vs auto on the H200: tokens/s of PD+host with the
host pool's threads placed apart from the engine's (auto) or left to the
scheduler (off), in one process, interleaved.

Runs :func:`pdflash.bench.engine_run.run_spec` for every (point, repeat,
setting): gpt-oss-20b shape truncated to ``--layers`` MoE layers, synthetic
bf16 weights, forced acceptance, block 16, PD+host only (both settings under
the PD controller, as in ``issue16.py``). Repeats are repeat-major and the
two settings alternate which goes first. torch's intra-op threads are set
once to ``--host-threads``.

Writes ``OUT/rows.jsonl`` (every row as it finishes) and ``OUT/summary.json``
(per point: median tokens/s and 95% intervals of each setting, the median
of the per-repeat ratios auto/off, a verdict from the intervals, and per
setting the median host wait, host share of the misses and the busy
fractions); the summary is also the last line on stdout. ``--budget-s``
stops starting runs; the summary says how many each point got.
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

SETTINGS = ("off", "auto")


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _median_of(rows: list[dict[str, Any]], read: Any) -> float | None:
    vals = [v for v in (_num(read(r)) for r in rows) if v is not None]
    return statistics.median(vals) if vals else None


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per point: off vs auto (see the module doc)."""
    points: dict[tuple[float, int], dict[str, list[dict[str, Any]]]] = {}
    for r in rows:
        key = (r["cache_fraction"], r["concurrency"])
        points.setdefault(key, {}).setdefault(r["ab_setting"], []).append(r)
    out = []
    for (cf, conc), by in sorted(points.items()):
        tps = {
            s: interval(
                [v for v in (_num(r.get("output_tokens_per_s")) for r in rs) if v is not None]
            )
            for s, rs in by.items()
        }
        entry: dict[str, Any] = {"cache_fraction": cf, "concurrency": conc, "tokens_per_s": tps}
        pairs = {
            (r["repeat"], s): _num(r.get("output_tokens_per_s")) for s, rs in by.items() for r in rs
        }
        ratios = [
            a / o
            for rep in sorted({k[0] for k in pairs})
            if (o := pairs.get((rep, "off"))) and (a := pairs.get((rep, "auto"))) is not None
        ]
        entry["pair_ratios_auto_over_off"] = ratios
        entry["pair_ratio_median"] = statistics.median(ratios) if ratios else None
        off, auto = tps.get("off", {}), tps.get("auto", {})
        if "mean_ci95" in off and "mean_ci95" in auto:
            lo_o, hi_o = off["mean_ci95"]
            lo_a, hi_a = auto["mean_ci95"]
            entry["verdict"] = (
                "auto faster" if lo_a > hi_o else ("auto slower" if hi_a < lo_o else "within noise")
            )
        else:
            entry["verdict"] = "too few runs"
        entry["by_setting"] = {
            s: {
                "host_wait_s": _median_of(rs, lambda r: r.get("host_wait_s")),
                "host_served_experts": _median_of(rs, lambda r: r.get("host_served_experts")),
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
                "affinity": (rs[0].get("host_service") or {}).get("affinity"),
                # the ahead plans' HOST experts over the setting's runs
                "ahead_outcome": {
                    k: sum(
                        int(((r.get("host_service") or {}).get("ahead_outcome") or {}).get(k, 0))
                        for r in rs
                    )
                    for k in ("seen", "routed", "hosted")
                },
            }
            for s, rs in by.items()
        }
        out.append(entry)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--arch", default="gpt-oss-20b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--points", default="0.2:1,0.2:4", help="cache:concurrency,...")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--host-threads", type=int, default=14)
    ap.add_argument("--host-workers", type=int, default=1)
    ap.add_argument("--budget-s", type=float, default=100.0)
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
        for cf, conc in points:
            order = SETTINGS if (rep + conc) % 2 == 0 else SETTINGS[::-1]
            for setting in order:
                if time.perf_counter() - started > args.budget_s:
                    cut += 1
                    continue
                spec = RunSpec(
                    arch=args.arch,
                    baseline="PD+host",
                    block_size=16,
                    concurrency=conc,
                    cache_fraction=cf,
                    repeat=rep,
                    layers=args.layers or None,
                    max_new_tokens=args.max_new_tokens,
                    prompt_len=args.prompt_len,
                    host_threads=args.host_threads,
                    host_workers=args.host_workers,
                    host_affinity=setting,
                )
                t0 = time.perf_counter()
                try:
                    row = run_spec(spec).row
                except Exception as exc:  # one failure must not lose the rest
                    errors.append({"spec": vars(spec), "error": f"{type(exc).__name__}: {exc}"})
                    print(
                        f"[affinity_ab] FAILED {setting} cf{cf} c{conc} r{rep}: {exc}",
                        file=sys.stderr,
                    )
                    continue
                row["ab_setting"] = setting
                row["run_elapsed_s"] = time.perf_counter() - t0
                rows.append(row)
                with rows_path.open("a") as f:
                    f.write(json.dumps(row, default=str) + "\n")
                print(
                    f"[affinity_ab] {setting} cf{cf} c{conc} r{rep}: "
                    f"tok/s={row['output_tokens_per_s']:.1f} host={row.get('host_served_experts')} "
                    f"({time.perf_counter() - t0:.1f}s, total {time.perf_counter() - started:.0f}s)",
                    file=sys.stderr,
                    flush=True,
                )
    release_targets()
    summary = {
        "suite": "affinity_ab",
        "command": " ".join(["bench/h200/affinity_ab.py", *(argv or sys.argv[1:])]),
        "synthetic_weights": True,
        "arch": args.arch,
        "layers": args.layers,
        "max_new_tokens": args.max_new_tokens,
        "host_threads": args.host_threads,
        "host_workers": args.host_workers,
        "repeats_requested": args.repeats,
        "runs": len(rows),
        "runs_not_started_budget": cut,
        "errors": errors,
        "elapsed_s": time.perf_counter() - started,
        "points": summarise(rows),
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(json.dumps(summary, default=str))
    return 0 if rows and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
