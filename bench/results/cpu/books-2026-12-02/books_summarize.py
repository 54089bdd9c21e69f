"""Medians of ab.sh's interleaved before/after rows: books us per MoE layer
(parts_us.books / layers) and per method (detail_us_mean: per-step means,
/ layers), forward_us.   python3 books_summarize.py ab_*.jsonl"""

from __future__ import annotations

import json
import statistics
import sys


def main(paths: list[str]) -> None:
    for path in paths:
        with open(path) as f:
            rows = [json.loads(line) for line in f]
        r0 = rows[0]
        print(
            f"{path}: preset {r0['preset']}, {r0['layers']} layers, cache {r0['cache_fraction']}, "
            f"misses/step {r0['misses_per_step']:.2f}"
        )
        for side in ("before", "after"):
            mine = [r for r in rows if r["side"] == side]
            layers = mine[0]["layers"]
            books = [r["parts_us"]["books"] / layers for r in mine]
            forward = statistics.median(r["forward_us"] for r in mine)
            per: dict[str, list[float]] = {}
            for r in mine:
                for k, v in r["detail_us_mean"].items():
                    if k.startswith("books."):
                        per.setdefault(k[len("books.") :], []).append(v / layers)
            methods = {k: round(statistics.median(v), 1) for k, v in sorted(per.items())}
            print(
                f"  {side:6s} books us/layer {statistics.median(books):7.1f} "
                f"(runs {[round(b, 1) for b in books]}), forward_us {forward:.0f}"
            )
            print(f"         per method, us/layer: {methods}")


if __name__ == "__main__":
    main(sys.argv[1:])
