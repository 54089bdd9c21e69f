"""``fullcache_ab.sh``'s summary: per point and arm, the full-cache state
(rows' ``full_cache``), the start, copies and per-part times (medians over
repeats), and each arm over B3; printed, and written to
``ROOT/fullcache_summary.json``.

    python3 bench/h200/fullcache_summary.py ROOT   # ROOT/engine/rows.jsonl
"""

from __future__ import annotations

import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

# ab_rows.py sits next to this script; `python -P` (or a run from another
# folder's interpreter path) leaves this folder off sys.path
sys.path.insert(0, str(Path(__file__).resolve().parent))
import ab_rows  # type: ignore[import-not-found]

MEDIANS = (
    "initial_resident_experts",
    "h2d_bytes",
    "prefill_s",
    "draft_s",
    "router_pass_s",
    "scheduler_us_per_step",
    "exposed_fetch_s",
    "acceptance_length_mean",
    "wall_s",
)


def main(root: Path) -> None:
    rows = ab_rows.load_rows(root)
    # NOTE: B3 rows record cache fraction 1.0 whatever the point's (B3 is one
    # configuration at every point): its rows of both points pool under 1.0,
    # and every point's ARM/B3 reads them
    b3_tps: dict[tuple[Any, Any], list[Any]] = defaultdict(list)
    for r in rows:
        if r.get("arm") == "B3":
            b3_tps[(r.get("arch"), r.get("concurrency"))].append(r.get("output_tokens_per_s"))
    out = []
    print("== fullcache_ab: per arm and point (medians over repeats)")
    for (arch, cf, conc), entry, by_arm in ab_rows.point_entries(rows):
        for arm, rs in by_arm.items():
            full = [r.get("full_cache") or {} for r in rs]
            verify_ms = [
                1e3 * r["verify_s"] / r["verify_forwards"]
                for r in rs
                if isinstance(r.get("verify_s"), (int, float)) and r.get("verify_forwards")
            ]
            a: dict[str, Any] = {
                "runs": len(rs),
                "tokens_per_s_median": ab_rows.median(r.get("output_tokens_per_s") for r in rs),
                "full_cache_states": dict(Counter(str(f.get("state")) for f in full)),
                "switched_off": sorted({p for f in full for p in (f.get("switched_off") or {})}),
                "why_off": sorted({str(f["why_off"]) for f in full if f.get("why_off")}),
                "verify_ms_per_forward_median": ab_rows.median(verify_ms),
                **{k + "_median": ab_rows.median(r.get(k) for r in rs) for k in MEDIANS},
            }
            entry["arms"][arm] = a
            m = a["tokens_per_s_median"]
            print(
                f"{arch} cf{cf} c{conc} {arm:>6}: runs {a['runs']} "
                f"tok/s {'-' if m is None else f'{m:.1f}'} "
                f"full_cache {a['full_cache_states']} off {a['switched_off']} "
                f"| start {a['initial_resident_experts_median']} h2d {a['h2d_bytes_median']} "
                f"prefill {a['prefill_s_median']} verify ms/fwd {a['verify_ms_per_forward_median']} "
                f"draft {a['draft_s_median']} router {a['router_pass_s_median']} "
                f"sched us {a['scheduler_us_per_step_median']} exposed {a['exposed_fetch_s_median']} "
                f"tau {a['acceptance_length_mean_median']}"
            )
        b3 = ab_rows.median(b3_tps[(arch, conc)])
        for arm, a in entry["arms"].items():
            m = a["tokens_per_s_median"]
            if arm != "B3" and m and b3:
                entry.setdefault("over_b3_median", {})[arm] = m / b3
                print(f"{arch} cf{cf} c{conc} {arm}/B3 (medians): {m / b3:.3f}")
        out.append(entry)
    ab_rows.write_summary(root, "fullcache", out)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
