"""Device-time estimate of bench/h200/issue15.sh's steps, before and after the
shared warm-up and generated synthetic weights (no GPU needed):

    python3 bench/h200/issue15_estimate.py [--json]

Every figure is an ASSUMPTION stated below or taken from recorded H200 rows
(bench/results/h200-matrix/: 8-layer truncations, bf16 experts, 32 new
tokens, one cold run per point); nothing here is measured by this script.

Measured part of a run: its output tokens / tokens-per-second, where the
tokens per second are the 8-layer rows' (median of B1, B2, PD at the same
concurrency and cache fraction; B0 and B3 their own) x 8 / layers (time per
token grows with the layers: both the copies and the compute do), x 1.16
for gpt-oss MXFP4 experts (the measured MXFP4/bf16 wall ratio of the same
PD runs at c=4 and 16, run 4 of bench/results/h200/2026-12-01/). A serving
run sends --serve-requests requests of 128-192 new tokens (mean 160) and its
verify step takes --serve-blocks blocks (token budget / block): its rate is
the c=4 rows' at cache 0.2 for 4 blocks, the c=16 rows' for 16 (log-linear
between), and it lasts at least the arrival span ((n - 1) / rate) plus 5 s.
Calls: runs are packed in plan order into calls of HARD_S seconds; each call
pays the build, start, drafter and model again, and (after) re-warms every
shared warm-up key it meets (a call is a fresh process).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

from pdflash.report.writers import read_jsonl, rows_files

HERE = Path(__file__).resolve().parent
ROWS = HERE.parent / "results" / "h200-matrix"

# ---- assumptions (seconds) ----
CALL_S = 600  # one device call
BUILD_S = 30  # pip install of the checkout (run.sh's log: 27 s)
START_S = 15  # python, torch, transformers imports, CUDA context
DRAFTER_S = 10  # the synthetic drafter (written on the CPU, both before and after)
HARD_S = 540  # issue15.sh's hard timeout of a step
#: the synthetic checkpoint: before = written (1.2 GB/s: 6.5 GB in 5.5 s on the
#: H200, run 3) and read back + packed (0.8 GB/s: 16 GB in 20 s, the issue-16
#: diagnostic's load_s); after = drawn on the GPU straight into the pinned
#: store (assumed 5 GB/s: GPU generation is free, the pageable D2H copy and
#: the pack memcpy are not)
WRITE_GBPS, READ_GBPS, GENERATE_GBPS = 1.2, 0.8, 5.0
#: per run outside the warm-up and the clock: link probe, cache build,
#: Belady replay, row (8-layer rows: run_elapsed_s - wall_s ~ 1.4 s), scaled
#: to 24+ layers; before also loads the drafter again (~1 s)
RUN_OVERHEAD_S = {"before": 4.0, "after": 3.0}
#: PD-family runs with M from the verify step first run a calibration:
#: max_running requests of min(3 blocks, 128) = 48 new tokens each (the
#: shared warm-up's pass: token budget / block requests), FCFS without
#: prefetching, at (assumed) the serving run's tokens/s
SHORT_WARMUP_S = 1.0
MXFP4_SPEEDUP = 1.16
#: the serving workload: requests (mean 160 new tokens), verify blocks per
#: step (token budget / block) and max_running (the workload warm-up's burst)
SERVE = {"requests": 24, "blocks": 4, "max_running": 16}
CHECKPOINT_GB = {"gpt-oss-20b": (0.48, 2.9), "qwen3-30b-a3b": (1.246, 1.52)}  # per layer, fixed
SERVE_LABELS = ["B1", "B2", "B3", "PD"]
ABLATION_LABELS = [
    "PD",
    "PD-all-on",
    "PD-no-route-ahead",
    "PD-one-band",
    "PD-token-sched",
    "PD-no-stream",
    "PD+host",
]
#: labels whose scheduler runs the verify calibration (deficit_2d with M)
CALIBRATED = {"PD", "PD-all-on", "PD-no-route-ahead", "PD-one-band", "PD-no-stream", "PD+host"}


def tok_s_table() -> dict[tuple[str, str, int, float], float]:
    """(arch, baseline, concurrency, cache fraction) -> 8-layer tokens/s."""
    out: dict[tuple[str, str, int, float], float] = {}
    for path in rows_files(ROWS):
        if not path.name.startswith("rows-"):
            continue
        for r in read_jsonl(path):
            key = (r["arch"], r["baseline"], int(r["concurrency"]), float(r["cache_fraction"]))
            out[key] = float(r["output_tokens_per_s"])
    return out


def rate(table: Any, arch: str, baseline: str, c: int, cf: float, layers: int) -> float:
    if baseline in ("B0", "B3"):
        base = table[(arch, baseline, c, 1.0 if baseline == "B3" else cf)]
    else:
        base = statistics.median(table[(arch, b, c, cf)] for b in ("B1", "B2", "PD"))
    fmt = MXFP4_SPEEDUP if arch == "gpt-oss-20b" else 1.0
    return float(base) * 8 / layers * fmt


def serve_rate(table: Any, arch: str, baseline: str, layers: int) -> float:
    """Tokens/s of a serving run whose verify takes SERVE["blocks"] blocks:
    the c=4 / c=16 rows' at cache 0.2 (geometric mean for 8 blocks)."""
    r4 = rate(table, arch, baseline, 4, 0.2, layers)
    r16 = rate(table, arch, baseline, 16, 0.2, layers)
    blocks = SERVE["blocks"]
    if blocks <= 4:
        return r4
    if blocks >= 16:
        return r16
    return math.exp(
        math.log(r4) + (math.log(r16) - math.log(r4)) * math.log(blocks / 4) / math.log(4)
    )


