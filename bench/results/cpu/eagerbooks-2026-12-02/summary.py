"""Per (shape, side) of ab.sh's rows: the median and the minimum over runs of
each run's median µs per step, for the forward and each part."""

import json
import statistics
import sys
from collections import defaultdict
from typing import Any

with open(sys.argv[1]) as f:
    rows = [json.loads(line) for line in f]
by: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
for r in rows:
    by[(r["shape"], r["side"])].append(r["result"])


def values(runs: list[dict[str, Any]], key: str) -> list[float]:
    if key in ("forward_us", "glue_us", "misses_per_step", "copies_per_step"):
        return [float(x[key]) for x in runs]
    if key in runs[0]["parts_us"]:
        return [float(x["parts_us"][key]) for x in runs]
    return [float(x.get("detail_us_mean", {}).get(key, 0.0)) for x in runs]


for shape in sorted({s for s, _ in by}):
    res = {side: by[(shape, side)] for side in ("before", "after") if (shape, side) in by}
    keys = ["forward_us", *next(iter(res.values()))[0]["parts_us"], "glue_us"]
    details = sorted({k for v in res.values() for x in v for k in x.get("detail_us_mean", {})})
    runs = ", ".join(f"{s}: {len(v)} runs" for s, v in res.items())
    print(f"\n### {shape} ({runs})\n")
    head = [f"{s} median" for s in res] + [f"{s} min" for s in res]
    print("| µs per step | " + " | ".join(head) + " |")
    print("|---|" + "---:|" * len(head))
    for k in [*keys, *details, "misses_per_step", "copies_per_step"]:
        med = [statistics.median(values(v, k)) for v in res.values()]
        low = [min(values(v, k)) for v in res.values()]
        fmt = "{:.1f}" if k.endswith("per_step") else "{:.0f}"
        print(f"| {k} | " + " | ".join(fmt.format(x) for x in med + low) + " |")
