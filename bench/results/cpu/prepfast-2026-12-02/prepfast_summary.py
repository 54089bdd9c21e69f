"""Before/after table from measure.sh's rows: python prepfast_summary.py BEFORE AFTER."""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from typing import Any


def load(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main() -> None:
    before, after = load(sys.argv[1]), load(sys.argv[2])

    def groups(rows: list[dict[str, Any]]) -> dict[tuple[Any, ...], list[dict[str, Any]]]:
        g: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
        for r in rows:
            g[(r["preset"], r["layers"], r["experts"], r["fmt"])].append(r)
        return g

    gb, ga = groups(before), groups(after)
    print("digests (every prepared tensor, sha256) before/after, by the format prepared:")
    for key in sorted(gb):
        for fmt in sorted({r["chosen"] for r in gb[key] + ga.get(key, [])}):
            db = {r["digest"] for r in gb[key] if r["chosen"] == fmt}
            da = {r["digest"] for r in ga.get(key, []) if r["chosen"] == fmt}
            if not db or not da:
                verdict = f"chosen only {'before' if db else 'after'} (no pair to compare)"
            else:
                verdict = "equal" if db == da and len(db) == 1 else "DIFFERENT"
            print(f"  {key} -> {fmt}: {verdict}")
    print("\nmedians over fresh processes (s): before -> after (n)")
    for key in sorted(gb):
        if len(gb[key]) < 2:
            continue
        line = []
        for field in ("total_s", "select_s", "prepare_s"):
            vb = [r[field] for r in gb[key] if r[field] is not None]
            va = [r[field] for r in ga[key] if r[field] is not None]
            if vb and va:
                mb, ma = statistics.median(vb), statistics.median(va)
                line.append(f"{field} {mb:.3f} -> {ma:.3f} (x{mb / ma:.2f})")
        print(f"  {key} n={len(gb[key])}/{len(ga[key])}: " + "; ".join(line))


if __name__ == "__main__":
    main()
