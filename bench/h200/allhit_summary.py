"""Summarise ``pdflash-bench moe`` all-hit rows (issue 13's per-layer target)
from run.sh's results.jsonl: per arch, layer and token count, both sides'
back-to-back, host-issue and device-only µs, the ratios and the targets.

    python3 bench/h200/allhit_summary.py OUT/results.jsonl [--out summary.json]
"""

from __future__ import annotations

from typing import Any

import moe_summary  # type: ignore[import-not-found]  # bench/h200/, next to this script

FIELDS = (
    "layer",
    "tokens",
    "active_experts",
    "offloaded_all_hit_us",
    "grouped_mm_active_us",
    "hbm_roofline_us",
    "offloaded_all_hit_host_us",
    "grouped_mm_active_host_us",
    "offloaded_all_hit_device_us",
    "grouped_mm_active_device_us",
    "offloaded_over_grouped_mm",
    "offloaded_over_grouped_mm_device",
    "offloaded_over_roofline",
    "offloaded_host_bound",
    "grouped_mm_host_bound",
    "meets_1p25x_grouped_mm",
    "meets_2x_roofline",
    "offloaded_all_hit_rounds_us",
    "grouped_mm_active_rounds_us",
    "compressed_gemm",
    "max_abs_err_vs_grouped_mm",
    "offloaded_all_hit_dispatches",
    "grouped_mm_active_dispatches",
    "offloaded_all_hit_syncs",
    "grouped_mm_active_syncs",
    "row_sort",
    "by_row_sort",
)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.0f}"
    if isinstance(v, list):
        return "[" + " ".join(_fmt(x) for x in v) + "]"
    return str(v)


def summarise(step: str, row: dict[str, Any]) -> dict[str, Any]:
    """One step's moe row: its all-hit points' :data:`FIELDS`, printed too."""
    rows = [{k: r.get(k) for k in FIELDS} for r in row.get("all_hit", [])]
    print(
        f"{step}: {row.get('preset')} {row.get('expert_format')} targets {row.get('all_hit_targets')}"
    )
    for r in rows:
        print(
            f"  L{r['layer']} t={r['tokens']} E={r['active_experts']} | "
            f"offl {_fmt(r['offloaded_all_hit_us'])} (host {_fmt(r['offloaded_all_hit_host_us'])}, "
            f"dev {_fmt(r['offloaded_all_hit_device_us'])}) | "
            f"gmm {_fmt(r['grouped_mm_active_us'])} (host {_fmt(r['grouped_mm_active_host_us'])}, "
            f"dev {_fmt(r['grouped_mm_active_device_us'])}) | roof {_fmt(r['hbm_roofline_us'])} | "
            f"x{_fmt(r['offloaded_over_grouped_mm'])} dev x{_fmt(r['offloaded_over_grouped_mm_device'])} "
            f"roof x{_fmt(r['offloaded_over_roofline'])} | rounds {_fmt(r['offloaded_all_hit_rounds_us'])}"
        )
        ops, plain_ops = (
            r["offloaded_all_hit_dispatches"],
            r["grouped_mm_active_dispatches"],
        )
        if ops and plain_ops:
            print(
                f"    torch ops/call offl {ops['all']} ({ops['kernel_ops']} kernel ops) "
                f"gmm {plain_ops['all']} ({plain_ops['kernel_ops']}) | syncs offl "
                f"{r['offloaded_all_hit_syncs']} gmm {r['grouped_mm_active_syncs']}"
            )
        for mode, o in (r.get("by_row_sort") or {}).items():
            print(
                f"    row sort {mode} (main: {r['row_sort']}): offl "
                f"{_fmt(o['offloaded_all_hit_us'])} (host {_fmt(o['offloaded_all_hit_host_us'])}, "
                f"dev {_fmt(o['offloaded_all_hit_device_us'])}) x{_fmt(o['offloaded_over_grouped_mm'])} "
                f"dev x{_fmt(o['offloaded_over_grouped_mm_device'])} | torch ops/call "
                f"{o['offloaded_all_hit_dispatches']['all']} | syncs {o['offloaded_all_hit_syncs']} "
                f"| diff {o['max_abs_diff_vs_main']}"
            )
    return {
        "arch": row.get("arch"),
        "preset": row.get("preset"),
        "expert_format": row.get("expert_format"),
        "compressed_gemm": row.get("compressed_gemm"),
        "load_s": row.get("load_s"),
        "write_s": row.get("write_s"),
        "all_hit_targets": row.get("all_hit_targets"),
        "all_hit": rows,
    }


if __name__ == "__main__":
    moe_summary.main(summarise)
