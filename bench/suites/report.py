"""``pdflash-bench report DIR``: validate and evaluate recorded rows.

Reads ``DIR/rows*.jsonl`` (or one rows file), writes ``report.md``,
``report.json``, ``rows.csv`` and the plots (into ``DIR`` or ``--out``),
prints the verdict, and exits non-zero when the input is invalid
(unparseable, missing baselines, bad values, vacuous metrics).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from . import _common as common

HELP = "validate and evaluate a results folder: Markdown, CSV, JSON, plots, GO/NO-GO"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "path", type=Path, help="results folder (its rows*.jsonl) or one rows .jsonl file"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="where to write (default: the folder)"
    )
    parser.add_argument(
        "--baselines",
        type=common.baselines,
        default=["B0", "B1", "B2", "B3", "PD"],
        help="baselines every point must have (default all five)",
    )
    parser.add_argument("--no-plots", action="store_true")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pdflash.report import load_rows, write_report
    from pdflash.report.writers import RowFileError

    try:
        rows = load_rows(args.path)
    except RowFileError as exc:
        return {"valid": False, "problems": [str(exc)], "verdict": "NO-GO", "exit_code": 2}
    out = args.out or (args.path if args.path.is_dir() else args.path.parent)
    evaluation = write_report(
        rows,
        out,
        required_baselines=args.baselines,
        command=f"pdflash-bench report {args.path}",
        plots=not args.no_plots,
    )
    verdict = evaluation["verdict"]
    return {
        "rows": len(rows),
        "valid": evaluation["valid"],
        "problems": evaluation["problems"],
        "verdict": verdict["label"],
        "reasons": verdict["reasons"],
        "files": evaluation["files"],
        "exit_code": 0 if evaluation["valid"] else 1,
    }
