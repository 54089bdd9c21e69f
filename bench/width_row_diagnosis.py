"""Diagnose adaptive vs fixed:1 verify width from committed closed-loop rows.

Reads a trace_baselines ``rows.jsonl`` (one row per label x width x repeat)
and, per baseline and repeat, pairs the ``adaptive`` row with the
``fixed:1`` row of the same repeat. It reports, per extra verified draft
(adaptive's verified drafts less fixed:1's, over the run): the measured
wall, link-busy and exposed-fetch seconds it added, the modeled link time
the policy charged for the first row past the anchors (``row_link_s[0]``),
and the drafts it added that were accepted (realized) against the policy's
own expectation. No GPU: the numbers are read from the rows as committed.

Then, per baseline, across every width's runs (:func:`step_cost_per_draft`):
the least-squares slope of a run's wall time per step on its mean verified
drafts a round, i.e. what a further verified draft a round lengthened a step
by, whatever the cause.

With ``--trace TRACE.npz`` it also prints a CPU model of the closed loop's
step count (replayed trace, idealized: each request needs 32 tokens, a round
commits ``min(A, k) + 1`` of its trace round's ``A`` accepted drafts, 4
clients take requests 0..11 from one queue in order, a step is one round of
every running request): total rounds and makespan at fixed widths ``k``.

Usage: python bench/width_row_diagnosis.py [--trace TRACE.npz] ROWS.jsonl [...]
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from typing import Any

from pdflash.report.writers import read_jsonl


def pairs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by[(r["baseline"], r["spec"]["verify_width"])].append(r)
    out = []
    for (base, width), ads in sorted(by.items()):
        if width != "adaptive":
            continue
        for rep, (a, f) in enumerate(zip(ads, by[(base, "fixed:1")], strict=False)):
            wa, wf = a["verify_width"], f["verify_width"]
            ver_a = wa["mean_verified_drafts"] * wa["rounds"]
            ver_f = wf["mean_verified_drafts"] * wf["rounds"]
            acc_a = wa["mean_accepted_drafts"] * wa["rounds"]
            acc_f = wf["mean_accepted_drafts"] * wf["rounds"]
            extra = ver_a - ver_f
            est = wa["estimates"]
            exp_acc = wa["expected_accepted_drafts"] * wa["rounds"]
            out.append(
                {
                    "baseline": base,
                    "repeat": rep,
                    "extra_drafts": round(extra),
                    "steps": [a["steps"], f["steps"]],
                    "tok_s": [
                        round(a["output_tokens_per_s"], 1),
                        round(f["output_tokens_per_s"], 1),
                    ],
                    "wall_s_per_extra": (a["wall_s"] - f["wall_s"]) / extra,
                    "link_busy_s_per_extra": (a["link_busy_s"] - f["link_busy_s"]) / extra,
                    "exposed_s_per_extra": (a["exposed_fetch_s"] - f["exposed_fetch_s"]) / extra,
                    "modeled_first_row_link_s": est["row_link_s"][0],
                    "t_row_s": est["t_row_s"],
                    "realized_accepted_per_extra": (acc_a - acc_f) / extra,
                    "modeled_accepted_per_extra": (exp_acc - acc_f) / extra,
                    "survival_global_1_3": est["survival_global"][:3],
                }
            )
    return out


def step_cost_per_draft(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per baseline: the least-squares line of a run's wall seconds per step
    on its mean verified drafts a round, over every row of that baseline
    (every width and repeat); rows without a width policy's books are left
    out. ``slope_ms_per_draft`` is what one further draft a round added to a
    step."""
    import numpy as np

    by: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in rows:
        width = r.get("verify_width") or {}
        if "mean_verified_drafts" not in width or not r.get("steps"):
            continue
        by[r["baseline"]].append((width["mean_verified_drafts"], r["wall_s"] / r["steps"]))
    out = []
    for base, points in sorted(by.items()):
        x = np.array([p[0] for p in points])
        y = np.array([p[1] for p in points]) * 1e3
        if len(points) < 3 or float(np.ptp(x)) == 0.0:
            continue  # no slope from fewer than three runs or one width
        slope, intercept = np.polyfit(x, y, 1)
        out.append(
            {
                "baseline": base,
                "runs": len(points),
                "drafts_a_round": [round(float(x.min()), 2), round(float(x.max()), 2)],
                "slope_ms_per_draft": float(slope),
                "intercept_ms_per_step": float(intercept),
            }
        )
    return out


def makespan(trace_path: str, widths: tuple[int, ...] = (1, 2, 3, 15)) -> None:
    """CPU model, replayed trace: rounds and closed-loop steps per fixed width."""
    import numpy as np

    z = np.load(trace_path)
    rr, ra = z["round_request"], z["round_accepted"]

    def rounds(r: int, k: int, new_tokens: int = 32) -> int:
        drafts = ra[rr == r] - 1  # round_accepted counts the bonus token
        need, i = new_tokens, 0
        while need > 0:
            need -= min(int(drafts[i % len(drafts)]), k) + 1
            i += 1
        return i

    for k in widths:
        per = [rounds(r, k) for r in range(12)]
        free = [0] * 4
        for n in per:
            c = min(range(4), key=lambda j: free[j])
            free[c] += n
        print(
            json.dumps(
                {
                    "cpu_model_replayed_trace": True,
                    "width": k,
                    "rounds_per_request": per,
                    "total_rounds": sum(per),
                    "makespan_steps": max(free),
                }
            )
        )


def main(paths: list[str]) -> None:
    if paths[:1] == ["--trace"]:
        makespan(paths[1])
        paths = paths[2:]
    for p in paths:
        rows = read_jsonl(p)
        print(f"# {p}")
        for d in pairs(rows) + step_cost_per_draft(rows):
            print(
                json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items()})
            )


if __name__ == "__main__":
    main(sys.argv[1:])
