"""CPU A/B of the PD controller's early end of an imprecise route-ahead
probe (``PDController._ra_probe_reads_imprecise``): PD as this tree runs it
against PD whose must-earn probes of route-ahead run to their last look (the
controller before), each at its adaptive width and at ``fixed:1``, and B1 at
``fixed:1``; session 39's learned trace replayed as trace_ab.py replays it
(small-gpt_oss, 8 MoE layers, **synthetic** fp32 weights, cache 0.2, closed
loop of 4 requests a client, 24 new tokens, the link emulated at 0.5 GB/s);
arms interleaved and rotated per repeat. Run from the repository root:

    python3 -P bench/results/cpu/imprecise-probe-2026-12-07/imprecise_ab.py CONCURRENCY REPEATS OUT.jsonl
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any
from unittest import mock

from pdflash.bench.engine_run import RunSpec, run_spec
from pdflash.bench.suites.matrix import rotated

from pdflash.engine.pd_controller import PDController

# the trace replay's run spec is trace_ab.py's (its folder; `python -P` leaves it off sys.path)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trace-replay-2026-12-07"))
from trace_ab import base_spec

#: name: (run spec changes, whether an imprecise probe ends early)
ARMS: dict[str, tuple[dict[str, Any], bool]] = {
    "B1f1": ({"baseline": "B1", "verify_width": "fixed:1"}, True),
    "PD": ({"baseline": "PD"}, True),
    "PDold": ({"baseline": "PD"}, False),
    "PDf1": ({"baseline": "PD", "verify_width": "fixed:1"}, True),
    "PDf1old": ({"baseline": "PD", "verify_width": "fixed:1"}, False),
}


def _never(self: PDController) -> bool:
    return False


def main(argv: list[str]) -> None:
    conc, reps, out = int(argv[0]), int(argv[1]), argv[2]
    base = base_spec(conc, 0.5, "small-gpt_oss", 8)
    with open(out, "a") as f:
        for rep in range(reps):
            for name in rotated(list(ARMS), rep):
                changes, ends_early = ARMS[name]
                before: AbstractContextManager[object] = (
                    nullcontext()
                    if ends_early
                    else mock.patch.object(PDController, "_ra_probe_reads_imprecise", _never)
                )
                t0 = time.time()
                with before:
                    row = run_spec(RunSpec(**{**base, **changes}, repeat=rep)).row
                parts = row.get("pd_parts") or {}
                ra_decisions = [d for d in parts.get("decisions", []) if d["part"] == "route_ahead"]
                rec = {
                    "arm": name,
                    "repeat": rep,
                    "concurrency": conc,
                    "arch": "small-gpt_oss",
                    "layers": 8,
                    "output_tokens_per_s": row["output_tokens_per_s"],
                    "bytes_per_token": row["bytes_per_token"],
                    "steps": row.get("steps"),
                    "route_ahead_on_fraction": (parts.get("on_fraction") or {}).get("route_ahead"),
                    "route_ahead_decisions": [
                        {k: d[k] for k in ("step", "on", "switched")}
                        | {"ended_early": "ended early" in d["why"]}
                        for d in ra_decisions
                    ],
                    "run_s": time.time() - t0,
                }
                f.write(json.dumps(rec) + "\n")
                f.flush()
                print(name, rep, round(row["output_tokens_per_s"], 2), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
