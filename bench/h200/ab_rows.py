"""The rows of a ``bench/h200/issue16.py`` A/B run, grouped for the A/B
scripts' summaries (``enginegraphs_summary.py``, ``width_summary.py``,
``fullcache_summary.py``; ``switches_ab.sh`` runs them with ``SUMMARY=``),
and what those summaries build their output with: each point's entry, the
medians, the JSON file.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

#: a point: (arch, cache fraction, concurrency), as the rows record them
Point = tuple[Any, Any, Any]
Row = dict[str, Any]


def load_rows(root: Path) -> list[Row]:
    """The run's rows (``root/engine/rows.jsonl``, or its committed ``.gz``;
    none where it is absent)."""
    from pdflash.report.writers import read_jsonl, results_path

    rows_file = results_path(root / "engine" / "rows.jsonl")
    return read_jsonl(rows_file) if rows_file.is_file() else []


def by_point_and_arm(rows: list[Row]) -> dict[Point, dict[Any, list[Row]]]:
    """``rows`` grouped by point, then by arm, in the rows' order."""
    points: dict[Point, dict[Any, list[Row]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        points[(r.get("arch"), r.get("cache_fraction"), r.get("concurrency"))][r.get("arm")].append(
            r
        )
    return points


def point_entries(rows: list[Row]) -> Iterator[tuple[Point, dict[str, Any], dict[Any, list[Row]]]]:
    """Each point of ``rows`` in the summaries' print order, with the
    summary's entry for it (its ``arms`` for the summary to fill) and its
    rows by arm (:func:`by_point_and_arm`)."""
    for point, by_arm in sorted(by_point_and_arm(rows).items(), key=lambda kv: str(kv[0])):
        arch, cf, conc = point
        yield point, {"arch": arch, "cache_fraction": cf, "concurrency": conc, "arms": {}}, by_arm


def median(values: Iterable[Any], as_float: bool = False) -> Any:
    """The median of the numbers among ``values`` (each made a float first
    with ``as_float``); None where there is none."""
    numbers = [float(v) if as_float else v for v in values if isinstance(v, (int, float))]
    return statistics.median(numbers) if numbers else None


def write_summary(root: Path, name: str, points: list[dict[str, Any]]) -> None:
    """The summary's entries as ``root/<name>_summary.json``."""
    (root / f"{name}_summary.json").write_text(json.dumps({"points": points}, indent=1))
