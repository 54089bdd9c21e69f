"""Per-process medians a step of ``default_ab.py`` rows: PD's host time
outside the forwards' spans (the wall less the draft, verify, prefill and
predict spans) beyond B1's, PD's scheduler time and the share of PD's steps
its controller read at rest. :func:`pooled_pairs`, :func:`pair_summary` and :func:`print_pairs`
serve the later CPU studies' summaries (``../rest-cuts-2026-12-06/``,
``../steady-state-2026-12-06/``, ``../rest-b1-step-2026-12-06/``).

    python3 rest_summary.py            # every folder here with rows.jsonl
    python3 rest_summary.py new1 old1  # these folders
"""

from __future__ import annotations

import gzip
import json
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _per_step_ms(row: dict[str, Any], key: str) -> float:
    value = row.get(key)
    return 1e3 * value / row["steps"] if isinstance(value, (int, float)) else 0.0


def outside_spans_ms(row: dict[str, Any]) -> float:
    """The row's host time a step outside the forwards' spans."""
    spans = sum(_per_step_ms(row, k) for k in ("draft_s", "verify_s", "prefill_s", "predict_s"))
    return _per_step_ms(row, "wall_s") - spans


def _rows(folder: Path) -> list[dict[str, Any]]:
    plain = folder / "rows.jsonl"
    with plain.open() if plain.exists() else gzip.open(f"{plain}.gz", "rt") as lines:
        return [json.loads(line) for line in lines]


def interval(values: list[float]) -> tuple[float, float]:
    """The mean and the half-width of its normal 95% interval."""
    return statistics.mean(values), 1.96 * statistics.stdev(values) / math.sqrt(len(values))


def pooled_pairs(
    folders: list[Path], num: str, den: str, conc: int | None = None
) -> tuple[list[float], list[float]]:
    """Arm ``num`` against ``den`` over the runs of ``folders`` paired by
    (folder, concurrency, repeat), at concurrency ``conc`` (None: every):
    each pair's tokens/s ratio and its host-time difference a step outside
    the spans (:func:`outside_spans_ms`), in ms."""
    ratios, outside = [], []
    for folder in folders:
        runs: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
        for row in _rows(folder):
            runs.setdefault((row["concurrency"], row["repeat"]), {})[row["arm"]] = row
        for (c, _), arms in runs.items():
            if (conc is None or c == conc) and {num, den} <= set(arms):
                a, b = arms[num], arms[den]
                ratios.append(a["output_tokens_per_s"] / b["output_tokens_per_s"])
                outside.append(outside_spans_ms(a) - outside_spans_ms(b))
    return ratios, outside


def pair_summary(
    folders: list[Path], num: str, den: str, conc: int | None = None
) -> tuple[int, float, tuple[float, float], tuple[float, float]]:
    """:func:`pooled_pairs` summarised: the pairs' count, the ratios'
    median, their :func:`interval` and the outside-span differences'."""
    ratios, outside = pooled_pairs(folders, num, den, conc)
    return len(ratios), statistics.median(ratios), interval(ratios), interval(outside)


def print_pairs(folders: list[Path], pairs: Sequence[tuple[str, str]]) -> None:
    """One line a pair at c=1, then at c=4 (:func:`pair_summary`): the
    tokens/s ratios of the interleaved runs paired by repeat (median, and
    mean with a normal 95% interval) and the numerator's host time a step
    outside the forwards' spans beyond the denominator's (mean with a normal
    95% interval)."""
    for conc in (1, 4):
        for num, den in pairs:
            n, median, (mean, half), (out_mean, out_half) = pair_summary(folders, num, den, conc)
            print(
                f"c={conc} {num}/{den} ({n} pairs): median {median:.3f}, mean {mean:.3f} "
                f"[{mean - half:.3f}, {mean + half:.3f}]; outside the spans {out_mean:+.3f} "
                f"+- {out_half:.3f} ms a step"
            )


def summarize(folder: Path) -> list[str]:
    rows = _rows(folder)
    lines = []
    for conc in (1, 4):
        b1 = [outside_spans_ms(r) for r in rows if r["arm"] == "B1" and r["concurrency"] == conc]
        pd = [r for r in rows if r["arm"] == "PD" and r["concurrency"] == conc]
        if not b1 or not pd:
            continue
        excess = statistics.median(map(outside_spans_ms, pd)) - statistics.median(b1)
        sched = statistics.median(r["scheduler_us_per_step"] for r in pd)
        rest = statistics.median(
            r["pd_parts"].get("rest_steps", 0) / r["pd_parts"]["steps"] for r in pd
        )
        lines.append(
            f"{folder.name} c={conc}: PD - B1 outside the spans {excess:.3f} ms/step "
            f"(B1 {statistics.median(b1):.3f}), PD scheduler {sched:.0f} us, rest share {rest:.2f}"
        )
    return lines


def main(argv: list[str]) -> None:
    here = Path(__file__).resolve().parent
    folders = (
        [here / name for name in argv]
        if argv
        else sorted(p for p in here.iterdir() if list(p.glob("rows.jsonl*")))
    )
    for folder in folders:
        print("\n".join(summarize(folder)))


if __name__ == "__main__":
    main(sys.argv[1:])
