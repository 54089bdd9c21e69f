"""Per-repeat tokens/s ratios between two configurations of one rows file.

A configuration is a row's ``arm`` (issue16.py's A/Bs) or, where rows have
none, its ``baseline`` with its verify width setting (``B1[fixed:1]``; the
matrix's rows). For each ``NUM/DEN`` pair it prints the ratio of NUM's
tokens/s to DEN's in every repeat both ran (the interleaved pairs), their
median, and the t-based 95% interval of the ratios
(:func:`pdflash.report.stats.interval`): an interval that excludes 1 is a
difference outside the pairs' noise. Points (arch, cache fraction,
concurrency) are kept apart, and a pair where either run's clock held
CUDA-graph captures is named (it is confounded). No GPU: the rows are
read as committed.

Several rows files pool their pairs (the same arms run in several calls):
a pair stays within its file, and each file's repeats are numbered on after
the previous file's (the printed repeats are those pooled numbers).

Usage: python bench/pair_ratios.py ROWS.jsonl[.gz] [ROWS ...] NUM/DEN [NUM/DEN ...]
"""

from __future__ import annotations

import statistics
import sys
from typing import Any

from pdflash.report.stats import interval, paired, ratio_verdict
from pdflash.report.writers import read_jsonl

# the pairing and its verdict are pdflash.report.stats'; the A/B scripts take them from here
__all__ = ["captures_in_clock", "config_of", "pair_ratios", "paired", "point_of", "ratio_verdict"]


def config_of(row: dict[str, Any]) -> str:
    """The row's arm, else its baseline with its verify width setting."""
    if row.get("arm"):
        return str(row["arm"])
    width = row.get("verify_width")
    setting = width.get("setting") if isinstance(width, dict) else None
    return f"{row['baseline']}[{setting}]" if setting else str(row["baseline"])


def point_of(row: dict[str, Any]) -> tuple[str, float, int]:
    return (str(row["arch"]), float(row["cache_fraction"]), int(row["concurrency"]))


def captures_in_clock(row: dict[str, Any]) -> int:
    """CUDA-graph captures (target and drafter) a run recorded inside its
    clock: 0 without graphs."""
    graphs = row.get("cuda_graphs")
    if not isinstance(graphs, dict):
        return 0
    return int(graphs.get("captures_in_run") or 0) + int(graphs.get("draft_captures_in_run") or 0)


def pair_ratios(rows: list[dict[str, Any]], num: str, den: str) -> list[dict[str, Any]]:
    """Per point where both ran: the repeats paired, NUM/DEN tokens/s in
    each, their median and interval (``None`` with fewer than two pairs),
    and the paired repeats in which either side's clock held CUDA-graph
    captures (``captured_repeats``: those pairs are confounded)."""
    tok_s: dict[tuple[tuple[str, float, int], str], dict[int, float]] = {}
    captured: set[tuple[tuple[str, float, int], str, int]] = set()
    for r in rows:
        value = r.get("output_tokens_per_s")
        if value is None or r.get("repeat") is None:
            continue
        key = (point_of(r), config_of(r))
        tok_s.setdefault(key, {})[int(r["repeat"])] = float(value)
        if captures_in_clock(r):
            captured.add((*key, int(r["repeat"])))
    out = []
    for point in sorted({p for p, _ in tok_s}):
        a, b = tok_s.get((point, num)), tok_s.get((point, den))
        if not a or not b:
            continue
        pairs = paired(a, b)
        if not pairs:
            continue
        repeats = [k for k, _ in pairs]
        ratios = [x for _, x in pairs]
        iv = interval(ratios) if len(ratios) > 1 else None
        out.append(
            {
                "point": point,
                "num": num,
                "den": den,
                "repeats": repeats,
                "ratios": ratios,
                "median": statistics.median(ratios),
                "interval": None if iv is None else (iv.low, iv.high),
                "captured_repeats": [
                    k for k in repeats if (point, num, k) in captured or (point, den, k) in captured
                ],
            }
        )
    return out


def pooled(files: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The rows of several files as one, each file's repeats renumbered on
    after the previous file's so that pairs never cross files (copies: the
    given rows are not changed)."""
    out: list[dict[str, Any]] = []
    start = 0
    for rows in files:
        repeats = [int(r["repeat"]) for r in rows if r.get("repeat") is not None]
        out.extend(
            r if r.get("repeat") is None else {**r, "repeat": start + int(r["repeat"])}
            for r in rows
        )
        start += max(repeats) + 1 if repeats else 0
    return out


def _is_rows_file(arg: str) -> bool:
    return arg.endswith((".jsonl", ".jsonl.gz"))


def main(argv: list[str]) -> int:
    paths = [a for a in argv if _is_rows_file(a)]
    specs = [a for a in argv if not _is_rows_file(a)]
    if not paths or not specs or any("/" not in a for a in specs):
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    rows = pooled([read_jsonl(path) for path in paths])
    known = sorted({config_of(r) for r in rows})
    status = 0
    for spec in specs:
        num, den = spec.split("/", 1)
        missing = [c for c in (num, den) if c not in known]
        if missing:
            print(f"{spec}: no rows for {', '.join(missing)} (configurations: {known})")
            status = 1
            continue
        for p in pair_ratios(rows, num, den):
            iv = p["interval"]
            iv_text = "one pair: no interval" if iv is None else f"[{iv[0]:.2f}, {iv[1]:.2f}]"
            arch, cache, conc = p["point"]
            captured = p["captured_repeats"]
            print(
                f"{arch} cache {cache:g} c={conc}: {num}/{den} median {p['median']:.3f} "
                f"{iv_text} pairs ({', '.join(f'{x:.2f}' for x in p['ratios'])})"
                + (f"; graph captures in the clock in repeats {captured}" if captured else "")
            )
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
