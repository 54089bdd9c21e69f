"""How well the verify width's union model extrapolates a verify's routed
experts per layer from the row counts a narrow width observes (CPU; no model
is run: the routing is a committed proxy trace's).

For every verify round of a trace that verified a whole block (``block``
rows: the anchor and its drafts), the mean per-layer union of the block's
first ``r`` rows, ``r = 1 .. block``, is averaged over rounds: the measured
curve ``U(r)``. :class:`pdflash.engine.verify_width.UnionGrowth` of each
form is then fed that curve at the row counts of an observation set (as the
width policy would observe them) and its fitted curve is compared with the
measured one: ``U(block)`` and the experts rows ``5-9`` and ``10-block`` add,
estimate over measured. The sets: ``narrow`` (rows 2-4, what a width of 1-3
drafts observes), ``medium`` (rows 2-8), ``with_full`` (rows 2-4 and the
whole block). ``--iid E K``: the exact i.i.d. uniform curve of ``K`` of ``E``
experts instead of a trace (where the geometric form is exact).

Usage: python bench/union_fit_study.py [--iid E K] [TRACE.npz ...] > out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np
from pdflash.bench.width_replay_study import request_rounds

from pdflash.engine.verify_width import UNION_FORMS, UnionGrowth
from pdflash.traces import load_trace

OBSERVATION_SETS = {
    "narrow": [2] * 60 + [3] * 30 + [4] * 10,
    "medium": [r for r in range(2, 9) for _ in range(10)],
    "with_full": [2] * 60 + [3] * 30 + [4] * 10 + [-1] * 30,  # -1: the whole block
}


def measured_curve(path: str) -> tuple[np.ndarray, int, int, int]:
    """``(U, E, k, block)``: ``U[r]`` the mean per-layer union of a whole
    block's first ``r`` rows (``U[0] = 0``)."""
    t = load_trace(path)
    _, layers, k = t.verify_topk.shape
    block = int(t.round_rows.max())
    num_experts = int(t.provenance.get("num_experts") or int(t.verify_topk.max()) + 1)
    # every whole-block round's summed per-layer prefix unions, of every request
    unions = [u for rounds in request_rounds(t) for _, u in rounds]
    if not unions:
        raise SystemExit(f"{path}: no round verified a whole block of {block} rows")
    return np.concatenate([[0.0], np.mean(unions, axis=0) / layers]), num_experts, k, block


def iid_curve(num_experts: int, k: int, block: int) -> np.ndarray:
    u = [0.0] + [
        num_experts - (num_experts - k) * (1 - k / num_experts) ** (r - 1)
        for r in range(1, block + 1)
    ]
    return np.asarray(u)


def compare(u: np.ndarray, num_experts: int, k: int, block: int) -> dict[str, Any]:
    added = np.diff(u[1:])  # added[r - 2]: experts row r adds
    out: dict[str, Any] = {"measured_union": [round(float(x), 2) for x in u[1:]], "fits": {}}
    for name, rows in OBSERVATION_SETS.items():
        for form in UNION_FORMS:
            g = UnionGrowth(num_experts, k, form=form)
            for r in rows:
                r = block if r < 0 else r
                g.observe(r, float(u[r]))
            a, sat = g.fitted()
            est = np.asarray([g.union(r) for r in range(1, block + 1)])
            est_added = np.diff(est)
            out["fits"][f"{name}/{form}"] = {
                "novelty": round(a, 4),
                "saturation": round(sat, 2),
                "union_at_block": round(float(est[-1]), 2),
                "measured_union_at_block": round(float(u[block]), 2),
                "added_rows_5_9_over_measured": round(
                    float(est_added[3:8].sum() / added[3:8].sum()), 3
                ),
                "added_rows_10_up_over_measured": round(
                    float(est_added[8:].sum() / added[8:].sum()), 3
                ),
            }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("traces", nargs="*")
    parser.add_argument("--iid", nargs=2, type=int, metavar=("E", "K"))
    parser.add_argument("--block", type=int, default=16, help="rows of a block (--iid)")
    args = parser.parse_args()
    report: dict[str, Any] = {}
    for path in args.traces:
        u, num_experts, k, block = measured_curve(path)
        report[path] = {
            "num_experts": num_experts,
            "top_k": k,
            "block": block,
            **compare(u, num_experts, k, block),
        }
    if args.iid:
        num_experts, k = args.iid
        u = iid_curve(num_experts, k, args.block)
        report[f"iid:{num_experts}:{k}"] = {
            "num_experts": num_experts,
            "top_k": k,
            "block": args.block,
            **compare(u, num_experts, k, args.block),
        }
    if not report:
        parser.error("give a trace or --iid")
    json.dump(report, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
