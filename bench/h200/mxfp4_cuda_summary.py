"""Summarise the ``pdflash-bench moe`` rows of
``bench/h200/mxfp4_cuda_check.sh``: per layer and token count, each
compressed-GEMM mode's µs (``--compressed-gemm both``: dequant, fused =
Triton registers, fused_dot_scaled = Triton tl.dot_scaled, fused_cuda = the
CUDA kernel), its ratio to the HBM roofline and its max error vs the dequant
path, plus the modes not measured and why; and the row's own mode replayed
from a CUDA graph (``--resident-graphs on|both``: ``graph``).

    python3 bench/h200/mxfp4_cuda_summary.py OUT/results.jsonl [--out summary.json]
"""

from __future__ import annotations

from typing import Any

import moe_summary  # type: ignore[import-not-found]  # bench/h200/, next to this script


def summarise(step: str, row: dict[str, Any]) -> dict[str, Any]:
    """One step's moe row: per all-hit point, each mode's µs, x roofline and error."""
    points = []
    for r in row.get("all_hit", []):
        modes = {
            mode: {
                "us": m.get("offloaded_all_hit_us"),
                "over_roofline": m.get("offloaded_over_roofline"),
                "max_abs_err_vs_dequant": m.get("max_abs_err_vs_dequant"),
            }
            for mode, m in (r.get("by_compressed_gemm") or {}).items()
        }
        if not modes:  # one mode: the row's own, eager
            modes[str(r.get("compressed_gemm"))] = {
                "us": r.get("offloaded_all_hit_us"),
                "over_roofline": r.get("offloaded_over_roofline"),
                "max_abs_err_vs_dequant": None,
            }
        graph = (r.get("by_resident_graphs") or {}).get("on")
        if graph is not None:
            modes["graph"] = {
                "us": graph.get("offloaded_all_hit_us"),
                "over_roofline": graph.get("offloaded_over_roofline"),
                "execution": graph.get("resident_execution"),
                "reason": graph.get("resident_execution_reason"),
            }
        points.append(
            {
                "layer": r.get("layer"),
                "tokens": r.get("tokens"),
                "hbm_roofline_us": r.get("hbm_roofline_us"),
                "modes": modes,
                "not_measured": r.get("by_compressed_gemm_not_measured"),
            }
        )
        line = " | ".join(
            f"{mode} {m['us']:.1f} us"
            + (f" ({m['over_roofline']:.2f}x)" if isinstance(m["over_roofline"], float) else "")
            for mode, m in modes.items()
            if isinstance(m["us"], float)
        )
        print(
            f"{step}: L{r.get('layer')} t={r.get('tokens')} roof {r.get('hbm_roofline_us')} | {line}"
        )
        if r.get("by_compressed_gemm_not_measured"):
            print(f"    not measured: {r['by_compressed_gemm_not_measured']}")
    return {
        "preset": row.get("preset"),
        "compressed_gemm_reason": row.get("compressed_gemm_reason"),
        "points": points,
    }


if __name__ == "__main__":
    moe_summary.main(summarise)