def step_runs(step: dict[str, Any], table: Any) -> list[dict[str, Any]]:
    """One entry per run, in the matrix's plan order (per rate or point, per
    repeat every label): measured s, warm-up s, shared warm-up key, calibrated."""
    runs = []
    arch, layers = step["arch"], step["layers"]
    if step["kind"] == "serve":
        for r in step["rates"]:
            for _repeat in range(3):
                for label in step["labels"]:
                    tok_s = serve_rate(table, arch, "B3" if label == "B3" else "PD", layers)
                    n = SERVE["requests"]
                    measured = max(n * 160 / tok_s, (n - 1) / r + 5)
                    # the workload warm-up: a burst of max_running requests
                    warm = min(n, SERVE["max_running"]) * 160 / tok_s
                    runs.append(
                        {
                            "measured": measured,
                            "warm": warm,
                            "key": (label,),
                            "cal": SERVE["max_running"] * 48 / tok_s
                            if label in CALIBRATED
                            else 0.0,
                            # the shared pass calibrates with one verify batch of requests
                            "warm_cal": SERVE["blocks"] * 48 / tok_s
                            if label in CALIBRATED
                            else 0.0,
                        }
                    )
        return runs
    for cf in step["cache"]:
        for c in step["conc"]:
            for _repeat in range(3):
                for label in step["labels"]:
                    if label == "B3" and cf != step["cache"][0]:
                        continue  # B3 runs once per concurrency (cache 1.0)
                    tok_s = rate(table, arch, label, c, cf, layers)
                    measured = c * 128 / tok_s
                    runs.append(
                        {
                            "measured": measured,
                            "warm": measured,
                            "key": (label, c, cf),
                            "cal": 0.0,
                            "warm_cal": 0.0,
                        }
                    )
    return runs


