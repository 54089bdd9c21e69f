"""Evaluation of a validated result set (docs/design.md §6, issue 7).

:func:`evaluate` turns rows into a JSON-able report. A *point* is (arch,
block, concurrency, cache fraction, workload label); every statistic is over
the repeats at a point.

* ``eta_phys`` — the lead figure: per point and baseline, eta_phys (median
  and 95% interval), eta beside it, and the compute floor the rows used;
* ``intervals`` — per point and baseline, the median and 95% t interval of
  tokens/s, eta_phys, eta, bytes/token and exposed fetch s;
* ``verdicts`` — PD against every other baseline on tokens/s: the faster
  one where the intervals separate, ``"within noise"`` where they do not
  (:func:`pdflash.report.stats.compare`); nothing is called from one repeat;
  beside it ``pairs``, the same two divided repeat by repeat (the repeats
  are interleaved) with the ratios' median and interval and the faster one
  where that interval excludes 1 (:func:`pdflash.report.stats.ratio_verdict`):
  a steady difference smaller than the repeats' spread shows there;
* ``noise`` — the measured run-to-run noise: the relative half-width of the
  tokens/s intervals (median and max over points and baselines);
* ``ablation`` — where the rows have PD's ablations: what each part buys
  (:func:`pdflash.report.ablation.ablation_table`);
* ``ordering`` — per point, median
  tokens/s of each baseline over repeats and whether B0 < B1 < B2 < PD <= B3;
* ``gap`` — the share of the B1→B3 gap PD closes, ``(PD − B1) / (B3 − B1)``,
  per point and summarised per (arch, block, cache fraction);
* ``regime`` — per (arch, cache fraction), whether PD's runs were link-bound
  (link-busy s > compute-busy s: the copy link, not the GPU, is the resource
  that bounds them) or compute-bound;
* ``hide`` — the hide inequality from measured terms, per row:
  fetch = (1 − r)·(routed expert bytes)/BW versus window = t_draft + t_router
  + verify overlap, both sides summed over the run, and the margin;
* ``targets`` — issue 7's targets, each with its threshold, the measured
  value and by how much it is missed ("PD beats B1/B2" is met only where
  the tokens/s intervals separate);
* ``verdict`` — GO only if the rows are valid and every target is met; every
  failed or unmeasurable target is a reason.

A figure that cannot be computed is ``None`` with the reason beside it,
never a placeholder.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pdflash.report import stats
from pdflash.report.ablation import ablation_table, controller_table
from pdflash.report.schema import (
    REQUIRED_BASELINES,
    ROW_LABELS,
    arch_label,
    comparison_points,
    point_label,
    series_labels,
    serves,
    validate_rows,
    workload_label,
)

#: Link bandwidth unit of ``link_gbps_measured``: GB/s (1e9 bytes/s), as docs/design.md §3.
LINK_BYTES_PER_S_PER_GBPS = 1e9

ETA_TARGET = 0.9
BELADY_RATIO_TARGET = 1.3
GAP_TARGET = 0.9
#: PD may exceed the all-resident B3 by measurement noise only.
B3_NOISE = 0.05

Point = tuple[Any, Any, Any, Any, Any]  # arch, block, concurrency, cache fraction, workload

#: Metrics the per-point interval table summarises (median and 95% interval
#: over repeats); tokens/s is the one "PD beats X" is judged on.
INTERVAL_METRICS: tuple[str, ...] = (
    "output_tokens_per_s",
    "eta_phys",
    "eta",
    "bytes_per_token",
    "exposed_fetch_s",
)
ONE_REPEAT = (
    "one repeat: the run-to-run noise is not measured, so no difference is called "
    "(run >= 3 repeats)"
)


def _num(value: object) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _point(row: Mapping[str, Any]) -> Point:
    return (
        arch_label(row),
        row["block_size"],
        row["concurrency"],
        row["cache_fraction"],
        workload_label(row),
    )


def _point_fields(point: Point) -> dict[str, Any]:
    return {
        "arch": point[0],
        "block_size": point[1],
        "concurrency": point[2],
        "cache_fraction": point[3],
        "workload": point[4],
    }


def _reason(rows: Sequence[Mapping[str, Any]], name: str) -> str:
    for row in rows:
        reason = row.get("not_measured", {}).get(name)
        if reason:
            return str(reason)
    return f"{name} missing"


class _Table:
    """Rows per series, looked up by comparison point (see
    :func:`pdflash.report.schema.serves`: B3 serves every cache fraction, B0
    every block size). A series is a baseline label, or, where the set holds
    more than one setting of a label, the label with the settings that tell
    them apart (:func:`pdflash.report.schema.series_labels`): each is its own
    column, never pooled into one."""

    def __init__(self, rows: Sequence[Mapping[str, Any]]) -> None:
        self.by_baseline: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
        self.series_of: dict[str, list[str]] = defaultdict(list)
        labels = series_labels(rows)
        for row in rows:
            label = labels[id(row)]
            if label not in self.by_baseline:
                self.series_of[row["baseline"]].append(label)
            self.by_baseline[label].append(row)
        for names in self.series_of.values():
            names.sort()
        self.points: list[Point] = [(p[0], p[1], p[2], p[3], p[4]) for p in comparison_points(rows)]

    def rows(self, point: Point, baseline: str) -> list[Mapping[str, Any]]:
        found = [r for r in self.by_baseline.get(baseline, []) if serves(r, point)]
        exact = [r for r in found if _point(r) == point]
        return exact or found

    def median(self, point: Point, baseline: str, name: str) -> float | None:
        return _median(_num(r.get(name)) for r in self.rows(point, baseline))

    def samples(self, point: Point, baseline: str, name: str) -> list[float]:
        """The measured values of ``name`` over the repeats at ``point``."""
        values = (_num(r.get(name)) for r in self.rows(point, baseline))
        return [v for v in values if v is not None]

    def interval(self, point: Point, baseline: str, name: str) -> stats.Interval | None:
        """Median and 95% t interval over the repeats (None below two)."""
        values = self.samples(point, baseline, name)
        return stats.t_interval(values) if len(values) >= 2 else None

    def series(self, baseline: str) -> list[str]:
        """The series of ``baseline`` (its bare label when it has no rows)."""
        return self.series_of.get(baseline) or [baseline]

    def series_at(self, point: Point, baseline: str) -> list[str]:
        """The series of ``baseline`` to judge at ``point``: its bare label
        (with rows or not: a missing baseline is a reason), or, where the
        label is split by setting, those of its series with rows here."""
        names = self.series(baseline)
        if len(names) == 1:
            return names
        return [s for s in names if self.rows(point, s)]

    def shown(self) -> list[str]:
        """The required baselines' series, then any optional one's the set has rows of."""
        return [
            s
            for b in ROW_LABELS
            if b in REQUIRED_BASELINES or self.series_of.get(b)
            for s in self.series(b)
        ]

    def sorted_points(self) -> list[Point]:
        return sorted(self.points, key=lambda p: (str(p[0]), p[1], p[3], p[2], str(p[4])))


def _ordering(table: _Table) -> list[dict[str, Any]]:
    out = []
    pairs = (("B0", "B1", "<"), ("B1", "B2", "<"), ("B2", "PD", "<"), ("PD", "B3", "<="))
    for point in table.sorted_points():
        # optional baselines (PD+host, ablations) appear only where the set has rows of them
        shown = table.shown()
        tps = {b: table.median(point, b, "output_tokens_per_s") for b in shown}
        checks = []
        relations = (
            (a, b, op)
            for lo, hi, op in pairs
            for a in table.series_at(point, lo)
            for b in table.series_at(point, hi)
        )
        for lo, hi, op in relations:
            a, b = tps[lo], tps[hi]
            if a is None or b is None:
                holds = None
            elif op == "<":
                holds = a < b
            else:
                holds = a <= b * (1 + B3_NOISE)
            checks.append({"relation": f"{lo} {op} {hi}", "holds": holds})
        out.append(
            {
                **_point_fields(point),
                "tokens_per_s": tps,
                "checks": checks,
                "holds": all(c["holds"] for c in checks if c["holds"] is not None)
                and all(c["holds"] is not None for c in checks),
            }
        )
    return out


def _fmt_iv(iv: stats.Interval) -> str:
    return f"{iv.median:.4g} [{iv.low:.4g}, {iv.high:.4g}] (n={iv.n})"


def _judge(
    table: _Table, point: Point, a: str, b: str, name: str = "output_tokens_per_s"
) -> dict[str, Any]:
    """Which of ``a`` and ``b`` has the larger ``name`` at ``point``, called
    only where their 95% intervals separate (:func:`stats.compare`).

    ``verdict``: ``a`` or ``b`` (the label of the larger), ``"within
    noise"``, or None with a ``reason`` (a baseline without rows, or one
    repeat: no interval); ``pairs``: the same judged on the repeats paired
    (:func:`_pairs`)."""
    ia, ib = table.interval(point, a, name), table.interval(point, b, name)
    out: dict[str, Any] = {"a": a, "b": b, "metric": name, "verdict": None}
    out["pairs"] = _pairs(table, point, a, b, name)
    if ia is None or ib is None:
        missing = [
            x for x, iv in ((a, ia), (b, ib)) if iv is None and not table.samples(point, x, name)
        ]
        out["reason"] = f"no {name} for {', '.join(missing)}" if missing else ONE_REPEAT
        return out
    verdict = stats.compare(ia, ib)
    out["verdict"] = a if verdict == "a" else b if verdict == "b" else "within noise"
    out["text"] = f"{a} {_fmt_iv(ia)} vs {b} {_fmt_iv(ib)}"
    return out


def _pairs(table: _Table, point: Point, a: str, b: str, name: str) -> dict[str, Any]:
    """``a``'s ``name`` over ``b``'s in every repeat both ran at ``point``
    (:func:`pdflash.report.stats.pair_summary`), with ``verdict`` ``a`` or
    ``b`` (the larger) where the ratios' interval excludes 1, else
    ``"within noise"``; None with a ``reason`` below two pairs."""
    out = stats.pair_summary(
        stats.by_repeat(table.rows(point, a), name), stats.by_repeat(table.rows(point, b), name)
    )
    called = out.pop("called")
    out["verdict"] = (
        None if called is None else a if called == "faster" else b if called == "slower" else called
    )
    return out


def _intervals(table: _Table) -> list[dict[str, Any]]:
    """Per point and baseline: median and 95% t interval over repeats of
    each :data:`INTERVAL_METRICS` figure (the interval is None, with the
    reason, below two repeats)."""
    out = []
    for point in table.sorted_points():
        for baseline in table.shown():
            if not table.rows(point, baseline):
                continue
            entry: dict[str, Any] = {**_point_fields(point), "baseline": baseline}
            for name in INTERVAL_METRICS:
                values = table.samples(point, baseline, name)
                iv = stats.t_interval(values) if len(values) >= 2 else None
                entry[name] = {
                    "median": statistics.median(values) if values else None,
                    "low": iv.low if iv else None,
                    "high": iv.high if iv else None,
                    "n": len(values),
                    "method": "t" if iv else None,
                }
                if iv is None:
                    entry[name]["not_measured"] = (
                        ONE_REPEAT if values else _reason(table.rows(point, baseline), name)
                    )
            out.append(entry)
    return out


def _verdicts(table: _Table) -> list[dict[str, Any]]:
    """Per point: PD against every other baseline (and each PD variant
    against PD), on tokens/s: who is faster where the intervals separate,
    "within noise" where they do not."""
    out = []
    for point in table.sorted_points():
        judged_pairs: set[frozenset[str]] = set()
        for pd in table.series("PD"):
            if not table.rows(point, pd):
                continue
            for other in table.shown():
                pair = frozenset((pd, other))
                if other == pd or pair in judged_pairs or not table.rows(point, other):
                    continue
                judged_pairs.add(pair)
                judged = _judge(table, point, pd, other)
                out.append({**_point_fields(point), **judged})
    return out


def _noise(table: _Table) -> dict[str, Any]:
    """The measured run-to-run noise of tokens/s: the relative half-width of
    each (point, baseline)'s 95% t interval (:func:`stats.relative_spread`),
    summarised over every cell with two or more repeats."""
    spreads = []
    for point in table.sorted_points():
        for baseline in table.shown():
            iv = table.interval(point, baseline, "output_tokens_per_s")
            if iv is None:
                continue
            spread = stats.relative_spread(iv)
            if spread is not None:
                spreads.append(spread)
    if not spreads:
        return {
            "cells": 0,
            "median": None,
            "max": None,
            "not_measured": {"median": ONE_REPEAT, "max": ONE_REPEAT},
        }
    return {
        "cells": len(spreads),
        "median": statistics.median(spreads),
        "max": max(spreads),
        "definition": "half-width of the 95% t interval of tokens/s over repeats / its median, "
        "per (point, baseline)",
    }


#: the compute floor the report prefers (issue 15 item 4): the time the same
#: forwards take with every expert resident, i.e. B3 at the same point
B3_COMPUTE_FLOOR = (
    "max(miss floor, compute floor) / wall; compute floor = B3's measured compute-stream "
    "busy time at the same point (median over its repeats: the same forwards with every "
    "expert resident); miss floor as each row states it"
)


def _eta_phys_vs_b3(
    found: Sequence[Mapping[str, Any]], b3_compute_s: float | None
) -> list[float] | None:
    """Per-row eta_phys with B3's compute as the floor, or None when B3's
    compute or a row's miss floor / wall is missing (then the rows' own
    eta_phys, whose floor their definition states, is used)."""
    if b3_compute_s is None or b3_compute_s <= 0:
        return None
    samples = []
    for row in found:
        floor, wall = row.get("miss_floor_s"), row.get("wall_s")
        if not isinstance(floor, (int, float)) or not isinstance(wall, (int, float)) or wall <= 0:
            return None
        samples.append(max(float(floor), b3_compute_s) / float(wall))
    return samples


def _eta_phys(table: _Table) -> dict[str, Any]:
    """The report's lead figure: eta_phys per point and baseline (median and
    95% interval), eta beside it, and which compute floor it used: B3's
    measured compute at the same point where B3 ran, else the rows' own."""
    per_point = []
    floors: set[str] = set()
    for point in table.sorted_points():
        b3_compute = table.median(point, "B3", "compute_busy_s")
        for baseline in table.shown():
            found = table.rows(point, baseline)
            if not found:
                continue
            vs_b3 = _eta_phys_vs_b3(found, b3_compute)
            if vs_b3 is not None:
                ep, floor_source = vs_b3, "B3"
                floors.add(B3_COMPUTE_FLOOR)
            else:
                ep, floor_source = table.samples(point, baseline, "eta_phys"), "row"
                floors.update(
                    str(r["eta_phys_definition"]) for r in found if r.get("eta_phys_definition")
                )
            iv = stats.t_interval(ep) if len(ep) >= 2 else None
            entry: dict[str, Any] = {
                **_point_fields(point),
                "baseline": baseline,
                "eta_phys": statistics.median(ep) if ep else None,
                "eta_phys_low": iv.low if iv else None,
                "eta_phys_high": iv.high if iv else None,
                "eta": table.median(point, baseline, "eta"),
                "miss_floor_s": table.median(point, baseline, "miss_floor_s"),
                "compute_busy_s": table.median(point, baseline, "compute_busy_s"),
                "wall_s": table.median(point, baseline, "wall_s"),
                "repeats": len(found),
                "compute_floor_source": floor_source,
            }
            if not ep:
                entry["not_measured"] = {"eta_phys": _reason(found, "eta_phys")}
            per_point.append(entry)
    definitions = sorted(floors)
    return {
        "per_point": per_point,
        "compute_floor": definitions
        or ["not stated: these rows carry no eta_phys_definition (recorded before eta_phys)"],
    }


