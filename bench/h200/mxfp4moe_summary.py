"""Where the MXFP4 ``pdflash-bench moe`` row's wall time goes, from run.sh's
results.jsonl and log.txt (bench/h200/mxfp4moe_check.sh): per step its rc
and wall seconds (run.sh's own count), the row's phases (``setup_s``,
``phases_s``, each all-hit point's ``setup_s``), the Triton autotuning
reports in the step's log (``TRITON_PRINT_AUTOTUNING=1``: seconds per tuned
key), and for a step cut short the last phase line it logged (``moe [...]``).

    python3 bench/h200/mxfp4moe_summary.py OUT/results.jsonl OUT/log.txt [--out summary.json]
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from pdflash.report.writers import read_jsonl, read_results_text

STEP_END = re.compile(r"^== step (\S+) rc=(-?\d+) in (\d+) s$")
STEP_START = re.compile(r"^== step (\S+): ")
AUTOTUNE_DONE = re.compile(r"finished after ([0-9.]+)s")
AUTOTUNE_KEY = re.compile(r"with key as (.*),$")


def _log_sections(log: str) -> dict[str, dict[str, Any]]:
    """Per step: its wall seconds and rc (run.sh's count), its phase lines,
    the autotuning reports (key, seconds)."""
    steps: dict[str, dict[str, Any]] = {}
    current: dict[str, Any] | None = None
    key: str | None = None
    for line in log.splitlines():
        m = STEP_START.match(line)
        if m:
            current = steps[m.group(1)] = {"phase_lines": [], "autotune": []}
            continue
        m = STEP_END.match(line)
        if m and m.group(1) in steps:
            steps[m.group(1)].update(rc=int(m.group(2)), wall_s=int(m.group(3)))
            current = None
            continue
        if current is None:
            continue
        if line.startswith("moe ["):
            current["phase_lines"].append(line)
        k = AUTOTUNE_KEY.search(line)
        if k:
            key = k.group(1)
        d = AUTOTUNE_DONE.search(line)
        if d:
            current["autotune"].append({"key": key, "s": float(d.group(1))})
            key = None
    return steps


def _row_summary(row: dict[str, Any]) -> dict[str, Any]:
    points = [
        {"layer": p.get("layer"), "tokens": p.get("tokens"), **(p.get("setup_s") or {})}
        for p in row.get("all_hit") or []
    ]
    return {
        "checkpoint": row.get("checkpoint"),
        "compressed_gemm": row.get("compressed_gemm"),
        "mxfp4_dequantizer": row.get("mxfp4_dequantizer"),
        "run_s": row.get("run_s"),
        "close_adapter_s": row.get("close_adapter_s"),
        "setup_s": row.get("setup_s"),
        "phases_s": row.get("phases_s"),
        "all_hit_points_s": points,
        "offloaded_all_hit_us": [p.get("offloaded_all_hit_us") for p in row.get("all_hit") or []],
    }


def summarize(results: list[dict[str, Any]], log: str) -> dict[str, Any]:
    sections = _log_sections(log)
    out: dict[str, Any] = {}
    for rec in results:
        name = rec["step"]
        sec = sections.get(name, {})
        entry: dict[str, Any] = {"rc": rec["rc"], "wall_s": sec.get("wall_s")}
        result = rec.get("result")
        if isinstance(result, dict) and "per_layer" in result:
            row = entry["row"] = _row_summary(result)
            before = (row["setup_s"] or {}).get("before_run")
            parts = [before, row["run_s"], row["close_adapter_s"]]
            if entry["wall_s"] is not None and all(isinstance(v, (int, float)) for v in parts):
                # the step's wall (whole seconds) less the process's start-up, the
                # suite and the adapter's close: the issuer's close, the output and
                # the interpreter's exit (within a second)
                entry["after_row_s"] = entry["wall_s"] - sum(parts)
        elif isinstance(result, dict):
            entry["result"] = result
        autotune = sec.get("autotune") or []
        entry["autotune_keys"] = len(autotune)
        entry["autotune_s"] = sum(a["s"] for a in autotune)
        entry["autotune"] = autotune
        if rec["rc"] != 0:
            # where a cut step was: its last phase line
            lines = sec.get("phase_lines") or []
            entry["last_phase_line"] = lines[-1] if lines else None
        out[name] = entry
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    ap.add_argument("log")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    results = read_jsonl(args.results)
    log = read_results_text(args.log)
    summary = summarize(results, log)
    for name, e in summary.items():
        print(f"{name}: rc {e['rc']}, {e['wall_s']} s wall", end="")
        print(f", autotuned {e['autotune_keys']} keys in {e['autotune_s']:.1f} s")
        if "row" in e:
            r = e["row"]
            print(f"  checkpoint {r['checkpoint']}, run_s {r['run_s']}")
            print(f"  setup_s {json.dumps(r['setup_s'])}")
            print(f"  phases_s {json.dumps(r['phases_s'])}")
            for p in r["all_hit_points_s"]:
                print(f"  all-hit {json.dumps(p)}")
        if e.get("last_phase_line"):
            print(f"  cut during/after: {e['last_phase_line']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary}, f, indent=2)
    # the last line: the summary (run.sh keeps a step's last stdout line as its result)
    print(
        json.dumps(
            {"steps": {n: {"rc": e["rc"], "wall_s": e["wall_s"]} for n, e in summary.items()}}
        )
    )


if __name__ == "__main__":
    main()
