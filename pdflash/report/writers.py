"""Reading rows and writing the report: JSON, CSV, Markdown."""

from __future__ import annotations

import csv
import gzip
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pdflash.report import stats
from pdflash.report.schema import (
    IDENTITY_FIELDS,
    METRIC_FIELDS,
    OPTIONAL_METRIC_FIELDS,
    inputs_label,
    series_labels,
    workload_label,
)

ROWS_FILE = "rows.jsonl"


class RowFileError(ValueError):
    """A rows file that cannot be parsed; the message names file and line."""


def results_path(path: str | Path) -> Path:
    """``path``, or ``path.gz`` where only that exists: committed results are
    gzipped (``bench/compact_results.py``) while runs write plain files."""
    p = Path(path)
    if not p.exists() and p.suffix != ".gz":
        gz = p.with_name(p.name + ".gz")
        if gz.is_file():
            return gz
    return p


def read_results_text(path: str | Path) -> str:
    """A results file's text, gunzipped where it ends in ``.gz`` (see
    :func:`results_path` for the name)."""
    p = results_path(path)
    if p.suffix == ".gz":
        with gzip.open(p, "rt", encoding="utf-8") as fh:
            return fh.read()
    return p.read_text(encoding="utf-8")


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The JSON objects of one ``.jsonl`` (or ``.jsonl.gz``) file, one a line;
    blank lines are skipped, anything else that is not an object raises
    :class:`RowFileError` naming file and line."""
    p = results_path(path)
    if not p.is_file():
        raise RowFileError(f"{p} does not exist")
    rows: list[dict[str, Any]] = []
    for lineno, line in enumerate(read_results_text(p).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RowFileError(f"{p}:{lineno}: not JSON ({exc.msg})") from exc
        if not isinstance(row, dict):
            raise RowFileError(f"{p}:{lineno}: a row must be a JSON object")
        rows.append(row)
    return rows


def rows_files(folder: Path) -> list[Path]:
    """``rows*.jsonl`` and ``rows*.jsonl.gz`` directly in ``folder``, by name;
    a ``.gz`` whose plain file is also there is left out (same rows)."""
    plain = set(folder.glob("rows*.jsonl"))
    gz = {f for f in folder.glob("rows*.jsonl.gz") if f.with_suffix("") not in plain}
    return sorted(plain | gz, key=lambda f: f.name.removesuffix(".gz"))


def load_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows from a rows file, or from every ``rows*.jsonl`` directly in a folder
    (so results of several matrix runs can be combined: ``rows-gpt-oss.jsonl``,
    ``rows-qwen.jsonl``; ``errors.jsonl`` is not rows). Gzipped files
    (``.jsonl.gz``, as committed results are) read the same; a missing
    ``rows.jsonl`` falls back to ``rows.jsonl.gz``.

    Non-finite numbers (``NaN``, ``Infinity``) parse, so that validation can
    name them; a line that is not JSON raises :class:`RowFileError`.
    """
    p = results_path(path)
    if p.is_dir():
        files = rows_files(p)
        if not files:
            raise RowFileError(f"no rows*.jsonl file in {p}")
    elif p.is_file():
        files = [p]
    else:
        raise RowFileError(f"{p} does not exist")
    return [row for f in files for row in read_jsonl(f)]


def append_row(path: str | Path, row: Mapping[str, Any]) -> None:
    """Append one row as a JSON line (never rewrites earlier lines)."""
    line = json.dumps(row, sort_keys=True, allow_nan=False, default=_json_default)
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(line + "\n")
        fh.flush()


def _json_default(obj: object) -> object:
    # numpy scalars and arrays
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def _clean(obj: Any) -> Any:
    """Replace non-finite floats by None so the report JSON stays strict."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, Mapping):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def write_json(path: str | Path, obj: Any) -> None:
    Path(path).write_text(
        json.dumps(_clean(obj), indent=2, sort_keys=True, default=_json_default) + "\n"
    )


def csv_columns(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    known = [*IDENTITY_FIELDS, *METRIC_FIELDS, *OPTIONAL_METRIC_FIELDS]
    extra = sorted({k for r in rows for k in r if k not in known and k != "not_measured"})
    present = [k for k in known if any(k in r for r in rows)]
    return [*present, *extra, "not_measured"]


def write_csv(path: str | Path, rows: Sequence[Mapping[str, Any]]) -> None:
    """One line per row; nested values (parameters, reasons) as JSON text."""
    columns = csv_columns(rows)
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(columns)
        for row in rows:
            out = []
            for col in columns:
                value = row.get(col)
                if isinstance(value, (dict, list)):
                    value = json.dumps(value, sort_keys=True)
                out.append("" if value is None else value)
            writer.writerow(out)


def fmt(value: Any, digits: int = 4) -> str:
    """A number for a table; ``—`` for a missing one."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.{digits}g}"
    return str(value)


