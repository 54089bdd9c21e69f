"""First-use cost in a matrix's rows: how much slower each point's first
repeat verified, and whether that follows the attention shapes it met first.

A run's verify time per forward is compared with the median of its point's
later repeats (the matrix's own ``first_use`` ratio uses the same
reference); its *excess* is that difference times its forwards, in seconds.
Every row records ``sdpa_shapes.new_in_run``: the distinct SDPA call shapes
the process ran for the first time inside that run's clock. Where a backend
sets itself up once per shape (cuDNN builds a plan), the excess should rise
with them: the pooled least-squares slope (seconds per new shape) and the
correlation over every run of one SDPA backends setting say how much. The
rows record the setting (``sdpa_backends``): a file taken under one
``PDFLASH_SDPA_BACKENDS`` (``bench/h200/firstuse_ab.sh`` runs one process
per setting) is one summary; a file whose runs set ``sdpa_backends`` per
run is split, one summary per setting (:func:`by_backends`).

Usage: python bench/firstuse_summary.py [--json] ROWS.jsonl[.gz] [...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from pdflash.report.writers import read_jsonl


def _width(row: dict[str, Any]) -> Any:
    width = row.get("verify_width")
    return width.get("setting") if isinstance(width, dict) else width


def _point(row: dict[str, Any]) -> tuple[Any, ...]:
    return (
        row.get("arch"),
        row.get("baseline"),
        row.get("concurrency"),
        row.get("cache_fraction"),
        _width(row),
    )


def _ms_per_forward(row: dict[str, Any]) -> float | None:
    forwards, verify_s = row.get("verify_forwards"), row.get("verify_s")
    if not forwards or verify_s is None:
        return None
    return 1000.0 * float(verify_s) / int(forwards)


def runs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every run of a point with at least one later repeat: its repeat, ms
    per verify forward, the reference (the median of the point's later
    repeats), its excess seconds and its new SDPA shapes (None where the
    row predates the count)."""
    by: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        if _ms_per_forward(row) is not None:
            by[_point(row)].append(row)
    out = []
    for point, group in by.items():
        group = sorted(group, key=lambda r: int(r.get("repeat") or 0))
        later = [_ms_per_forward(r) for r in group[1:]]
        if not later:
            continue
        reference = statistics.median(x for x in later if x is not None)
        for i, row in enumerate(group):
            ms = _ms_per_forward(row)
            assert ms is not None
            shapes = row.get("sdpa_shapes")
            new = shapes.get("new_in_run") if isinstance(shapes, dict) else None
            out.append(
                {
                    "point": list(point),
                    "repeat": int(row.get("repeat") or 0),
                    "first": i == 0,
                    "ms_per_forward": ms,
                    "reference_ms": reference,
                    "excess_s": (ms - reference) * int(row["verify_forwards"]) / 1000.0,
                    "new_sdpa_shapes": new,
                }
            )
    return out


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per point the first repeat's ratio and shapes; pooled, the slope of
    excess seconds on new shapes and their correlation (None with fewer than
    three counted runs or no spread in the shapes). The rows must share one
    SDPA backends setting (:func:`by_backends` splits them); ValueError
    otherwise."""
    backends = sorted({str(r.get("sdpa_backends")) for r in rows if "sdpa_backends" in r})
    if len(backends) > 1:
        raise ValueError(
            f"rows of {len(backends)} SDPA backends settings ({', '.join(backends)}): "
            "summarise each apart (by_backends)"
        )
    every = runs(rows)
    points = []
    for r in every:
        if not r["first"]:
            continue
        later_new = [
            x["new_sdpa_shapes"]
            for x in every
            if x["point"] == r["point"] and not x["first"] and x["new_sdpa_shapes"] is not None
        ]
        points.append(
            {
                "point": r["point"],
                "first_ratio": r["ms_per_forward"] / r["reference_ms"],
                "first_excess_s": r["excess_s"],
                "first_new_shapes": r["new_sdpa_shapes"],
                "later_new_shapes_median": statistics.median(later_new) if later_new else None,
            }
        )
    counted = [
        (r["new_sdpa_shapes"], r["excess_s"]) for r in every if r["new_sdpa_shapes"] is not None
    ]
    slope = corr = None
    if len(counted) >= 3:
        x = np.array([c[0] for c in counted], dtype=np.float64)
        y = np.array([c[1] for c in counted], dtype=np.float64)
        if np.ptp(x) > 0:
            slope = float(np.polyfit(x, y, 1)[0])
            if np.ptp(y) > 0:
                corr = float(np.corrcoef(x, y)[0, 1])
    return {
        "sdpa_backends": backends,
        "runs": len(every),
        "points": points,
        "excess_s_per_new_shape": slope,
        "correlation": corr,
        "counted_runs": len(counted),
    }


def by_backends(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One :func:`summary` per SDPA backends setting the rows record, in
    the order of the settings' names (rows without the field count as one
    setting of their own)."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[str(row.get("sdpa_backends"))].append(row)
    return [summary(groups[key]) for key in sorted(groups)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rows", nargs="+", type=Path)
    ap.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object per file and SDPA backends setting",
    )
    args = ap.parse_args(argv)
    for path in args.rows:
        for s in by_backends(read_jsonl(path)):
            if args.json:
                print(json.dumps({"rows": str(path), **s}))
                continue
            print(f"{path}: sdpa_backends {s['sdpa_backends']}, {s['runs']} runs")
            for p in s["points"]:
                later = p["later_new_shapes_median"]
                print(
                    f"  {'/'.join(str(v) for v in p['point'])}: first repeat "
                    f"{p['first_ratio']:.2f}x its later median, {p['first_excess_s']:+.3f} s, "
                    f"new SDPA shapes {p['first_new_shapes']} (later median {later})"
                )
            if s["excess_s_per_new_shape"] is None:
                print(f"  slope: not computed ({s['counted_runs']} runs with a shape count)")
            else:
                corr = "n/a" if s["correlation"] is None else f"{s['correlation']:.2f}"
                print(
                    f"  excess per new shape {1000 * s['excess_s_per_new_shape']:.1f} ms "
                    f"(correlation {corr}, {s['counted_runs']} runs)"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
