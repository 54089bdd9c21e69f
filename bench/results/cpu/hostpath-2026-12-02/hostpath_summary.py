"""Medians over runs of the eager_host rows run.sh wrote (one table)."""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

rows: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
for p in sorted(Path(sys.argv[1]).glob("*-run*.json")):
    tag, side, every, _ = p.stem.split("-")
    rows[(tag, side, every)].append(json.loads(p.read_text()))


def med(values: list[float | None]) -> str:
    vals = [v for v in values if v is not None]
    return f"{statistics.median(vals):.0f}" if vals else "-"


pieces: list[str] = []
for rs in rows.values():
    for r in rs:
        for k in r["host"]["pieces_us_per_hosting_layer"]:
            if k not in pieces:
                pieces.append(k)
head = ["tag", "side", "every", "runs", "forward", "fwd-wait", "hosting/step", "own", "wait"]
print("| " + " | ".join(head + pieces) + " |")
print("|" + "---|" * (len(head) + len(pieces)))
for (tag, side, every), rs in sorted(rows.items()):
    h = [r["host"] for r in rs]
    cells = [tag, side, every, str(len(rs))]
    cells.append(med([r["forward_us"] for r in rs]))
    cells.append(med([x["forward_less_wait_us"] for x in h]))
    cells.append(med([x["hosting_layers_per_step"] for x in h]))
    cells.append(med([x["own_us_per_hosting_layer"] for x in h]))
    cells.append(med([x["wait_us_per_hosting_layer"] for x in h]))
    for k in pieces:
        cells.append(med([x["pieces_us_per_hosting_layer"].get(k) for x in h]))
    print("| " + " | ".join(cells) + " |")
