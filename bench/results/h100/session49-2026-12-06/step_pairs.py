"""Per-step differences of paired runs (same repeat, interleaved), mean ±
1.96 standard errors in ms: the wall, the spans (draft + verify, CUDA
events) and the host time outside the draft, verify, prefill and predict
spans.

    python3 step_pairs.py FOLDER NUM/DEN [NUM/DEN ...]
"""

from __future__ import annotations

import gzip
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any


def _ms(row: dict[str, Any], key: str) -> float:
    return 1e3 * float(row.get(key) or 0.0) / float(row["steps"])


def parts(row: dict[str, Any]) -> dict[str, float]:
    spans = _ms(row, "draft_s") + _ms(row, "verify_s")
    outside = _ms(row, "wall_s") - spans - _ms(row, "prefill_s") - _ms(row, "predict_s")
    return {"outside": outside, "spans": spans, "wall": _ms(row, "wall_s")}


def main(argv: list[str]) -> None:
    folder = Path(argv[0])
    with gzip.open(folder / "rows.jsonl.gz", "rt") as lines:
        rows = [json.loads(line) for line in lines]
    for pair in argv[1:]:
        num, den = pair.split("/")
        for conc in sorted({r["concurrency"] for r in rows}):
            by_rep: dict[int, dict[str, dict[str, float]]] = {}
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
