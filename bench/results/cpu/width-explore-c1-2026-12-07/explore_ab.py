"""CPU A/B of what PD's adaptive width costs at c=1 on session 39's replayed
learned trace (as trace_ab.py replays it: small-gpt_oss, 8 MoE layers,
**synthetic** fp32 weights, cache 0.2, closed loop of 4 requests a client,
24 new tokens, the link emulated at 0.5 GB/s), with every arm warmed outside
the clock: B1 at ``fixed:1`` one workload burst (``warm_bursts=1``), PD's
arms until the controller ended its first round
(``controller_warmup=first_round``). Arms interleaved and rotated per
repeat. Run
from the repository root:

    python3 -P bench/results/cpu/width-explore-c1-2026-12-07/explore_ab.py CONCURRENCY REPEATS OUT.jsonl ARM,ARM,...
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

# the trace replay's run spec and loop are trace_ab.py's (its folder; `python -P` leaves it off sys.path)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trace-replay-2026-12-07"))
from trace_ab import base_spec, replay_interleaved

_WARM_PD = {"baseline": "PD", "controller_warmup": "first_round"}
ARMS: dict[str, dict[str, Any]] = {
    "B1f1": {"baseline": "B1", "verify_width": "fixed:1", "warm_bursts": 1},
    "PD": {"baseline": "PD"},
    "PDwarm": _WARM_PD,
    "PDf1warm": {**_WARM_PD, "verify_width": "fixed:1"},
    "PDwarmEx0": {**_WARM_PD, "verify_width": "adaptive:explore=0"},
    "PDwarmEx34": {**_WARM_PD, "verify_width": "adaptive:explore=34"},
}


def _fields(row: dict[str, Any]) -> dict[str, Any]:
    width = row.get("verify_width") or {}
    return {
        "output_tokens_per_s": row["output_tokens_per_s"],
        "bytes_per_token": row["bytes_per_token"],
        "mean_width_drafts": width.get("mean_width_drafts"),
        "exploration_added_drafts": width.get("exploration_added_drafts"),
        "warm_bursts": row.get("warm_bursts"),
    }


def main(argv: list[str]) -> None:
    conc, reps, out, names = int(argv[0]), int(argv[1]), argv[2], argv[3].split(",")
    replay_interleaved(base_spec(conc, 0.5, "small-gpt_oss", 8), ARMS, names, reps, out, _fields)


if __name__ == "__main__":
    main(sys.argv[1:])
