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

import sys
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any
from unittest import mock

from pdflash.engine.pd_controller import PDController

# the trace replay's run spec and loop are trace_ab.py's (its folder; `python -P` leaves it off sys.path)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trace-replay-2026-12-07"))
from trace_ab import base_spec, replay_interleaved

#: name: run spec changes
ARMS: dict[str, dict[str, Any]] = {
    "B1f1": {"baseline": "B1", "verify_width": "fixed:1"},
    "PD": {"baseline": "PD"},
    "PDold": {"baseline": "PD"},
    "PDf1": {"baseline": "PD", "verify_width": "fixed:1"},
    "PDf1old": {"baseline": "PD", "verify_width": "fixed:1"},
}
#: the arms whose controller never ends a probe early (the controller before)
NEVER_EARLY = frozenset({"PDold", "PDf1old"})


def _never(self: PDController) -> bool:
    return False


def _controller(name: str) -> AbstractContextManager[object]:
    if name not in NEVER_EARLY:
        return nullcontext()
    return mock.patch.object(PDController, "_ra_probe_reads_imprecise", _never)


def _fields(row: dict[str, Any]) -> dict[str, Any]:
    parts = row.get("pd_parts") or {}
    ra_decisions = [d for d in parts.get("decisions", []) if d["part"] == "route_ahead"]
    return {
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
    }


def main(argv: list[str]) -> None:
    conc, reps, out = int(argv[0]), int(argv[1]), argv[2]
    base = base_spec(conc, 0.5, "small-gpt_oss", 8)
    replay_interleaved(base, ARMS, list(ARMS), reps, out, _fields, _controller)


if __name__ == "__main__":
    main(sys.argv[1:])
