"""Result rows, their validation and evaluation, and the written report.

* :mod:`pdflash.report.schema` — the row schema of docs/design.md §6 and validation;
* :mod:`pdflash.report.belady` — offline-optimal replacement over a routing trace;
* :mod:`pdflash.report.evaluate` — ordering, gap closed, regime, hide
  inequality, targets and the GO/NO-GO verdict;
* :mod:`pdflash.report.writers` / :mod:`pdflash.report.plots` — JSON, CSV,
  Markdown and PNG output.

:func:`write_report` does all of it for a list of rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pdflash.report.evaluate import evaluate
from pdflash.report.schema import BASELINES, REQUIRED_BASELINES, validate_row, validate_rows
from pdflash.report.writers import load_rows

__all__ = ["BASELINES", "evaluate", "load_rows", "validate_row", "validate_rows", "write_report"]


def write_report(
    rows: Sequence[Mapping[str, Any]],
    out_dir: str | Path,
    required_baselines: Iterable[str] = REQUIRED_BASELINES,
    title: str = "pdflash-bench report",
    command: str | None = None,
    plots: bool = True,
) -> dict[str, Any]:
    """Evaluate ``rows`` and write ``report.json``, ``rows.csv``,
    ``report.md`` and (if ``plots``) ``money_plot.png`` and
    ``tokens_vs_concurrency.png`` into ``out_dir``.

    Returns the evaluation with the written paths under ``"files"``.
    """
    from pdflash.report import plots as plotting
    from pdflash.report import writers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    evaluation = evaluate(rows, required_baselines)
    files: dict[str, str] = {}
    pngs: list[str] = []
    if plots:
        for name, fn in (
            ("money_plot", plotting.money_plot),
            ("tokens_vs_concurrency", plotting.concurrency_plot),
        ):
            written = fn(rows, out / f"{name}.png")
            if written is not None:
                files[name] = str(written)
                pngs.append(str(written))
    writers.write_csv(out / "rows.csv", rows)
    files["csv"] = str(out / "rows.csv")
    md = writers.markdown_report(evaluation, rows, title=title, plots=pngs, command=command)
    (out / "report.md").write_text(md)
    files["markdown"] = str(out / "report.md")
    evaluation["files"] = files
    writers.write_json(out / "report.json", {**evaluation, "command": command})
    files["json"] = str(out / "report.json")
    return evaluation
