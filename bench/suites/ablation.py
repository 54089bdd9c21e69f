"""``pdflash-bench ablation``: what each part of PD buys.

Runs PD (its parts under the PD controller), ``PD-all-on`` (every part
forced on: what the controller buys), PD with one part switched off
(``PD-no-route-ahead``, ``PD-one-band``: every copy in one FIFO band,
``PD-token-sched``: the token-only scheduler, ``PD-no-stream``: no streaming
prefetcher, ``PD-full-width``: every draft verified instead of the adaptive
verify width, :mod:`pdflash.engine.verify_width`) and, with
``--with-host``, PD+host, side by side at every point, interleaved
round-robin over the repeats (>= 3 by default: each repeat runs every label
once, starting one label later than the last). Rows go to ``OUT/rows.jsonl``
(the matrix's runner: a rerun resumes, failures go to ``errors.jsonl``);
``OUT/ablation.md`` / ``ablation.json`` hold the "what each part buys"
table — tokens/s, bytes per token and exposed fetch seconds, each a median
with its 95% interval, and the verdict against full PD
(:func:`pdflash.report.stats.compare`) — and the full report of
``pdflash-bench report`` is written beside them.

The serving-workload options (``--arrivals poisson --rate 2,4
--max-running … --token-budget … --byte-budget-from verify``) make the
scheduler and the byte budget bind; a list of rates is a sweep (each rate
its own point).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pdflash.labels import ABLATIONS

from . import _common as common
from . import matrix

HELP = (
    "PD vs PD-all-on and PD without route-ahead / bands / the 2-D scheduler / streaming / "
    "the adaptive verify width: what each part (and the controller) buys"
)

#: The ablations, in the order they run within a repeat (after PD).
VARIANTS = ABLATIONS
DEFAULT_REPEATS = 3


def _variants(text: str) -> list[str]:
    values = common.parse_list(text, str, "--variants")
    bad = [v for v in values if v not in VARIANTS]
    if bad:
        raise argparse.ArgumentTypeError(f"--variants: unknown {bad[0]!r}; known: {VARIANTS}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    matrix.add_run_arguments(parser)
    g = parser.add_argument_group("ablation")
    matrix.add_point_arguments(g, concurrency=[4], cache_fraction=[0.2])
    g.add_argument(
        "--variants",
        type=_variants,
        default=list(VARIANTS),
        help="comma list of " + ", ".join(VARIANTS) + " (default all)",
    )
    g.add_argument(
        "--with-host", action="store_true", help="also run PD+host (hybrid miss service)"
    )
    g.add_argument(
        "--repeats",
        type=int,
        default=DEFAULT_REPEATS,
        help=f"repeats per point, labels interleaved round-robin (default {DEFAULT_REPEATS})",
    )
    matrix.add_output_arguments(g, "ablation", no_report="only rows and the ablation table")


def labels(args: argparse.Namespace) -> list[str]:
    """PD first, then the chosen ablations, then PD+host if asked."""
    return ["PD", *args.variants, *(["PD+host"] if args.with_host else [])]


def plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The matrix's plan with the ablation labels as its baselines: per
    point, per repeat every label once, rotated each repeat."""
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    ns = argparse.Namespace(**vars(args))
    ns.baselines = labels(args)
    return matrix.plan(ns)


def ablation_command(args: argparse.Namespace, out: Path) -> str:
    """The full command that reproduces this run (every option spelled out)."""
    ns = argparse.Namespace(**vars(args))
    ns.baselines = labels(args)
    text = matrix.matrix_command(ns, out)
    text = text.replace("pdflash-bench matrix", "pdflash-bench ablation", 1)
    variants = "--variants " + ",".join(args.variants) + (" --with-host" if args.with_host else "")
    return text.replace("--baselines " + ",".join(ns.baselines), variants, 1)


def write_table(rows: list[dict[str, Any]], out: Path) -> dict[str, Any]:
    """``ablation.json`` and ``ablation.md`` from the rows; returns the table."""
    from pdflash.report.ablation import ablation_markdown, ablation_table
    from pdflash.report.plots import inputs_caption
    from pdflash.report.writers import write_json

    table = ablation_table(rows)
    write_json(out / "ablation.json", {"table": table})
    md = [
        "# What each part of PD buys",
        "",
        "Inputs: " + inputs_caption(rows).replace("\n", " | "),
        "",
        "PD (its parts under the PD controller) against PD-all-on (every part forced on) "
        "and PD with one part switched off (PD+host: with the hybrid miss service "
        "added). Median [95% t interval] over repeats; the verdict names the better side "
        "only where the intervals separate (more tokens/s, fewer bytes/token, less exposed "
        "fetch s), else 'within noise'. The last column pairs the interleaved repeats: PD's "
        "tokens/s over the variant's, repeat by repeat, naming the better side where the "
        "ratios' interval excludes 1.",
        "",
        ablation_markdown(table),
        "",
    ]
    (out / "ablation.md").write_text("\n".join(md))
    return {"table": table, "markdown": str(out / "ablation.md")}


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out or Path("bench-results") / f"ablation-{common.utc_stamp()}")
    specs = plan(args)
    if args.dry_run:
        todo = matrix.unrecorded(specs, out / matrix.ROWS_FILE)
        return {
            "planned": len(specs),
            "already_recorded": len(specs) - len(todo),
            "to_run": len(todo),
            "order": [f"{s['baseline']}/r{s['repeat']}" for s in todo[: 2 * len(labels(args))]],
        }
    summary = matrix.run_planned(specs, out, args)
    cmd = ablation_command(args, out)
    matrix.log_command(out, cmd)
    summary["command"] = cmd
    from pdflash.report import write_report

    rows = matrix.load_result_rows(out)
    written = write_table(rows, out)
    summary["ablation_table"] = written["markdown"]
    summary["verdicts"] = [
        {
            "point": e["point"],
            "variant": e["variant"],
            **{name: e[name]["verdict"] for name in ("output_tokens_per_s", "bytes_per_token")},
            "exposed_fetch_s": e["exposed_fetch_s"]["verdict"],
        }
        for e in written["table"]
    ]
    if not args.no_report and rows:
        evaluation = write_report(
            rows,
            out,
            required_baselines=labels(args),
            title="pdflash-bench ablation",
            command=cmd,
        )
        summary["valid"] = evaluation["valid"]
        summary["problems"] = len(evaluation["problems"])
        summary["report"] = evaluation["files"].get("markdown")
    summary["exit_code"] = 1 if summary["failed"] or not rows else 0
    return summary
