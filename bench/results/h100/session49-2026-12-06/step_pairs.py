"""Per-step differences of paired runs (same repeat, interleaved), mean ±
1.96 standard errors in ms: the wall, the spans (draft + verify, CUDA
events) and the host time outside the draft, verify, prefill and predict
spans.

    python3 step_pairs.py FOLDER NUM/DEN [NUM/DEN ...]

FOLDER's rows*.jsonl.gz files pool their pairs: a pair stays within its
file (one device call), as bench/pair_ratios.py pools them.
"""

from __future__ import annotations

import gzip
import importlib
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

# the outside-span time as the CPU rest study reads it (one definition)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "cpu" / "rest-2026-12-06"))
rest_summary: Any = importlib.import_module("rest_summary")


def parts(row: dict[str, Any]) -> dict[str, float]:
    per_step = rest_summary._per_step_ms
    return {
        "outside": rest_summary.outside_spans_ms(row),
        "spans": per_step(row, "draft_s") + per_step(row, "verify_s"),
        "wall": per_step(row, "wall_s"),
    }


def main(argv: list[str]) -> None:
    folder = Path(argv[0])
    rows: list[dict[str, Any]] = []
    for file_number, path in enumerate(sorted(folder.glob("rows*.jsonl.gz"))):
        with gzip.open(path, "rt") as lines:
            for line in lines:
                row = json.loads(line)
                row["repeat"] = (file_number, row["repeat"])
                rows.append(row)
    for pair in argv[1:]:
        num, den = pair.split("/")
        for conc in sorted({r["concurrency"] for r in rows}):
            by_rep: dict[tuple[int, int], dict[str, dict[str, float]]] = {}
            for r in rows:
                if r["concurrency"] == conc and r["arm"] in (num, den):
                    by_rep.setdefault(r["repeat"], {})[r["arm"]] = parts(r)
            both = [d for d in by_rep.values() if len(d) == 2]
            if len(both) < 2:
                continue
            out = []
            for key in ("outside", "spans", "wall"):
                diffs = [d[num][key] - d[den][key] for d in both]
                half = 1.96 * statistics.stdev(diffs) / math.sqrt(len(diffs))
                out.append(f"{key} {statistics.mean(diffs):+.3f} ± {half:.3f}")
            print(f"{folder.name} c={conc} {num} - {den} ({len(both)} pairs): " + ", ".join(out))


if __name__ == "__main__":
    main(sys.argv[1:])
