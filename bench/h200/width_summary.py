"""``width_ab.sh``'s summary: per point and arm, the verify width's
decisions and estimates (rows' ``verify_width``), tau, steps and tokens/s
(medians over repeats), and the adaptive arm over the full-width one
(``PD`` over ``PDfull``, PD's preset being adaptive; in tars recorded
while PD's preset was full, ``PDadaptive`` over ``PD``); printed, and
written to
``ROOT/width_summary.json``.

    python3 bench/h200/width_summary.py ROOT   # ROOT/engine/rows.jsonl
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# ab_rows.py sits next to this script; `python -P` (or a run from another
# folder's interpreter path) leaves this folder off sys.path
sys.path.insert(0, str(Path(__file__).resolve().parent))
import ab_rows  # type: ignore[import-not-found]


def med(values: Iterable[Any]) -> float | None:
    """The median of the numbers among ``values``, as floats."""
    return ab_rows.median(values, as_float=True)


def fmt(v: float | None, spec: str = ".3g") -> str:
    return "-" if v is None else format(v, spec)


def main(root: Path) -> None:
    out = []
    print("== width_ab: adaptive verify width vs every draft (medians over repeats)")
    for (arch, cf, conc), entry, by_arm in ab_rows.point_entries(ab_rows.load_rows(root)):
        for arm, rs in by_arm.items():
            vws = [r.get("verify_width") or {} for r in rs]
            est = [vw.get("estimates") or {} for vw in vws]
            surv: list[list[float]] = [
                e["survival_global"] for e in est if e.get("survival_global")
            ]
            hists = [vw["width_histogram"] for vw in vws if vw.get("width_histogram")]
            arm_out: dict[str, Any] = {
                "runs": len(rs),
                "setting": sorted({str(vw.get("setting")) for vw in vws}),
                # the width the engine ran (full where a full cache switched
                # adaptive off); rows recorded before it was kept: None
                "ran": sorted({str(vw["ran"]) for vw in vws if "ran" in vw}) or None,
                "tokens_per_s_median": med(r.get("output_tokens_per_s") for r in rs),
                "tau_median": med(r.get("acceptance_length_mean") for r in rs),
                "steps_median": med(r.get("steps") for r in rs),
                "mean_width_median": med(vw.get("mean_width_drafts") for vw in vws),
                "mean_available_median": med(vw.get("mean_available_drafts") for vw in vws),
                "exploration_decisions_median": med(vw.get("exploration_decisions") for vw in vws),
                "t_row_s_median": med(e.get("t_row_s") for e in est),
                "t_row_fit_s_median": med(e.get("t_row_fit_s") for e in est),
                "survival_median": [statistics.median(s[j] for s in surv) for j in range(8)]
                if surv and all(len(s) >= 8 for s in surv)
                else None,
                "width_histogram_sum": [sum(h) for h in zip(*hists, strict=False)] or None,
            }
            entry["arms"][arm] = arm_out
            w, a = arm_out["mean_width_median"], arm_out["mean_available_median"]
            print(
                f"{arch} cf{cf} c{conc} {arm:>6}: runs {arm_out['runs']} "
                f"tok/s {fmt(arm_out['tokens_per_s_median'], '.1f')} "
                f"tau {fmt(arm_out['tau_median'], '.2f')} "
                f"steps {fmt(arm_out['steps_median'], '.0f')} "
                f"ran {arm_out['ran']} "
                f"width/avail {fmt(w, '.2f')}/{fmt(a, '.2f')} "
                f"explore {fmt(arm_out['exploration_decisions_median'], '.0f')} "
                f"t_row {fmt(arm_out['t_row_s_median'])} "
                f"t_row_fit {fmt(arm_out['t_row_fit_s_median'])} "
                f"S {arm_out['survival_median']}"
            )
        # (adaptive arm, full-width arm): a tar of while PD's preset was full
        # has PDadaptive; today's, and older ones, PD (adaptive) and PDfull
        pair = ("PDadaptive", "PD") if "PDadaptive" in entry["arms"] else ("PD", "PDfull")
        adaptive, full = (entry["arms"].get(arm) for arm in pair)
        if adaptive and full and adaptive["tokens_per_s_median"] and full["tokens_per_s_median"]:
            ratio = adaptive["tokens_per_s_median"] / full["tokens_per_s_median"]
            entry["adaptive_over_full_median"] = ratio
            entry["adaptive_over_full_arms"] = list(pair)
            print(f"{arch} cf{cf} c{conc} {pair[0]}/{pair[1]} (medians): {ratio:.3f}")
        out.append(entry)
    ab_rows.write_summary(root, "width", out)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
