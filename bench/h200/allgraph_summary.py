"""Summarise ``pdflash-bench moe --resident-graphs both`` all-hit rows from
run.sh's results.jsonl: per arch, layer and token count, the eager block
(main fields) and the recorded one (``by_resident_graphs.on``) side by side,
each back-to-back, host-issue and device-only µs, over plain grouped_mm and
the HBM roofline, and whether the recorded block gave the eager block's bits.

    python3 bench/h200/allgraph_summary.py OUT/results.jsonl [--out summary.json]

Printed table columns: tok (tokens), eager/graph ``us`` (back-to-back CUDA
events per call), ``host`` (host issue µs per call), ``dev`` (device-only µs
per call), gmm (plain grouped_mm back-to-back µs), roof (HBM roofline µs),
x_gmm / x_roof (graph back-to-back over grouped_mm / over the roofline;
targets <= 1.25 and <= 2), ran (how the recorded side ran: graph, or eager
with the reason) and bits (its output equal to the eager block's).
"""

from __future__ import annotations

from typing import Any

import moe_summary  # type: ignore[import-not-found]  # bench/h200/, next to this script


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _fmt(v: Any) -> str:
    x = _num(v)
    if x is None:
        return "-" if v is None else str(v)
    return f"{x:.3g}" if abs(x) < 10 else f"{x:.0f}"


def side(r: dict[str, Any], g: dict[str, Any] | None) -> dict[str, Any]:
    """One all-hit row's eager and recorded sides, flattened."""
    g = g or {}
    roof = _num(r.get("hbm_roofline_us"))
    gmm = _num(r.get("grouped_mm_active_us"))
    out: dict[str, Any] = {
        "layer": r.get("layer"),
        "tokens": r.get("tokens"),
        "active_experts": r.get("active_experts"),
        "grouped_mm_us": gmm,
        "grouped_mm_host_us": r.get("grouped_mm_active_host_us"),
        "grouped_mm_device_us": r.get("grouped_mm_active_device_us"),
        "hbm_roofline_us": roof,
    }
    for name, src, pre in (("eager", r, "offloaded_all_hit"), ("graph", g, "offloaded_all_hit")):
        us = _num(src.get(f"{pre}_us"))
        dev = _num(src.get(f"{pre}_device_us"))
        out[name] = {
            "us": us,
            "host_us": src.get(f"{pre}_host_us"),
            "device_us": dev,
            "over_grouped_mm": us / gmm if us and gmm else None,
            "over_roofline": us / roof if us and roof else None,
            "device_over_roofline": dev / roof if dev and roof else None,
            "dispatches": (src.get(f"{pre}_dispatches") or {}).get("all"),
            "syncs": src.get(f"{pre}_syncs"),
            "resident_execution": src.get("resident_execution"),
            "resident_execution_reason": src.get("resident_execution_reason"),
        }
    out["graph"]["bit_equal_vs_eager"] = g.get("bit_equal_vs_main")
    out["graph"]["meets_1p25x_grouped_mm"] = g.get("meets_1p25x_grouped_mm")
    out["graph"]["meets_2x_roofline"] = g.get("meets_2x_roofline")
    return out


def summarise(step: str, row: dict[str, Any]) -> dict[str, Any]:
    """One step's moe row: each all-hit point's two sides (:func:`side`),
    printed as the table of the module docstring too."""
    rows = [
        side(r, (r.get("by_resident_graphs") or {}).get("on"))
        for r in row.get("all_hit", [])
        if "layer" in r
    ]
    summary = {
        "arch": row.get("arch"),
        "preset": row.get("preset"),
        "expert_format": row.get("expert_format"),
        "compressed_gemm": row.get("compressed_gemm"),
        "resident_graph_stats": row.get("resident_graph_stats"),
        "rows": rows,
    }
    print(f"== {step}: {row.get('preset')} {row.get('expert_format')}")
    print(f"   stats {row.get('resident_graph_stats')}")
    print(
        "   L tok | eager us host dev | graph us host dev | gmm roof | "
        "x_gmm x_roof dev/roof | ran bits"
    )
    for s in rows:
        e, g = s["eager"], s["graph"]
        ran = g["resident_execution"]
        if ran != "graph":
            ran = f"{ran}:{g['resident_execution_reason']}"
        print(
            "   "
            + " ".join(
                _fmt(v)
                for v in (
                    s["layer"],
                    s["tokens"],
                    "|",
                    e["us"],
                    e["host_us"],
                    e["device_us"],
                    "|",
                    g["us"],
                    g["host_us"],
                    g["device_us"],
                    "|",
                    s["grouped_mm_us"],
                    s["hbm_roofline_us"],
                    "|",
                    g["over_grouped_mm"],
                    g["over_roofline"],
                    g["device_over_roofline"],
                    "|",
                    ran,
                    g["bit_equal_vs_eager"],
                )
            )
        )
    return summary


if __name__ == "__main__":
    moe_summary.main(summarise)
