"""Before/after table of the marginal rule from the probe's ``rows.jsonl``.

    python bench/results/cpu/marginal-2026-12-02/compare.py DIR [DIR ...]

Per folder and label (concurrency included): the runs' engine steps,
bytes per committed token, output tokens/s, the share of steps whose 2-D
batch differed from the token-only shadow's, and M and F; each a list over
the repeats, then each label's median tokens/s over PD-token-sched's
median of the same folder.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path
from statistics import median
from typing import Any

from pdflash.report.writers import read_jsonl


def _fmt(xs: list[Any], nd: int = 0) -> str:
    return ", ".join("—" if x is None else f"{x:.{nd}f}" for x in xs)


def _rule(row: dict[str, Any]) -> str:
    """The marginal rule as it applied: ``verify`` with F set, else ``off``."""
    return "verify" if row.get("fixed_step_bytes") is not None else "off"


def main() -> int:
    for folder in map(Path, sys.argv[1:]):
        runs: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
        for row in read_jsonl(folder / "rows.jsonl"):
            runs[(row["baseline"], row["concurrency"])].append(row)
        print(f"\n{folder}")
        print(
            "| label | c | marginal rule | steps | bytes / token | tokens/s "
            "| 2-D batch differed (share of steps) | M (B) | F (B) | tokens/s vs token-only (median) |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for (label, c), rows in sorted(runs.items()):
            rows.sort(key=lambda r: r["repeat"])
            ref = runs.get(("PD-token-sched", c))
            ratio = "—"
            if ref:
                base = median(r["output_tokens_per_s"] for r in ref)
                ratio = f"{median(r['output_tokens_per_s'] for r in rows) / base:.2f}"
            print(
                f"| {label} | {c} | {_rule(rows[0])} "
                f"| {_fmt([r['steps'] for r in rows])} "
                f"| {_fmt([r['bytes_per_token'] for r in rows])} "
                f"| {_fmt([r['output_tokens_per_s'] for r in rows])} "
                f"| {_fmt([r.get('token_only_differing_step_fraction') for r in rows], 2)} "
                f"| {_fmt([r.get('byte_budget') for r in rows])} "
                f"| {_fmt([r.get('fixed_step_bytes') for r in rows])} | {ratio} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
