"""Summarize ab.sh rows: ``python hostidle_summarize.py DIR TAG...``."""

import glob
import json
import statistics
import sys
from collections import defaultdict

HOST_PARTS = (
    "host_split",
    "host_part",
    "host_rows",
    "host_d2h",
    "host_launch",
    "host_submit",
    "host_start",
    "host_result",
    "host_finish",
    "host_write",
)


def main() -> None:
    root = sys.argv[1]
    for tag in sys.argv[2:]:
        rows = defaultdict(list)
        for f in sorted(glob.glob(f"{root}/{tag}-*.json")):
            arm = f.split("/")[-1].split("-")[1]
            with open(f) as fh:
                rows[arm].append(json.load(fh))
        print("==", tag)
        for arm in ("none", "forced0", "makespan", "queue"):
            rs = rows.get(arm, [])
            if not rs:
                continue
            fw = [r["forward_us"] for r in rs]
            per = [((r.get("host") or {}).get("per_step_us") or {}) for r in rs]
            split = [p.get("host_split", 0.0) for p in per]
            part = [p.get("host_part", 0.0) for p in per]
            calls = [r["torch_calls_per_step"]["total"] for r in rs]
            hcalls = [sum(r["torch_calls_per_step"].get(p, 0) for p in HOST_PARTS) for r in rs]
            misses = statistics.median(r["misses_per_step"] for r in rs)
            print(
                f"{arm:9s} n={len(rs)} forward_us median {statistics.median(fw):.0f} "
                f"(runs {[round(x) for x in fw]}) host_split us/step {statistics.median(split):.1f} "
                f"host_part {statistics.median(part):.1f} torch calls/step "
                f"{statistics.median(calls)} (host parts {statistics.median(hcalls)}) "
                f"misses/step {misses:.1f}"
            )


if __name__ == "__main__":
    main()
