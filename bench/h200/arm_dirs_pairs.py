"""Pair two arms of a one-process-per-arm A/B (``mxfp4dot_engine_ab.sh``:
``ROOT/<arm>/rows.jsonl``, or its committed ``.gz``) by (repeat, seed) and
print the per-pair ratios NUM/DEN of tokens/s and of verify ms a forward,
their median and 95% interval (:func:`pdflash.report.stats.pair_summary`):

    python3 bench/h200/arm_dirs_pairs.py ROOT NUM DEN
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


def main() -> int:
    from pdflash.report.stats import pair_summary
    from pdflash.report.writers import read_jsonl, results_path

    root, num, den = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    rows: dict[str, dict[tuple[Any, Any], dict[str, Any]]] = {}
    for arm in (num, den):
        path = results_path(root / arm / "rows.jsonl")
        rows[arm] = {(r["repeat"], r["seed"]): r for r in read_jsonl(path)}
    keys = sorted(set(rows[num]) & set(rows[den]))
    metrics = {
        "tokens/s": lambda r: r["output_tokens_per_s"],
        "verify ms a forward": lambda r: 1e3 * r["verify_s"] / r["verify_forwards"],
    }
    for name, metric in metrics.items():
        s = pair_summary(
            {i: metric(rows[num][k]) for i, k in enumerate(keys)},
            {i: metric(rows[den][k]) for i, k in enumerate(keys)},
        )
        # the interval against 1: a ratio of times is better below it
        called = "within noise"
        if s["high"] < 1 or s["low"] > 1:
            called = "lower" if s["high"] < 1 else "higher"
        print(
            f"{num}/{den} {name}: median {s['median']:.3f} [{s['low']:.3f}, {s['high']:.3f}] "
            f"({called}; {s['n']} pairs: {', '.join(f'{x:.3f}' for x in s['ratios'])})"
        )
    for arm in (num, den):
        over = sorted(r["verify_over_roofline"] for r in rows[arm].values())
        print(f"{arm}: verify x roofline {over[0]:.2f} .. {over[-1]:.2f} over {len(over)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
