"""Tables from ``sched_steps_probe.py``'s ``steps.jsonl`` (and the matrix's ``rows.jsonl``).

    python bench/results/cpu/schedprobe-2026-12-01/sched_steps_summary.py OUT

Per run: measured steps, committed tokens per second of the steps' wall, and
per step the means of requests waiting / served, tokens granted, drafts
trimmed, predicted-missing bytes of the executed batch, and each scheduler's
host microseconds; then the per-label medians, and the step-to-step noise of
the log of each rate (verified, committed, expected committed): the sd of
the difference of consecutive measured steps' log rates, what one probe
pair's statistic carries from the step noise alone.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections import defaultdict
from pathlib import Path
from statistics import median
from typing import Any

from pdflash.report.writers import read_jsonl


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _sd(xs: list[float]) -> float:
    if len(xs) < 2:
        return float("nan")
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def per_run(steps: list[dict[str, Any]]) -> dict[str, Any]:
    wall = sum(s["wall_s"] for s in steps)
    executed = [s for s in steps if s["selects"]]

    def chosen(s: dict[str, Any]) -> dict[str, Any]:
        sel = s["selects"]
        want = s["executed"]
        return next((c for c in sel if c["batcher"] == want), sel[0])

    def by(name: str, key: str) -> float:
        xs = [c[key] for s in executed for c in s["selects"] if c["batcher"] == name]
        return _mean(xs)

    differ = [
        s
        for s in executed
        if len(s["selects"]) == 2
        and (s["selects"][0]["served"], s["selects"][0]["tokens"])
        != (s["selects"][1]["served"], s["selects"][1]["tokens"])
    ]
    two_d = [s for s in executed if s["executed"] == "deficit_2d"]
    return {
        "steps": len(steps),
        "committed_per_s": sum(s["committed_tokens"] for s in steps) / wall,
        "verified_per_s": sum(s["verified_tokens"] for s in steps) / wall,
        "wall_per_step_ms": 1e3 * wall / len(steps),
        "waiting": _mean([chosen(s)["waiting"] for s in executed]),
        "served": _mean([chosen(s)["served"] for s in executed]),
        "tokens": _mean([chosen(s)["tokens"] for s in executed]),
        "asked": _mean([chosen(s)["asked_tokens"] for s in executed]),
        "trimmed_tokens": _mean([chosen(s)["trimmed_tokens"] for s in executed]),
        "missing_kb": _mean([chosen(s)["missing_bytes"] / 1024 for s in executed]),
        "committed_per_step": _mean([s["committed_tokens"] for s in steps]),
        "us_2d": by("deficit_2d", "us"),
        "us_tokens": by("deficit_tokens", "us"),
        "differ_share": len(differ) / len(executed) if executed and differ is not None else None,
        "two_d_share": len(two_d) / len(executed) if executed else None,
    }


def noise(steps: list[dict[str, Any]]) -> dict[str, float]:
    out = {}
    for name, key in (
        ("verified", "verified_tokens"),
        ("committed", "committed_tokens"),
        ("expected_committed", "expected_committed"),
    ):
        logs = [
            math.log(s[key] / s["wall_s"])
            for s in steps
            if s["admitted"] == 0 and s[key] and s[key] > 0 and s["wall_s"] > 0
        ]
        diffs = [b - a for a, b in itertools.pairwise(logs)]
        out[name] = _sd(diffs)
    return out


def main() -> int:
    out = Path(sys.argv[1])
    runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in read_jsonl(out / "steps.jsonl"):
        runs[s["run"]].append(s)
    cols = [
        "steps",
        "committed_per_s",
        "verified_per_s",
        "wall_per_step_ms",
        "waiting",
        "served",
        "asked",
        "tokens",
        "trimmed_tokens",
        "missing_kb",
        "committed_per_step",
        "us_2d",
        "us_tokens",
        "differ_share",
        "two_d_share",
    ]
    print("| run | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    by_label: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    noises: dict[tuple[str, int], list[dict[str, float]]] = defaultdict(list)
    for name, steps in sorted(runs.items()):
        r = per_run(steps)
        key = (steps[0]["baseline"], steps[0]["concurrency"])
        by_label[key].append(r)
        noises[key].append(noise(steps))
        cells = [f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print()
    print("| label | c | runs | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 3) + "|")
    for (label, c), rs in sorted(by_label.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        cells = []
        for col in cols:
            xs = [r[col] for r in rs if r[col] is not None and not math.isnan(r[col])]
            cells.append(f"{median(xs):.3g}" if xs else "—")
        print(f"| {label} | {c} | {len(rs)} | " + " | ".join(cells) + " |")
    print()
    print("sd of consecutive measured steps' log-rate difference (median over runs):")
    print("| label | c | verified | committed | expected committed |")
    print("|---|---|---|---|---|")
    for (label, c), ns in sorted(noises.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        cells = [
            f"{median([n[k] for n in ns if not math.isnan(n[k])]):.3f}"
            for k in ("verified", "committed", "expected_committed")
        ]
        print(f"| {label} | {c} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
