"""The command line the ``pdflash-bench moe`` summaries (allhit_summary.py,
allgraph_summary.py) share: read run.sh's results.jsonl, summarise each
step's moe row with the script's own function (which also prints it), note
the steps without one, and write the summaries as JSON with ``--out``.

    python3 bench/h200/<summary>.py OUT/results.jsonl [--out summary.json]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from pdflash.report.writers import read_jsonl


def main(summarise: Callable[[str, dict[str, Any]], dict[str, Any]]) -> None:
    """Run ``summarise(step, row)`` over every moe row of the results file
    named on the command line; its returns, keyed by step, go to ``--out``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    summary: dict[str, Any] = {}
    for step in read_jsonl(args.results):
        row = step.get("result")
        if not isinstance(row, dict) or row.get("suite") != "moe":
            print(f"{step['step']}: rc {step['rc']}, no moe row")
            continue
        summary[step["step"]] = summarise(step["step"], row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