def gap_closed(pd: float | None, b1: float | None, b3: float | None) -> tuple[float | None, str]:
    """``(PD − B1) / (B3 − B1)`` and a reason when it cannot be computed."""
    if pd is None or b1 is None or b3 is None:
        missing = [n for n, v in (("PD", pd), ("B1", b1), ("B3", b3)) if v is None]
        return None, f"no tokens/s for {', '.join(missing)}"
    if b3 <= b1:
        return None, f"no B1→B3 gap to close (B1 {b1:.4g} >= B3 {b3:.4g} tokens/s)"
    return (pd - b1) / (b3 - b1), ""


def _gap_series(table: _Table) -> list[dict[str, str]]:
    """Which PD, B1 and B3 series a gap is computed from: one each, unless
    the set holds more than one setting of a label (then every combination,
    named under ``series``)."""
    return [
        {"PD": pd, "B1": b1, "B3": b3}
        for pd in table.series("PD")
        for b1 in table.series("B1")
        for b3 in table.series("B3")
    ]


def _gap(table: _Table) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    per_point = []
    combos = _gap_series(table)
    for point in table.sorted_points():
        for combo in combos:
            if len(combos) > 1 and not all(table.rows(point, s) for s in combo.values()):
                continue  # a setting this point does not hold
            value, reason = gap_closed(
                table.median(point, combo["PD"], "output_tokens_per_s"),
                table.median(point, combo["B1"], "output_tokens_per_s"),
                table.median(point, combo["B3"], "output_tokens_per_s"),
            )
            entry: dict[str, Any] = {**_point_fields(point), "gap_closed": value}
            if len(combos) > 1:
                entry["series"] = combo
            if value is None:
                entry["not_measured"] = {"gap_closed": reason}
            per_point.append(entry)
    by_cf: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for entry in per_point:
        key = (entry["arch"], entry["block_size"], entry["cache_fraction"], entry["workload"])
        if "series" in entry:
            key += tuple(entry["series"].values())
        by_cf[key].append(entry)
    summary = []
    for key, entries in sorted(by_cf.items(), key=lambda kv: repr(kv[0])):
        arch, block, cf, load = key[:4]
        values = [e["gap_closed"] for e in entries if e["gap_closed"] is not None]
        line: dict[str, Any] = {
            "arch": arch,
            "block_size": block,
            "cache_fraction": cf,
            "workload": load,
            "gap_closed_min": min(values) if values else None,
            "gap_closed_median": statistics.median(values) if values else None,
            "points": len(entries),
            "points_measured": len(values),
        }
        if "series" in entries[0]:
            line["series"] = entries[0]["series"]
        summary.append(line)
    return per_point, summary


