"""gpt-oss experts over the link as MXFP4 vs dequantized to bf16, interleaved.

Issue 13's "compressed experts end to end" comparison: the same synthetic
MXFP4 gpt-oss checkpoint, PD at one cache fraction, experts kept MXFP4
(as stored) or dequantized to the compute dtype at pack time
(``expert_dtype="dense"``). Repeats interleave the two formats (each repeat
starts with the other one) in one process; a run is started only while the
time budget allows another of its length. Rows go to ``OUT/rows.jsonl`` as
they finish; the printed JSON holds, per (format, concurrency), tokens/s and
bytes per token per repeat, their medians, and the bf16 / MXFP4 ratios.

    python bench/h200/issue13b_link.py --out $OUT/link --budget-s 120
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from pdflash.bench.engine_run import run_spec, spec_from_dict

from pdflash.report.writers import append_row

FORMATS = {"mxfp4": None, "bf16": "dense"}  # label -> RunSpec.expert_dtype


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--arch", default="gpt-oss-20b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--concurrency", default="4,16")
    p.add_argument("--cache-fraction", type=float, default=0.2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=120.0, help="start no run past this")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    concs = [int(c) for c in args.concurrency.split(",") if c]
    started = time.perf_counter()
    longest = 0.0
    series: dict[str, dict[str, list[float]]] = {}
    skipped: list[str] = []
    labels = list(FORMATS)
    for rep in range(args.repeats):
        order = labels if rep % 2 == 0 else labels[::-1]
        for conc in concs:
            for label in order:
                key = f"{label}_c{conc}"
                elapsed = time.perf_counter() - started
                if elapsed + longest > args.budget_s:
                    skipped.append(f"{key}_r{rep}")
                    continue
                spec = spec_from_dict(
                    dict(
                        arch=args.arch,
                        baseline="PD",
                        concurrency=conc,
                        cache_fraction=args.cache_fraction,
                        layers=args.layers,
                        synthetic_format="mxfp4",
                        expert_dtype=FORMATS[label],
                        repeat=rep,
                        device=args.device,
                        max_new_tokens=args.max_new_tokens,
                        prompt_len=args.prompt_len,
                    )
                )
                t0 = time.perf_counter()
                result = run_spec(spec)
                longest = max(longest, time.perf_counter() - t0)
                row = result.row
                append_row(args.out / "rows.jsonl", row)
                s = series.setdefault(
                    key, {"tokens_per_s": [], "bytes_per_token": [], "expert_nbytes": []}
                )
                s["tokens_per_s"].append(float(row["output_tokens_per_s"]))
                s["bytes_per_token"].append(float(row["bytes_per_token"]))
                s["expert_nbytes"].append(float(row["expert_nbytes"]))
    summary: dict[str, Any] = {"series": series, "skipped_for_budget": skipped}
    ratios: dict[str, Any] = {}
    for conc in concs:
        m, b = series.get(f"mxfp4_c{conc}"), series.get(f"bf16_c{conc}")
        if not (m and b):
            ratios[f"c{conc}"] = None
            continue
        mt, bt = _median(m["tokens_per_s"]), _median(b["tokens_per_s"])
        mb, bb = _median(m["bytes_per_token"]), _median(b["bytes_per_token"])
        ratios[f"c{conc}"] = {
            "mxfp4_tokens_per_s_median": mt,
            "bf16_tokens_per_s_median": bt,
            "tokens_per_s_mxfp4_over_bf16": mt / bt if mt and bt else None,
            "mxfp4_bytes_per_token_median": mb,
            "bf16_bytes_per_token_median": bb,
            "bytes_per_token_bf16_over_mxfp4": bb / mb if mb and bb else None,
            "repeats": min(len(m["tokens_per_s"]), len(b["tokens_per_s"])),
        }
    summary["side_by_side"] = ratios
    summary["elapsed_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
