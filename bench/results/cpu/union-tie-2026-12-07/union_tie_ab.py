"""CPU A/B of the union fit's tie rule (``UnionGrowth.TIE_TOLERANCE``):
PD as this tree runs it against PD whose fit takes the exact least squared
error (``TIE_TOLERANCE = 0``: the fit before, where rounding could pick the
novelty rate 1 for unions seen at one row count), and B1 at ``fixed:1``;
session 39's learned trace replayed on small-gpt_oss, 8 MoE layers,
**synthetic** fp32 weights, cache 0.2, closed loop of 4 requests a client,
24 new tokens, the link emulated at 0.5 GB/s; arms interleaved and rotated
per repeat. Run from the repository root:

    python3 -P bench/results/cpu/union-tie-2026-12-07/union_tie_ab.py CONCURRENCY REPEATS OUT.jsonl
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from pdflash.bench.engine_run import RunSpec, run_spec
from pdflash.bench.suites.matrix import rotated

from pdflash.engine.verify_width import UnionGrowth

# the trace replay's run spec is trace_ab.py's (its folder; `python -P` leaves it off sys.path)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trace-replay-2026-12-07"))
from trace_ab import base_spec

#: name: (run spec changes, the union fit's tie tolerance; None: this tree's)
ARMS: dict[str, tuple[dict[str, Any], float | None]] = {
    "B1f1": ({"baseline": "B1", "verify_width": "fixed:1"}, None),
    "PD": ({"baseline": "PD"}, None),
    "PDoldfit": ({"baseline": "PD"}, 0.0),
}


def main(argv: list[str]) -> None:
    conc, reps, out = int(argv[0]), int(argv[1]), argv[2]
    base = base_spec(conc, 0.5, "small-gpt_oss", 8)
    tolerance = UnionGrowth.TIE_TOLERANCE
    with open(out, "a") as f:
        for rep in range(reps):
            for name in rotated(list(ARMS), rep):
                changes, tie = ARMS[name]
                UnionGrowth.TIE_TOLERANCE = tolerance if tie is None else tie
                t0 = time.time()
                try:
                    row = run_spec(RunSpec(**{**base, **changes}, repeat=rep)).row
                finally:
                    UnionGrowth.TIE_TOLERANCE = tolerance
                width = row.get("verify_width") or {}
                rec = {
                    "arm": name,
                    "repeat": rep,
                    "concurrency": conc,
                    "arch": "small-gpt_oss",
                    "layers": 8,
                    "output_tokens_per_s": row["output_tokens_per_s"],
                    "bytes_per_token": row["bytes_per_token"],
                    "width_histogram": width.get("width_histogram"),
                    "exploration_added_drafts": width.get("exploration_added_drafts"),
                    "mean_width_drafts": width.get("mean_width_drafts"),
                    "run_s": time.time() - t0,
                }
                f.write(json.dumps(rec) + "\n")
                f.flush()
                print(name, rep, round(row["output_tokens_per_s"], 2), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
