"""Profile a few engine runs with torch.profiler and print where the time goes.

A diagnostic for issue 13's verify breakdown (attention dominated B3 at c=16):
prints the op tables (by self CUDA time and by self CPU time) for each run and
writes them, with the run's row, to ``--out`` as JSON. Usage on the H200:

    python bench/h200/profile_verify.py --out $OUT/profile.json \
        --run arch=gpt-oss-20b,baseline=B3,concurrency=16,layers=8

Each run goes twice: a warm-up run (its row kept as ``warm_row``: the same
run without the profiler's overhead) and the profiled one. ``--chrome-dir``:
also each profiled run's timeline (``chrome://tracing`` / Perfetto JSON,
gzipped, ``run<i>.json.gz``), where the compute stream's idle gaps between
kernels show.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import tempfile
from typing import Any

import torch
from pdflash.bench.engine_run import run_spec, spec_from_dict
from torch.profiler import ProfilerActivity, profile


def _parse(text: str) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        try:
            spec[key] = int(value)
        except ValueError:
            try:
                spec[key] = float(value)
            except ValueError:
                spec[key] = value
    return spec


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run", action="append", required=True, help="k=v,... RunSpec fields")
    parser.add_argument("--rows", type=int, default=35)
    parser.add_argument("--out", required=True)
    parser.add_argument("--chrome-dir", default=None, help="write each run's timeline here")
    args = parser.parse_args()
    report = []
    for index, text in enumerate(args.run):
        fields = {"max_new_tokens": 32, "prompt_len": 32, **_parse(text)}
        spec = spec_from_dict(fields)
        warm = run_spec(spec)  # warm: pack, caches, kernels
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        with profile(activities=activities) as prof:
            result = run_spec(spec)
        averages = prof.key_averages()
        by_cuda = averages.table(sort_by="self_cuda_time_total", row_limit=args.rows)
        by_cpu = averages.table(sort_by="self_cpu_time_total", row_limit=args.rows)
        by_count = averages.table(sort_by="count", row_limit=args.rows)
        print(f"=== {text}\n--- by self CUDA time\n{by_cuda}\n--- by self CPU time\n{by_cpu}")
        print(f"--- by call count\n{by_count}")
        timeline = None
        if args.chrome_dir is not None:
            os.makedirs(args.chrome_dir, exist_ok=True)
            timeline = os.path.join(args.chrome_dir, f"run{index}.json.gz")
            with tempfile.TemporaryDirectory() as tmp:
                raw = os.path.join(tmp, "trace.json")
                prof.export_chrome_trace(raw)
                with open(raw, "rb") as src, gzip.open(timeline, "wb") as dst:
                    shutil.copyfileobj(src, dst)
        row = getattr(result, "row", None)
        warm_row = getattr(warm, "row", None)
        report.append(
            {
                "run": fields,
                "row": row if isinstance(row, dict) else None,
                "warm_row": warm_row if isinstance(warm_row, dict) else None,
                "timeline": timeline,
                "by_self_cuda": by_cuda,
                "by_self_cpu": by_cpu,
                "by_count": by_count,
            }
        )
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(json.dumps({"profiled": len(report), "out": args.out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