def _regime(table: _Table) -> list[dict[str, Any]]:
    """Link-bound vs compute-bound per (arch, cache fraction), from PD's busy times."""
    groups: dict[tuple[Any, Any], list[Mapping[str, Any]]] = defaultdict(list)
    pd_rows = (r for pd in table.series("PD") for r in table.by_baseline.get(pd, []))
    for row in pd_rows:
        groups[(arch_label(row), row["cache_fraction"])].append(row)
    out = []
    for (arch, cf), rows in sorted(groups.items(), key=lambda kv: repr(kv[0])):
        ratios = []
        belady_ratios = []
        for row in rows:
            link, compute = _num(row.get("link_busy_s")), _num(row.get("compute_busy_s"))
            if link is not None and compute is not None and compute > 0:
                ratios.append(link / compute)
            bel, bw = _num(row.get("belady_bytes")), _num(row.get("link_gbps_measured"))
            if bel is not None and bw and compute:
                belady_ratios.append(bel / (bw * LINK_BYTES_PER_S_PER_GBPS) / compute)
        entry: dict[str, Any] = {
            "arch": arch,
            "cache_fraction": cf,
            "link_to_compute_busy": statistics.median(ratios) if ratios else None,
            "belady_link_to_compute": statistics.median(belady_ratios) if belady_ratios else None,
            "runs": len(rows),
        }
        if ratios:
            entry["bound"] = "link" if entry["link_to_compute_busy"] > 1 else "compute"
        else:
            entry["bound"] = None
            entry["not_measured"] = {
                "bound": "PD rows lack link_busy_s/compute_busy_s: " + _reason(rows, "link_busy_s")
            }
        out.append(entry)
    return out


