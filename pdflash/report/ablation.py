"""What each part of PD buys: PD against PD with one part switched off.

:func:`ablation_table` compares, per comparison point, PD (its parts under
the PD controller) with each ablation (``PD-all-on``: every part forced on,
i.e. what the controller buys; ``PD-no-route-ahead``, ``PD-one-band``, ``PD-token-sched``,
``PD-no-stream``, ``PD-full-width``: every draft verified instead of the
adaptive width; ``PD+host``, PD with a part added; and rows of the retired
``PD-adaptive-width``, PD at the adaptive width when PD's own verified every
draft) on tokens/s,
bytes per committed token and exposed fetch seconds: each a median with the
95% t interval over repeats, and a verdict from
:func:`pdflash.report.stats.compare`: which is better where the intervals
separate (more tokens/s; fewer bytes per token; less exposed fetch time),
``"within noise"`` where they do not, and nothing from a single repeat.
Beside it, ``pairs``: PD over the variant repeat by repeat (the repeats are
interleaved), the ratios' median and 95% t interval, and the better one
where that interval excludes 1 (:func:`pdflash.report.stats.ratio_verdict`),
which sees a steady difference the repeats' spread hides.
"""

from __future__ import annotations

import itertools
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from pdflash.report import stats
from pdflash.report.schema import (
    ABLATIONS,
    RETIRED_LABELS,
    comparison_points,
    point_label,
    series_labels,
    serves,
)

#: The part of PD each label switches off (PD+host adds the hybrid miss service).
PART: dict[str, str] = {
    "PD-all-on": "the PD controller (every part forced on)",
    "PD-no-route-ahead": "route-ahead",
    "PD-one-band": "priority bands",
    "PD-token-sched": "2-D scheduler",
    "PD-no-stream": "streaming prefetcher",
    "PD-full-width": "adaptive verify width (every draft verified)",
    "PD+host": "hybrid miss service (added to PD)",
    # rows recorded while PD's preset verified every draft
    "PD-adaptive-width": "adaptive verify width (added to PD, which verified every draft then)",
}

#: (row field, True when larger is better)
METRICS: tuple[tuple[str, bool], ...] = (
    ("output_tokens_per_s", True),
    ("bytes_per_token", False),
    ("exposed_fetch_s", False),
)

ONE_REPEAT = "fewer than two repeats on a side: no interval, no verdict"


def _num(value: object) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def _cell(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"median": None, "low": None, "high": None, "n": 0}
    if len(values) < 2:
        return {"median": values[0], "low": None, "high": None, "n": 1}
    iv = stats.t_interval(values)
    return {"median": iv.median, "low": iv.low, "high": iv.high, "n": iv.n, "method": "t"}


def _verdict(pd: list[float], other: list[float], larger_better: bool, label: str) -> str | None:
    """``"PD"`` or ``label`` (the better one) where the 95% intervals
    separate, ``"within noise"`` where they do not; None below two repeats."""
    if len(pd) < 2 or len(other) < 2:
        return None
    called = stats.compare(stats.t_interval(pd), stats.t_interval(other))
    if called == "within noise":
        return called
    pd_larger = called == "a"
    return "PD" if pd_larger == larger_better else label


def _pairs(
    pd_rows: Sequence[Mapping[str, Any]],
    v_rows: Sequence[Mapping[str, Any]],
    name: str,
    larger_better: bool,
    label: str,
) -> dict[str, Any]:
    """PD's ``name`` over the variant's in each repeat both ran
    (:func:`pdflash.report.stats.pair_summary`), with ``verdict`` ``"PD"``
    or ``label`` (the better) where the ratios' interval excludes 1, else
    ``"within noise"``; None with a ``reason`` below two pairs."""
    out = stats.pair_summary(stats.by_repeat(pd_rows, name), stats.by_repeat(v_rows, name))
    called = out.pop("called")
    if called is None or called == "within noise":
        out["verdict"] = called
    else:
        out["verdict"] = "PD" if (called == "faster") == larger_better else label
    return out


def ablation_table(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (point, variant) that has both PD rows and the
    variant's rows; see the module docstring."""
    rows = [r for r in rows if isinstance(r, Mapping)]
    series = _series(rows)
    variants = [
        (b, s, members)
        for b in (*ABLATIONS, "PD+host", *RETIRED_LABELS)
        for s, members in series.get(b, {}).items()
    ]
    out = []
    for point, (pd, pd_all) in itertools.product(
        comparison_points(rows), series.get("PD", {}).items()
    ):
        pd_rows = [r for r in pd_all if serves(r, point)]
        if not pd_rows:
            continue
        for baseline, label, members in variants:
            v_rows = [r for r in members if serves(r, point)]
            if not v_rows:
                continue
            entry: dict[str, Any] = {
                "point": point_label(point),
                "arch": point[0],
                "block_size": point[1],
                "concurrency": point[2],
                "cache_fraction": point[3],
                "workload": point[4],
                "variant": label,
                "part": PART.get(baseline, baseline),
            }
            if pd != "PD":
                entry["pd"] = pd
            for name, larger_better in METRICS:
                pd_vals = [v for v in (_num(r.get(name)) for r in pd_rows) if v is not None]
                o_vals = [v for v in (_num(r.get(name)) for r in v_rows) if v is not None]
                verdict = _verdict(pd_vals, o_vals, larger_better, label)
                entry[name] = {
                    "PD": _cell(pd_vals),
                    label: _cell(o_vals),
                    "verdict": verdict,
                    "pairs": _pairs(pd_rows, v_rows, name, larger_better, label),
                }
                if verdict is None:
                    entry[name]["not_measured"] = ONE_REPEAT
                if pd_vals and o_vals:
                    pd_med, o_med = statistics.median(pd_vals), statistics.median(o_vals)
                    # PD's figure over the variant's: what switching the part on changes
                    entry[name]["pd_over_variant"] = pd_med / o_med if o_med else None
            out.append(entry)
    return out


def _series(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, list[Mapping[str, Any]]]]:
    """Per baseline, its series (:func:`pdflash.report.schema.series_labels`:
    the bare label, or one per setting where the set holds more than one) and
    their rows, series sorted."""
    labels = series_labels(rows)
    out: dict[str, dict[str, list[Mapping[str, Any]]]] = defaultdict(dict)
    for row in rows:
        out[str(row.get("baseline"))].setdefault(labels[id(row)], []).append(row)
    return {b: dict(sorted(members.items())) for b, members in out.items()}


