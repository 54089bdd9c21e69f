"""CPU A/B of the PD controller's shadow check (a gated route-ahead's
predictions read in shadow before a must-earn re-probe) at c=1 on session
39's replayed learned trace (as trace_ab.py replays it: small-gpt_oss, 8 MoE
layers, **synthetic** fp32 weights, cache 0.2, closed loop of 4 requests a
client, 24 new tokens, the link emulated at 0.5 GB/s), every arm warmed
outside the clock (B1 at ``fixed:1`` one workload burst, PD's arms until
the controller ended its first round). Arms interleaved and rotated per
repeat. Run from the repository root:

    python3 -P bench/results/cpu/shadow-check-2026-12-07/shadow_ab.py CONCURRENCY REPEATS OUT.jsonl ARM,ARM,...
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
    "PDwarm": _WARM_PD,
    "PDwarmNoShadow": {**_WARM_PD, "route_ahead_shadow_check": False},
}


def _fields(row: dict[str, Any]) -> dict[str, Any]:
    parts = row.get("pd_parts") or {}
    on = parts.get("on_fraction") or {}
    return {
        "output_tokens_per_s": row["output_tokens_per_s"],
        "bytes_per_token": row["bytes_per_token"],
        "route_ahead_on_fraction": on.get("route_ahead"),
        "route_ahead_shadow_steps": parts.get("route_ahead_shadow_steps"),
        "pd_steps": parts.get("steps"),
        "probes": parts.get("probes"),
        "warm_bursts": row.get("warm_bursts"),
    }


def main(argv: list[str]) -> None:
    conc, reps, out, names = int(argv[0]), int(argv[1]), argv[2], argv[3].split(",")
    replay_interleaved(base_spec(conc, 0.5, "small-gpt_oss", 8), ARMS, names, reps, out, _fields)


if __name__ == "__main__":
    main(sys.argv[1:])