def hide_inequality(row: Mapping[str, Any]) -> dict[str, Any]:
    """Both sides of docs/design.md §6's hide inequality for one run, summed over it.

    fetch_s = (1 − r) · routed_expert_bytes / BW, with r the expert-cache hit
    rate, routed_expert_bytes the bytes of every expert the run's forward
    layers routed to (s·M_bytes summed over rounds) and BW the link measured
    in the same run; window_s = draft_busy_s + router_busy_s +
    verify_overlap_window_s (the engine's ``draft_s`` and ``predict_s`` are
    accepted for the first two; without an explicit overlap term, the
    verify's compute time ``verify_s − exposed_fetch_s`` is used: the most
    copy time the verify forward itself can hide, an upper bound).
    ``margin_s = window_s − fetch_s``; the fetch can be hidden when the margin
    is >= 0.
    """
    overlap = _num(row.get("verify_overlap_window_s"))
    overlap_source = "row"
    if overlap is None:
        verify, stall = _num(row.get("verify_s")), _num(row.get("exposed_fetch_s"))
        if verify is not None and stall is not None:
            # the verify forward's own compute: the most copy time it can hide
            overlap, overlap_source = max(0.0, verify - stall), "verify_s - exposed_fetch_s"
    terms = {
        "hit_rate": _num(row.get("expert_cache_hit_rate")),
        "routed_expert_bytes": _num(row.get("routed_expert_bytes")),
        "link_gbps": _num(row.get("link_gbps_measured")),
        # the engine names its drafter and predictor times draft_s / predict_s
        "draft_busy_s": _num(row.get("draft_busy_s", row.get("draft_s"))),
        "router_busy_s": _num(row.get("router_busy_s", row.get("predict_s"))),
        "verify_overlap_window_s": overlap,
    }
    out: dict[str, Any] = {
        "terms": terms,
        "overlap_source": overlap_source if overlap is not None else None,
        "fetch_s": None,
        "window_s": None,
        "margin_s": None,
    }
    reasons: dict[str, str] = {}
    if terms["link_gbps"] == 0:
        terms["link_gbps"] = None
    fetch_missing = [
        k for k in ("hit_rate", "routed_expert_bytes", "link_gbps") if terms[k] is None
    ]
    if fetch_missing:
        reasons["fetch_s"] = "unmeasured term(s): " + ", ".join(fetch_missing)
    else:
        out["fetch_s"] = (
            (1 - terms["hit_rate"])  # type: ignore[operator]
            * terms["routed_expert_bytes"]
            / (terms["link_gbps"] * LINK_BYTES_PER_S_PER_GBPS)  # type: ignore[operator]
        )
    window_keys = ("draft_busy_s", "router_busy_s", "verify_overlap_window_s")
    window_missing = [k for k in window_keys if terms[k] is None]
    if window_missing:
        reasons["window_s"] = "unmeasured term(s): " + ", ".join(window_missing)
    else:
        out["window_s"] = sum(terms[k] or 0.0 for k in window_keys)
    if out["fetch_s"] is not None and out["window_s"] is not None:
        out["margin_s"] = out["window_s"] - out["fetch_s"]
        out["holds"] = out["margin_s"] >= 0
    else:
        out["holds"] = None
        reasons["margin_s"] = "; ".join(f"{k}: {v}" for k, v in reasons.items())
    if reasons:
        out["not_measured"] = reasons
    return out