def estimate(step: dict[str, Any], table: Any, variant: str) -> dict[str, Any]:
    arch, layers = step["arch"], step["layers"]
    per_layer, fixed = CHECKPOINT_GB[arch]
    gb = per_layer * layers + fixed
    # before: written then read back; after: drawn straight into the store
    model_s = gb / GENERATE_GBPS if variant == "after" else gb / WRITE_GBPS + gb / READ_GBPS
    call_fixed = BUILD_S + START_S + DRAFTER_S + model_s
    usable = HARD_S - START_S - DRAFTER_S - model_s  # what a call's runs can use
    runs = step_runs(step, table)
    # pack runs into calls in plan order; a shared warm-up is paid once per key per call
    calls, used = 1, 0.0
    keys: set[Any] = set()
    total_runs_s = 0.0

    def cost_of(run: dict[str, Any], warmed: set[Any]) -> float:
        cost = RUN_OVERHEAD_S[variant] + run["measured"]
        cost += run["cal"]
        if variant == "before":
            return cost + run["warm"]
        cost += SHORT_WARMUP_S
        if run["key"] not in warmed:  # the shared warm-up pass (with its calibration)
            cost += run["warm"] + run["warm_cal"]
        return cost

    for run in runs:
        cost = cost_of(run, keys)
        if used + cost > usable and used > 0:
            calls += 1
            used, keys = 0.0, set()  # a new call is a new process: nothing is warm
            cost = cost_of(run, keys)
        keys.add(run["key"])
        used += cost
        total_runs_s += cost
    device_s = total_runs_s + calls * call_fixed
    return {
        "runs": len(runs),
        "calls": calls,
        "device_min": round(device_s / 60, 1),
        "model_load_s_per_call": round(model_s),
        "mean_measured_s": round(statistics.mean(r["measured"] for r in runs), 1),
    }


def steps(qwen_layers: int, rates: list[float]) -> list[dict[str, Any]]:
    g24 = {"arch": "gpt-oss-20b", "layers": 24}
    q = {"arch": "qwen3-30b-a3b", "layers": qwen_layers}
    burst = {"kind": "burst", "cache": [0.2, 0.5, 0.8], "conc": [4, 16]}
    serve = {"kind": "serve", "rates": rates}
    out = []
    for name, model in (("gptoss24", g24), ("qwen", q)):
        out.append({"name": f"{name}-ablation", **model, **serve, "labels": ABLATION_LABELS})
        out.append({"name": f"{name}-serve", **model, **serve, "labels": SERVE_LABELS})
        out.append(
            {
                "name": f"{name}-servefull",
                **model,
                **serve,
                "labels": SERVE_LABELS[:3] + ABLATION_LABELS,
            }
        )
        out.append({"name": f"{name}-burst", **model, **burst, "labels": ["B1", "B2", "B3", "PD"]})
        out.append({"name": f"{name}-b0", **model, **burst, "conc": [4], "labels": ["B0"]})
    for name, arch in (("gptoss8", "gpt-oss-20b"), ("qwen8", "qwen3-30b-a3b")):
        out.append(
            {
                "name": f"{name}-burst",
                "arch": arch,
                "layers": 8,
                **burst,
                "labels": ["B0", "B1", "B2", "B3", "PD"],
            }
        )
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--qwen-layers", type=int, default=32)
    ap.add_argument("--rates", default="0.5,2")
    ap.add_argument("--serve-requests", type=int, default=SERVE["requests"])
    ap.add_argument(
        "--serve-blocks", type=int, default=SERVE["blocks"], help="token budget / block"
    )
    ap.add_argument("--serve-max-running", type=int, default=SERVE["max_running"])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    SERVE.update(
        requests=args.serve_requests, blocks=args.serve_blocks, max_running=args.serve_max_running
    )
    table = tok_s_table()
    rates = [float(r) for r in args.rates.split(",")]
    result = []
    for step in steps(args.qwen_layers, rates):
        before, after = estimate(step, table, "before"), estimate(step, table, "after")
        result.append({"step": step["name"], "before": before, "after": after})
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(
        f"{'step':22s} {'runs':>4s} {'s/run':>6s} | {'before min':>10s} {'calls':>5s} | {'after min':>9s} {'calls':>5s}"
    )
    for e in result:
        b, a = e["before"], e["after"]
        print(
            f"{e['step']:22s} {b['runs']:4d} {b['mean_measured_s']:6.0f} | {b['device_min']:10.1f} "
            f"{b['calls']:5d} | {a['device_min']:9.1f} {a['calls']:5d}"
        )


if __name__ == "__main__":
    main()
