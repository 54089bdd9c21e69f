"""The verify-width comparison on this CPU (relative figures only).

Runs (label, verify width) pairs interleaved round-robin over the repeats
(each repeat starts one pair later), every run a fresh engine through
``pdflash.bench.engine_run.run_spec``, appending each row to
``OUT/rows.jsonl`` (a rerun skips the pairs/repeats already recorded), then
prints the median table. Usage (from the repository root, the package
installed):

    python bench/results/width-cpu/run.py OUT [--link-gbps G] [--repeats N] \
        [--concurrency C] [--max-new-tokens M] [--pairs B2=full,B2=fixed:2,PD=adaptive,...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRACE = HERE.parent / "h200" / "proxy-balanced-2026-12-01" / "trace_gpu_t1.npz"
PAIRS = "B2=full,B2=fixed:1,B2=fixed:2,B2=fixed:3,B2=adaptive,PD=full,PD=adaptive"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--link-gbps", type=float, default=0.1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--cache-fraction", type=float, default=0.2)
    ap.add_argument("--pairs", default=PAIRS)
    ap.add_argument("--table-only", action="store_true")
    args = ap.parse_args()
    pairs = [tuple(p.split("=", 1)) for p in args.pairs.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    rows_path = args.out / "rows.jsonl"
    done: set[tuple[str, str, int]] = set()
    if rows_path.exists():
        for line in rows_path.read_text().splitlines():
            r = json.loads(line)
            done.add((r["baseline"], r["verify_width"]["setting"], r["repeat"]))
    if not args.table_only:
        from pdflash.bench.engine_run import RunSpec, run_spec

        for repeat in range(args.repeats):
            k = repeat % len(pairs)
            for label, width in pairs[k:] + pairs[:k]:
                if (label, width, repeat) in done:
                    continue
                spec = RunSpec(
                    arch="small-qwen3_moe",
                    baseline=label,
                    device="cpu",
                    block_size=16,
                    concurrency=args.concurrency,
                    cache_fraction=args.cache_fraction,
                    prompt_len=32,
                    max_new_tokens=args.max_new_tokens,
                    repeat=repeat,
                    emulated_link_gbps=args.link_gbps,
                    routing_source="trace",
                    acceptance="trace",
                    trace=str(TRACE),
                    verify_width=width,
                )
                row = run_spec(spec).row
                with rows_path.open("a") as f:
                    f.write(json.dumps(row, default=str) + "\n")
                print(
                    f"r{repeat} {label} {width}: {row['output_tokens_per_s']:.3f} tok/s "
                    f"{row['bytes_per_token'] / 1e6:.2f} MB/tok link busy "
                    f"{row['link_busy_fraction']:.2f}",
                    file=sys.stderr,
                    flush=True,
                )
    table(rows_path, pairs)
    return 0


def table(rows_path: Path, pairs: list[tuple[str, ...]]) -> None:
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()]
    print(
        "| label | verify width | runs | tokens/s median (min–max) | MB/token median | "
        "link busy | τ (committed/round) | mean drafts verified | expected / realized "
        "accepted drafts |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for label, width in pairs:
        rs = [r for r in rows if r["baseline"] == label and r["verify_width"]["setting"] == width]
        if not rs:
            continue
        tps = [r["output_tokens_per_s"] for r in rs]
        bpt = [r["bytes_per_token"] / 1e6 for r in rs]
        busy = [r["link_busy_fraction"] for r in rs]
        tau = [r["acceptance_length_mean"] for r in rs]
        vw = [r["verify_width"] for r in rs]
        ver = [v["mean_verified_drafts"] for v in vw if v.get("mean_verified_drafts") is not None]
        exp = [v["expected_accepted_drafts"] for v in vw if v.get("expected_accepted_drafts")]
        acc = [v["mean_accepted_drafts"] for v in vw if v.get("mean_accepted_drafts") is not None]
        med = statistics.median
        print(
            f"| {label} | {width} | {len(rs)} | {med(tps):.3f} ({min(tps):.3f}–{max(tps):.3f}) | "
            f"{med(bpt):.2f} | {med(busy):.2f} | {med(tau):.2f} | "
            f"{f'{med(ver):.2f}' if ver else 'every draft (no policy)'} | "
            f"{f'{med(exp):.2f} / {med(acc):.2f}' if exp else '—'} |"
        )


if __name__ == "__main__":
    raise SystemExit(main())