def _hide(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for row in rows:
        if row["baseline"] == "B3":
            continue  # nothing to fetch
        entry = {
            "arch": arch_label(row),
            "baseline": row["baseline"],
            "block_size": row["block_size"],
            "concurrency": row["concurrency"],
            "cache_fraction": row["cache_fraction"],
            "workload": workload_label(row),
            "repeat": row["repeat"],
        }
        entry.update(hide_inequality(row))
        out.append(entry)
    return out


def _target(
    name: str, where: str, value: float | None, threshold: float, op: str, reason: str = ""
) -> dict[str, Any]:
    """One target check. ``op`` is ">=" (value must reach threshold) or "<="
    (must not exceed) or ">" (strictly above)."""
    entry: dict[str, Any] = {
        "target": name,
        "where": where,
        "value": value,
        "threshold": threshold,
        "op": op,
    }
    if value is None:
        entry["met"] = None
        entry["miss"] = None
        entry["not_measured"] = {"value": reason or "not measured"}
        return entry
    if op == ">=":
        met, miss = value >= threshold, threshold - value
    elif op == ">":
        met, miss = value > threshold, threshold - value
    else:
        met, miss = value <= threshold, value - threshold
    entry["met"] = met
    entry["miss"] = None if met else miss
    return entry


def _g(value: float | None, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:.3g}{unit}"


def _why(
    table: _Table,
    point: Point,
    kind: str,
    bound: str | None,
    pd: str = "PD",
    other: str = "",
    b3: str = "B3",
) -> str:
    """Why a target of ``kind`` (``eta``, ``bytes``, ``beats`` or ``gap``)
    was missed by the series ``pd``, from the measured figures at ``point``
    (``other``: the series it was to beat; ``b3``: the all-resident one)."""

    def m(series: str, name: str) -> float | None:
        return table.median(point, series, name)

    wall, compute, link = m(pd, "wall_s"), m(pd, "compute_busy_s"), m(pd, "link_busy_s")
    if kind == "eta":
        idle = None if None in (wall, compute, link) else wall - max(compute, link)  # type: ignore[operator, type-var]
        # NOTE: split the uncovered wall by where it goes: outside the timed
        # forwards (host work between them) vs stalls inside forwards while
        # the link is idle part of the wall. The H200 rows put 0.01-0.09 s
        # outside forwards, so "host work between forwards" alone misled.
        spans = [m(pd, k) for k in ("prefill_s", "draft_s", "verify_s", "router_pass_s")]
        outside = (
            None
            if wall is None or spans[2] is None
            else wall - sum(x for x in spans if x is not None)
        )
        link_idle = None if wall is None or link is None else wall - link
        return (
            f"{pd} wall {_g(wall, ' s')}: compute busy {_g(compute, ' s')}, link busy "
            f"{_g(link, ' s')}; {_g(idle, ' s')} of the wall not covered by the busier "
            f"resource; {_g(outside, ' s')} outside forwards (host work between forwards), "
            f"and inside forwards the compute stream waited {_g(m(pd, 'exposed_fetch_s'), ' s')} "
            f"on copies while the link was idle {_g(link_idle, ' s')} of the wall"
        )
    if kind == "bytes":
        moved, wasted = m(pd, "h2d_bytes"), m(pd, "wasted_prefetch_bytes")
        return (
            f"{pd} moved {_g(moved, ' B')} (Belady {_g(m(pd, 'belady_bytes'), ' B')} for the "
            f"same trace and cache); prefetched and evicted unused {_g(wasted, ' B')}; "
            f"useful-byte fraction {_g(m(pd, 'useful_byte_fraction'))}; route-ahead "
            f"precision {_g(m(pd, 'routeahead_precision'))}"
        )
    if kind == "beats":
        return (
            f"tokens/s {pd} {_g(m(pd, 'output_tokens_per_s'))} vs {other} "
            f"{_g(m(other, 'output_tokens_per_s'))}; exposed fetch {pd} "
            f"{_g(m(pd, 'exposed_fetch_s'), ' s')} vs {_g(m(other, 'exposed_fetch_s'), ' s')}; "
            f"compute busy {pd} {_g(compute, ' s')} vs {_g(m(other, 'compute_busy_s'), ' s')} "
            f"({pd}'s predictor {_g(m(pd, 'predict_s'), ' s')}); bytes/token {pd} "
            f"{_g(m(pd, 'bytes_per_token'))} vs {_g(m(other, 'bytes_per_token'))}"
        )
    return (
        f"{bound or 'unknown'}-bound here ({pd} link/compute busy "
        f"{_g(None if not compute or link is None else link / compute)}); {pd} exposed fetch "
        f"{_g(m(pd, 'exposed_fetch_s'), ' s')} of {_g(wall, ' s')} wall vs B3's "
        f"{_g(m(b3, 'wall_s'), ' s')}; hit rate {pd} {_g(m(pd, 'expert_cache_hit_rate'))}"
    )


def _targets(table: _Table, regime: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 7's targets per point, for each PD series (and against each
    series of B1, B2 and B3 where the set holds more than one setting of a
    label: a target names the series it judged)."""
    targets = []
    bound = {(r["arch"], r["cache_fraction"]): r["bound"] for r in regime}

    def add(entry: dict[str, Any], point: Point, kind: str, **series: str) -> None:
        if entry["met"] is False:
            why = _why(table, point, kind, bound.get((point[0], point[3])), **series)
            if entry.get("note", "").startswith("within noise"):
                why = f"{entry['note']}; {why}"
            entry["why"] = why
        targets.append(entry)

    for point in table.sorted_points():
        arch, cf = point[0], point[3]
        where = point_label(point)
        for pd in table.series("PD"):
            pd_rows = table.rows(point, pd)
            if not pd_rows:
                continue
            eta = table.median(point, pd, "eta")
            add(
                _target(f"{pd} eta >= 0.9", where, eta, ETA_TARGET, ">=", _reason(pd_rows, "eta")),
                point,
                "eta",
                pd=pd,
            )
            add(_belady_target(pd, pd_rows, where), point, "bytes", pd=pd)
            pd_tps = table.median(point, pd, "output_tokens_per_s")
            for other in (*table.series_at(point, "B1"), *table.series_at(point, "B2")):
                o_tps = table.median(point, other, "output_tokens_per_s")
                speedup = pd_tps / o_tps if pd_tps is not None and o_tps else None
                judged = _judge(table, point, pd, other)
                reason = f"tokens/s missing for {pd} or {other} (or {other} is 0)"
                if speedup is not None and judged["verdict"] is None:
                    # a ratio of single runs is not a measured difference
                    speedup, reason = None, judged["reason"]
                entry = _target(
                    f"{pd} beats {other} (tokens/s, 95% intervals separate)",
                    where,
                    speedup,
                    1.0,
                    ">",
                    reason,
                )
                if judged["verdict"] is not None:
                    entry["verdict"] = judged["verdict"]
                    entry["met"] = judged["verdict"] == pd
                    entry["miss"] = None if entry["met"] else entry["miss"]
                    if judged["verdict"] == "within noise":
                        entry["note"] = f"within noise: {judged['text']}"
                add(entry, point, "beats", pd=pd, other=other)
            regime_bound = bound.get((arch, cf))
            for b1 in table.series_at(point, "B1"):
                for b3 in table.series_at(point, "B3"):
                    gap, reason = gap_closed(
                        pd_tps,
                        table.median(point, b1, "output_tokens_per_s"),
                        table.median(point, b3, "output_tokens_per_s"),
                    )
                    if regime_bound is None:
                        # cannot tell whether the target applies, so it cannot be judged
                        reason = "regime unknown (PD rows lack busy times)"
                        gap = None
                    entry = _target(
                        f"{pd} closes >= 90% of {b1}->{b3} gap (not link-bound)",
                        where,
                        gap,
                        GAP_TARGET,
                        ">=",
                        reason,
                    )
                    if regime_bound == "link":
                        # the gap is the headline only where the run is not link-bound
                        entry["applies"] = False
                        entry["met"] = None
                        entry["miss"] = None
                        entry["not_applicable"] = "link-bound at this cache fraction"
                    add(entry, point, "gap", pd=pd, b3=b3)
    return targets


def _belady_target(pd: str, pd_rows: Sequence[Mapping[str, Any]], where: str) -> dict[str, Any]:
    """PD's bytes/token over Belady's (median over its rows) against the target."""
    ratios = []
    for row in pd_rows:
        r = _num(row.get("bytes_per_token_vs_belady"))
        if r is None:
            bpt, bel = _num(row.get("bytes_per_token")), _num(row.get("belady_bytes_per_token"))
            if bpt is not None and bel:
                r = bpt / bel
            elif bpt is not None and bel == 0 and bpt > 0:
                r = math.inf
        ratios.append(r)
    ratio = _median(ratios)
    reason = (
        _reason(pd_rows, "bytes_per_token_vs_belady")
        if any("bytes_per_token_vs_belady" in r for r in pd_rows)
        else "no Belady replay in the rows (an engine that records no routing trace)"
    )
    entry = _target(
        f"{pd} bytes/token <= 1.3x Belady", where, ratio, BELADY_RATIO_TARGET, "<=", reason
    )
    if any(r.get("belady_initial_state") == "empty" for r in pd_rows):
        # NOTE: current engines report their starting cache and the replay
        # starts from it; only rows of an engine that does not get here
        entry["note"] = (
            "Belady replayed from an empty cache (these rows do not report the "
            "engine's starting cache contents): the optimum pays compulsory loads "
            "PD may not have, so the ratio is biased low"
        )
    return entry


def _verdict(problems: list[str], targets: list[dict[str, Any]]) -> dict[str, Any]:
    reasons = []
    if problems:
        reasons.append(f"invalid input: {len(problems)} validation problem(s), e.g. {problems[0]}")
    if not targets:
        reasons.append("no PD rows to judge")
    for t in targets:
        if t.get("applies") is False:
            continue
        if t["met"] is None:
            reasons.append(
                f"cannot judge '{t['target']}' at {t['where']}: {t['not_measured']['value']}"
            )
        elif not t["met"]:
            missed_by = "" if t["miss"] is None else f" (missed by {t['miss']:.4g})"
            reasons.append(
                f"'{t['target']}' missed at {t['where']}: {t['value']:.4g} vs {t['threshold']:.4g}"
                f"{missed_by}. Why: {t.get('why', 'n/a')}"
            )
    go = not reasons
    if go:
        judged = sum(1 for t in targets if t.get("applies") is not False)
        reasons.append(f"all {judged} applicable target checks met on valid rows")
    return {"go": go, "label": "GO" if go else "NO-GO", "reasons": reasons}


def evaluate(
    rows: Sequence[Mapping[str, Any]], required_baselines: Iterable[str] = REQUIRED_BASELINES
) -> dict[str, Any]:
    """Validate and evaluate ``rows``; see the module docstring for the keys."""
    problems = validate_rows(rows, required_baselines)
    # Evaluate what can be evaluated: rows with the identity to place them.
    usable = [
        r
        for r in rows
        if isinstance(r, Mapping)
        and r.get("baseline") in ROW_LABELS
        and all(k in r for k in ("arch", "block_size", "concurrency", "cache_fraction", "repeat"))
    ]
    table = _Table(usable)
    gap_points, gap_summary = _gap(table)
    regime = _regime(table)
    targets = _targets(table, regime)
    return {
        "rows": len(rows),
        "valid": not problems,
        "problems": problems,
        "eta_phys": _eta_phys(table),
        "intervals": _intervals(table),
        "verdicts": _verdicts(table),
        "noise": _noise(table),
        "ablation": ablation_table(usable),
        "controller": controller_table(usable),
        "ordering": _ordering(table),
        "gap": gap_points,
        "gap_by_cache_fraction": gap_summary,
        "regime": regime,
        "hide": _hide(usable),
        "targets": targets,
        "verdict": _verdict(problems, targets),
    }
