"""Median setup_s per phase of before.jsonl and after.jsonl (markdown tables).

usage: python setupcost_summary.py [BEFORE] [AFTER]
"""

from __future__ import annotations

import json
import statistics
import sys
from typing import Any


def load(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.startswith("{")]


def median(rows: list[dict[str, Any]], key: str) -> str:
    values = [r["run_spec_s"] if key == "run_spec_s" else r["setup_s"].get(key) for r in rows]
    present = [v for v in values if v is not None]
    return f"{statistics.median(present):.3f}" if present else "-"


def main() -> None:
    before = load(sys.argv[1] if len(sys.argv) > 1 else "before.jsonl")
    after = load(sys.argv[2] if len(sys.argv) > 2 else "after.jsonl")
    for baseline in ("PD+host", "PD"):
        rb = [r for r in before if r["baseline"] == baseline]
        ra = [r for r in after if r["baseline"] == baseline]
        keys: list[str] = []
        for r in rb + ra:
            keys += [k for k in r["setup_s"] if k not in keys]
        keys.append("run_spec_s")
        print(f"\n{baseline} (runs: before {len(rb)}, after {len(ra)}), median seconds\n")
        print("| phase | before | after |\n|---|---:|---:|")
        for k in keys:
            print(f"| {k} | {median(rb, k)} | {median(ra, k)} |")


if __name__ == "__main__":
    main()