def _table(header: Sequence[str], lines: Sequence[Sequence[Any]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    out.extend("| " + " | ".join(fmt(v) for v in line) + " |" for line in lines)
    return "\n".join(out)


ROW_TABLE_COLUMNS = (
    "arch",
    "baseline",
    "block_size",
    "concurrency",
    "cache_fraction",
    "workload",
    "repeat",
    "output_tokens_per_s",
    "acceptance_length_mean",
    "expert_cache_hit_rate",
    "routeahead_coverage",
    "eta_phys",
    "eta",
    "bytes_per_token",
    "bytes_per_token_vs_belady",
    "exposed_fetch_s",
    "inputs",
)


def _cell(row: Mapping[str, Any], column: str) -> Any:
    if column == "inputs":
        return inputs_label(row)
    if column == "workload":
        return workload_label(row)
    return row.get(column)


def rows_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The per-row Markdown table (also what the default suite prints); its
    ``inputs`` column says on every row where weights, acceptance (forced
    with its mean) and routing came from, its ``baseline`` column the series
    (with the setting where a point holds several of the label)."""
    series = series_labels(rows)
    return _table(
        ROW_TABLE_COLUMNS,
        [
            [series[id(r)] if c == "baseline" else _cell(r, c) for c in ROW_TABLE_COLUMNS]
            for r in rows
        ],
    )


def _iv(cell: Mapping[str, Any] | None, digits: int = 4) -> str:
    """``median [low, high]``, or the median alone with ``(n=1)``."""
    if not cell or cell.get("median") is None:
        return "—"
    med = fmt(cell["median"], digits)
    if cell.get("low") is None:
        return f"{med} (n={cell.get('n', 0)})"
    return f"{med} [{fmt(cell['low'], digits)}, {fmt(cell['high'], digits)}]"


def _where(e: Mapping[str, Any]) -> list[Any]:
    return [e["arch"], e["block_size"], e["concurrency"], e["cache_fraction"], e["workload"]]


WHERE = ("arch", "B", "conc", "cache", "workload")


def _pairs_cells(v: Mapping[str, Any]) -> list[str]:
    """A verdict's paired repeats (``pairs`` of
    :func:`pdflash.report.evaluate.evaluate`'s verdicts): who is faster by
    them, and the ratios' median [interval] (n)."""
    pairs = v.get("pairs") or {}
    called = pairs.get("verdict")
    if called is None:
        return ["not called: " + str(pairs.get("reason", "no pairs")), ""]
    who = "within noise" if called == "within noise" else f"{called} faster"
    return [who, stats.pairs_text(pairs)]


def lead_sections(evaluation: Mapping[str, Any]) -> list[str]:
    """The report's lead: eta_phys per point (eta beside it, the compute
    floor stated), the measured noise, and the per-point verdicts."""
    parts: list[str] = []
    lead = evaluation.get("eta_phys") or {}
    parts += [
        "## Distance to the physical limit: eta_phys (eta beside it)",
        "",
        "eta_phys = max(miss floor, compute floor) / wall, median [95% t interval] over "
        "repeats. Compute floor used: " + " | ".join(lead.get("compute_floor", ["not stated"])),
        "",
    ]
    parts.append(
        _table(
            (
                *WHERE,
                "baseline",
                "eta_phys",
                "eta",
                "miss floor s",
                "compute busy s",
                "wall s",
                "n",
                "floor from",
            ),
            [
                [
                    *_where(e),
                    e["baseline"],
                    _iv(
                        {
                            "median": e["eta_phys"],
                            "low": e["eta_phys_low"],
                            "high": e["eta_phys_high"],
                            "n": e["repeats"],
                        },
                        3,
                    ),
                    e["eta"],
                    e["miss_floor_s"],
                    e["compute_busy_s"],
                    e["wall_s"],
                    e["repeats"],
                    e.get("compute_floor_source", "row"),
                ]
                for e in lead.get("per_point", [])
            ],
        )
    )
    noise = evaluation.get("noise") or {}
    parts += ["", "## Measured noise", ""]
    if noise.get("median") is None:
        parts.append(
            "Not measured: "
            + str((noise.get("not_measured") or {}).get("median", "no repeated points"))
        )
    else:
        parts.append(
            f"Tokens/s run-to-run noise (half-width of the 95% t interval over repeats / median, "
            f"over {noise['cells']} (point, baseline) cells): median ±{100 * noise['median']:.1f}%, "
            f"max ±{100 * noise['max']:.1f}%."
        )
    parts += [
        "",
        "## Per point: PD against each baseline (tokens/s, 95% intervals)",
        "",
        "A difference is called only where the two intervals separate; otherwise "
        '"within noise". One repeat measures no noise, so nothing is called from it. '
        "The repeats are interleaved, so they also pair: the last columns divide PD's "
        "tokens/s by the other's repeat by repeat and call a difference where the ratios' "
        "95% interval excludes 1 (a steady difference smaller than the repeats' spread "
        "shows there, a loss as well as a win).",
        "",
    ]
    parts.append(
        _table(
            (
                *WHERE,
                "vs",
                "verdict",
                "PD vs other: median [interval] (n)",
                "by the pairs",
                "PD / other per repeat: median [interval] (n)",
            ),
            [
                [
                    *_where(v),
                    v["b"] if v.get("a", "PD") == "PD" else f"{v['a']} vs {v['b']}",
                    (
                        f"{v.get('a', 'PD')} faster"
                        if v["verdict"] == v.get("a", "PD")
                        else f"{v['b']} faster"
                        if v["verdict"] == v["b"]
                        else (v["verdict"] or "not called: " + v.get("reason", ""))
                    ),
                    v.get("text", ""),
                    *_pairs_cells(v),
                ]
                for v in evaluation.get("verdicts", [])
            ],
        )
    )
    if evaluation.get("ablation"):
        from pdflash.report.ablation import ablation_markdown

        parts += [
            "",
            "## What each part of PD buys (PD vs PD without it)",
            "",
            "PD runs its parts under the PD controller; PD-all-on is PD with every part "
            "forced on (what the controller buys). "
            "Median [95% t interval] over repeats; the verdict names the better side only "
            "where the intervals separate (more tokens/s, fewer bytes/token, less exposed fetch). "
            "The last column pairs the interleaved repeats: PD's tokens/s over the variant's, "
            "repeat by repeat, naming the better side where the ratios' interval excludes 1.",
            "",
            ablation_markdown(evaluation["ablation"]),
        ]
    if evaluation.get("controller"):
        from pdflash.report.ablation import controller_markdown

        parts += [
            "",
            "## The PD controller's decisions",
            "",
            "Median over runs of the fraction of measured steps each part ran (its "
            "probes' flipped steps included), the switches of each run and the first "
            "switch's reason (pd_parts in each row).",
            "",
            controller_markdown(evaluation["controller"]),
        ]
    parts += ["", "## Median and 95% interval per point", ""]
    parts.append(
        _table(
            (*WHERE, "baseline", "tokens/s", "bytes/token", "exposed fetch s", "eta_phys"),
            [
                [
                    *_where(e),
                    e["baseline"],
                    _iv(e["output_tokens_per_s"]),
                    _iv(e["bytes_per_token"]),
                    _iv(e["exposed_fetch_s"], 3),
                    _iv(e["eta_phys"], 3),
                ]
                for e in evaluation.get("intervals", [])
            ],
        )
    )
    parts.append("")
    return parts


def markdown_report(
    evaluation: Mapping[str, Any],
    rows: Sequence[Mapping[str, Any]],
    title: str = "pdflash-bench report",
    plots: Sequence[str] = (),
    command: str | None = None,
) -> str:
    """The human report: verdict first, then the evidence."""
    verdict = evaluation["verdict"]
    parts = [f"# {title}", ""]
    if command:
        parts += ["Command:", "", f"    {command}", ""]
    parts += [f"## Verdict: **{verdict['label']}**", ""]
    parts += [f"- {r}" for r in verdict["reasons"][:40]]
    if len(verdict["reasons"]) > 40:
        parts.append(f"- … and {len(verdict['reasons']) - 40} more (see report.json)")
    parts.append("")
    if evaluation["problems"]:
        parts += ["## Validation problems", ""]
        parts += [f"- {p}" for p in evaluation["problems"][:100]]
        parts.append("")
    sources = sorted(
        {
            (
                str(r.get("weights_source")),
                str(r.get("acceptance_source")),
                str(r.get("routing_source")),
                str(r.get("device")),
            )
            for r in rows
        }
    )
    parts += ["## Inputs", ""]
    parts.append(_table(("weights", "acceptance", "routing", "device"), sources))
    parts += [
        "",
        "Inputs, as each row is labelled: " + " | ".join(sorted({inputs_label(r) for r in rows})),
        "",
    ]
    parts += lead_sections(evaluation)
    for plot in plots:
        parts += [f"![{Path(plot).stem}]({Path(plot).name})", ""]

    parts += ["## Tokens/s per baseline (median over repeats) and ordering", ""]
    lines = []
    # a label's column, or one per series where the rows hold several settings of it
    ordered = ("B0", "B1", "B2", "PD", "B3")
    columns = [
        name
        for base in ordered
        for name in dict.fromkeys(k for e in evaluation["ordering"] for k in e["tokens_per_s"])
        if name == base or name.startswith(f"{base} [")
    ] or list(ordered)
    for e in evaluation["ordering"]:
        tps = e["tokens_per_s"]
        broken = [c["relation"] for c in e["checks"] if c["holds"] is False]
        lines.append(
            _where(e)
            + [tps.get(b) for b in columns]
            + [
                "holds"
                if e["holds"]
                else ("broken: " + ", ".join(broken) if broken else "incomplete")
            ]
        )
    parts.append(
        _table(
            (*WHERE, *columns, "B0<B1<B2<PD<=B3"),
            lines,
        )
    )
    parts += ["", "## Share of the B1→B3 gap PD closes", ""]
    gaps = evaluation["gap_by_cache_fraction"]
    # the PD, B1 and B3 series of each line where the rows hold several settings of one
    by_series = any("series" in g for g in gaps)
    parts.append(
        _table(
            (
                "arch",
                "B",
                "cache",
                "workload",
                *(("PD / B1 / B3",) if by_series else ()),
                "min",
                "median",
                "points measured",
            ),
            [
                [
                    g["arch"],
                    g["block_size"],
                    g["cache_fraction"],
                    g["workload"],
                    *((" / ".join(g["series"].values()),) if by_series else ()),
                    g["gap_closed_min"],
                    g["gap_closed_median"],
                    f"{g['points_measured']}/{g['points']}",
                ]
                for g in gaps
            ],
        )
    )
    parts += ["", "## Regime (PD link-busy / compute-busy)", ""]
    parts.append(
        _table(
            ("arch", "cache", "link/compute busy", "Belady link need/compute", "bound"),
            [
                [
                    r["arch"],
                    r["cache_fraction"],
                    r["link_to_compute_busy"],
                    r["belady_link_to_compute"],
                    r["bound"] or "unknown: " + r.get("not_measured", {}).get("bound", ""),
                ]
                for r in evaluation["regime"]
            ],
        )
    )
    parts += [
        "",
        "## Hide inequality (summed over each run)",
        "",
        "fetch = (1 − r)·routed bytes/BW vs window = t_draft + t_router + verify overlap; "
        "where the engine gives no overlap term, the verify's compute time "
        "(verify_s − exposed_fetch_s) stands in for it: an upper bound.",
        "",
    ]
    parts.append(
        _table(
            (
                "arch",
                "baseline",
                "conc",
                "cache",
                "rep",
                "fetch s",
                "window s",
                "margin s",
                "holds",
                "why unmeasured",
            ),
            [
                [
                    h["arch"],
                    h["baseline"],
                    h["concurrency"],
                    h["cache_fraction"],
                    h["repeat"],
                    h["fetch_s"],
                    h["window_s"],
                    h["margin_s"],
                    h["holds"],
                    h.get("not_measured", {}).get("margin_s", ""),
                ]
                for h in evaluation["hide"]
            ],
        )
    )
    parts += ["", "## Targets", ""]
    parts.append(
        _table(
            ("target", "where", "value", "threshold", "met", "missed by", "note"),
            [
                [
                    t["target"],
                    t["where"],
                    t["value"],
                    t["threshold"],
                    "n/a" if t.get("applies") is False else t["met"],
                    t["miss"],
                    t.get("not_applicable")
                    or t.get("not_measured", {}).get("value")
                    or t.get("why")
                    or t.get("note", ""),
                ]
                for t in evaluation["targets"]
            ],
        )
    )
    parts += ["", "## Rows", "", rows_table(rows), ""]
    reasons = sorted({(k, v) for r in rows for k, v in (r.get("not_measured") or {}).items()})
    if reasons:
        parts += ["## Not measured, and why", ""]
        parts += [f"- `{k}`: {v}" for k, v in reasons]
        parts.append("")
    return "\n".join(parts)
