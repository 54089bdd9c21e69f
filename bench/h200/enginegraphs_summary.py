"""``enginegraphs_ab.sh``'s summary: per point and arm, the recorded
all-resident layer calls (rows' ``resident_graphs``), and each arm with
resident graphs on over its baseline's arm with them off (medians); printed,
and written to ``ROOT/enginegraphs_summary.json``.

    python3 bench/h200/enginegraphs_summary.py ROOT   # ROOT/engine/rows.jsonl
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

# ab_rows.py sits next to this script; `python -P` (or a run from another
# folder's interpreter path) leaves this folder off sys.path
sys.path.insert(0, str(Path(__file__).resolve().parent))
import ab_rows  # type: ignore[import-not-found]

COUNTS = ("replays", "captures", "capture_failures", "mismatches", "evictions", "stale")


def main(root: Path) -> None:
    out = []
    print("== enginegraphs_ab: recorded all-resident layer calls per arm (rows' resident_graphs)")
    for (arch, cf, conc), entry, by_arm in ab_rows.point_entries(ab_rows.load_rows(root)):
        for arm, rs in by_arm.items():
            rec = [r.get("resident_graphs") or {} for r in rs]
            sums = {k: sum(int(g.get(k) or 0) for g in rec) for k in COUNTS}
            eager: Counter[str] = Counter()
            for g in rec:
                eager.update(g.get("eager") or {})
            arm_out: dict[str, Any] = {
                "runs": len(rs),
                "setting": sorted({str(g.get("setting")) for g in rec}),
                "states": dict(Counter(str(g.get("state")) for g in rec)),
                "tokens_per_s_median": ab_rows.median(r.get("output_tokens_per_s") for r in rs),
                "wall_s_sum": sum(float(r.get("wall_s") or 0.0) for r in rs),
                "capture_s_sum": sum(float(g.get("capture_s") or 0.0) for g in rec),
                "distinct_keys_sum": sum(int(g.get("distinct_keys") or 0) for g in rec),
                "all_resident_calls": sums["replays"] + sums["captures"] + sum(eager.values()),
                **sums,
                "eager": dict(eager),
                "capture_errors": sorted(
                    {e for g in rec for e in (g.get("capture_errors") or {}).values()}
                ),
            }
            entry["arms"][arm] = arm_out
            m = arm_out["tokens_per_s_median"]
            print(
                f"{arch} cf{cf} c{conc} {arm:>6}: runs {arm_out['runs']} tok/s med "
                f"{'-' if m is None else f'{m:.2f}'} | calls {arm_out['all_resident_calls']} "
                f"replays {sums['replays']} captures {sums['captures']} "
                f"({arm_out['capture_s_sum']:.3f} s of {arm_out['wall_s_sum']:.1f} s wall) "
                f"keys {arm_out['distinct_keys_sum']} eager {dict(eager)} "
                f"mismatches {sums['mismatches']} states {arm_out['states']}"
                + (f" ERRORS {arm_out['capture_errors']}" if arm_out["capture_errors"] else "")
            )
        # each arm with resident_graphs on against the arm of its baseline with it off
        off = {
            rs[0].get("baseline"): a
            for a, rs in by_arm.items()
            if (rs[0].get("resident_graphs") or {}).get("setting") != "on"
        }
        for arm, rs in by_arm.items():
            if (rs[0].get("resident_graphs") or {}).get("setting") != "on":
                continue
            base = off.get(rs[0].get("baseline"))
            a = entry["arms"][arm]["tokens_per_s_median"]
            b = (entry["arms"].get(base) or {}).get("tokens_per_s_median")
            if a and b:
                entry.setdefault("on_over_off_median", {})[f"{arm}/{base}"] = a / b
                print(f"{arch} cf{cf} c{conc} {arm}/{base} (medians): {a / b:.3f}")
        out.append(entry)
    ab_rows.write_summary(root, "enginegraphs", out)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