#: PD's switchable parts, as rows' ``pd_parts`` name them
CONTROLLED_PARTS = ("stream", "route_ahead", "scheduler_2d")


def controller_table(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per (point, label) with ``pd_parts`` books (PD, PD+host, PD-all-on): the
    median fraction of measured steps each part ran, the switches per run
    and the first switch's reason."""
    rows = [r for r in rows if isinstance(r, Mapping) and isinstance(r.get("pd_parts"), Mapping)]
    series = _series(rows)
    out = []
    for point in comparison_points(rows):
        labelled = (m for b in ("PD", "PD+host", "PD-all-on") for m in series.get(b, {}).items())
        for label, members in labelled:
            books = [r["pd_parts"] for r in members if serves(r, point)]
            if not books:
                continue
            on: dict[str, float | None] = {}
            for part in CONTROLLED_PARTS:
                fr = [
                    v
                    for v in (_num((b.get("on_fraction") or {}).get(part)) for b in books)
                    if v is not None
                ]
                on[part] = statistics.median(fr) if fr else None
            switches = [int(b.get("switches") or 0) for b in books]
            whys = [
                f"{d.get('part')}: {d.get('why')}"
                for b in books
                for d in (b.get("decisions") or [])
                if isinstance(d, Mapping) and d.get("switched")
            ]
            out.append(
                {
                    "point": point_label(point),
                    "baseline": label,
                    "policy": books[0].get("policy"),
                    "runs": len(books),
                    "on_fraction_median": on,
                    "switches_per_run": switches,
                    "first_switch_why": whys[0] if whys else None,
                }
            )
    return out


def controller_markdown(table: Sequence[Mapping[str, Any]]) -> str:
    """The PD controller's decisions per point: parts' on fractions, switches."""
    header = ("point", "label", "policy", "runs", *(f"{p} on" for p in CONTROLLED_PARTS))
    header = (*header, "switches per run", "first switch: why")
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(" --- " for _ in header) + "|",
    ]
    for e in table:
        fr = e["on_fraction_median"]
        cells = [e["point"], e["baseline"], e["policy"], e["runs"]]
        cells += ["—" if fr[p] is None else f"{fr[p]:.2f}" for p in CONTROLLED_PARTS]
        cells += [",".join(str(s) for s in e["switches_per_run"]), e["first_switch_why"] or "—"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def _fmt(cell: Mapping[str, Any]) -> str:
    med = cell.get("median")
    if med is None:
        return "—"
    if cell.get("low") is None:
        return f"{med:.4g} (n={cell.get('n')})"
    return f"{med:.4g} [{cell['low']:.4g}, {cell['high']:.4g}]"


def _says(entry: Mapping[str, Any], name: str) -> str:
    verdict = entry[name]["verdict"]
    if verdict is None:
        return "not called (one repeat)"
    if verdict == "within noise":
        return "within noise"
    return "PD better" if verdict == "PD" else f"{entry['variant']} better"


def _says_pairs(entry: Mapping[str, Any], name: str) -> str:
    pairs = entry[name].get("pairs") or {}
    verdict = pairs.get("verdict")
    if verdict is None:
        return "not called: " + str(pairs.get("reason", "no pairs"))
    who = (
        "within noise"
        if verdict == "within noise"
        else "PD better"
        if verdict == "PD"
        else f"{entry['variant']} better"
    )
    return f"{stats.pairs_text(pairs)}: {who}"


def ablation_markdown(table: Sequence[Mapping[str, Any]]) -> str:
    """The "what each part buys" table: PD and the variant, median [95%
    interval], and the verdict per metric; then tokens/s paired by repeat."""
    header = (
        "point",
        "without",
        "tokens/s PD",
        "tokens/s variant",
        "verdict",
        "bytes/token PD",
        "bytes/token variant",
        "verdict",
        "exposed fetch s PD",
        "exposed fetch s variant",
        "verdict",
        "tokens/s PD / variant per repeat",
    )
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(" --- " for _ in header) + "|",
    ]
    for e in table:
        # the PD series compared where the rows hold several settings of PD
        point = f"{e['point']} ({e['pd']})" if "pd" in e else e["point"]
        cells = [point, f"{e['part']} ({e['variant']})"]
        for name, _ in METRICS:
            cells += [_fmt(e[name]["PD"]), _fmt(e[name][e["variant"]]), _says(e, name)]
        cells.append(_says_pairs(e, "output_tokens_per_s"))
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)
