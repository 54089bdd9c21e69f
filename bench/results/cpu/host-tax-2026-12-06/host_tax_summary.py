"""Per process: PD's host time a step outside the forwards' spans less B1's,
PD's scheduler µs a step and its stood-down width's host ms a step (medians
over the process's runs at c=1), from each folder's rows.jsonl(.gz).

    python3 bench/results/cpu/host-tax-2026-12-06/host_tax_summary.py
"""

from __future__ import annotations

import gzip
import json
import statistics
from pathlib import Path
from typing import Any


def _rows(folder: Path) -> list[dict[str, Any]]:
    plain, packed = folder / "rows.jsonl", folder / "rows.jsonl.gz"
    text = plain.read_text() if plain.exists() else gzip.decompress(packed.read_bytes()).decode()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _outside_ms(row: dict[str, Any]) -> float:
    spans = float(row["draft_s"]) + float(row["verify_s"]) + float(row["prefill_s"])
    spans += float(row["predict_s"] or 0.0)
    return 1e3 * (float(row["wall_s"]) - spans) / int(row["steps"])


def main() -> None:
    for folder in sorted(p for p in Path(__file__).resolve().parent.iterdir() if p.is_dir()):
        rows = [r for r in _rows(folder) if r["concurrency"] == 1]
        pd = [r for r in rows if r["arm"] == "PD"]
        b1 = [r for r in rows if r["arm"] == "B1"]
        other = statistics.median(map(_outside_ms, pd)) - statistics.median(map(_outside_ms, b1))
        sched = statistics.median(r["scheduler_us_per_step"] for r in pd)
        stood = [r["verify_width"]["cost_gate"]["host_ms_per_stood_down_step"] for r in pd]
        print(
            f"{folder.name}: {len(pd)} runs an arm; PD - B1 outside the spans "
            f"{other:.3f} ms a step; PD scheduler {sched:.0f} us a step; "
            f"stood-down width {statistics.median(s for s in stood if s is not None):.3f} ms"
        )


if __name__ == "__main__":
    main()
