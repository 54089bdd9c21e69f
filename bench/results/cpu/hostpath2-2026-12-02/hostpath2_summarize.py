"""Medians of ab.sh's interleaved runs: per side, forward_us, the parts and
the --detail methods (µs per step), torch calls per part, misses/copies.
``python3 hostpath2_summarize.py ab_cache0.2.jsonl ab_cache1.0.jsonl``"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def main() -> int:
    for path in sys.argv[1:]:
        rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
        print(f"## {path} ({len(rows)} runs)")
        keys = sorted({k for r in rows for k in r["detail_us_mean"]})
        for side in ("before", "after"):
            rs = [r for r in rows if r["side"] == side]

            def med(f: Callable[[Any], float], rs: list[dict[str, Any]] = rs) -> float:
                return round(float(statistics.median(f(r) for r in rs)), 1)

            print(
                side,
                "forward_us",
                med(lambda r: r["forward_us"]),
                "books",
                med(lambda r: r["parts_us"]["books"]),
                "moe_rest",
                med(lambda r: r["parts_us"]["moe_rest"]),
                "misses/copies",
                sorted({(r["misses_per_step"], r["copies_per_step"]) for r in rs}),
            )
            print(
                "  torch calls total/books/moe_rest",
                med(lambda r: r["torch_calls_per_step"]["total"]),
                med(lambda r: r["torch_calls_per_step"]["books"]),
                med(lambda r: r["torch_calls_per_step"]["moe_rest"]),
            )
            detail = {
                k: round(statistics.median(r["detail_us_mean"].get(k, 0.0) for r in rs), 1)
                for k in keys
            }
            print("  ", detail)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
