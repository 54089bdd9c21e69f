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

import sys
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any
from unittest import mock

from pdflash.engine.verify_width import UnionGrowth

# the trace replay's run spec and loop are trace_ab.py's (its folder; `python -P` leaves it off sys.path)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trace-replay-2026-12-07"))
from trace_ab import base_spec, replay_interleaved

#: name: run spec changes
ARMS: dict[str, dict[str, Any]] = {
    "B1f1": {"baseline": "B1", "verify_width": "fixed:1"},
    "PD": {"baseline": "PD"},
    "PDoldfit": {"baseline": "PD"},
}
#: the arms whose union fit takes another tie tolerance (the rest: this tree's)
TIE_TOLERANCES: dict[str, float] = {"PDoldfit": 0.0}


def _tie_rule(name: str) -> AbstractContextManager[object]:
    if name not in TIE_TOLERANCES:
        return nullcontext()
    return mock.patch.object(UnionGrowth, "TIE_TOLERANCE", TIE_TOLERANCES[name])


def _fields(row: dict[str, Any]) -> dict[str, Any]:
    width = row.get("verify_width") or {}
    return {
        "arch": "small-gpt_oss",
        "layers": 8,
        "output_tokens_per_s": row["output_tokens_per_s"],
        "bytes_per_token": row["bytes_per_token"],
        "width_histogram": width.get("width_histogram"),
        "exploration_added_drafts": width.get("exploration_added_drafts"),
        "mean_width_drafts": width.get("mean_width_drafts"),
    }


def main(argv: list[str]) -> None:
    conc, reps, out = int(argv[0]), int(argv[1]), argv[2]
    base = base_spec(conc, 0.5, "small-gpt_oss", 8)
    replay_interleaved(base, ARMS, list(ARMS), reps, out, _fields, _tie_rule)


if __name__ == "__main__":
    main(sys.argv[1:])
