"""Medians over runs of each side's parts_us and torch_calls_per_step."""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict

PARTS = (
    "router",
    "books",
    "stream_routed",
    "lookahead_router",
    "lookahead",
    "attention",
    "gemm",
    "moe_rest",
)
for path in sys.argv[1:]:
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    us: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    calls: dict[str, dict[str, float]] = {}
    for r in rows:
        res = r["result"]
        for p in PARTS:
            us[r["side"]][p].append(res["parts_us"].get(p, 0.0))
        us[r["side"]]["forward"].append(res["forward_us"])
        if res.get("stream_plan_us") is not None:
            us[r["side"]]["stream_plan"].append(res["stream_plan_us"])
        calls[r["side"]] = res["torch_calls_per_step"]
    layers = rows[0]["result"]["layers"]
    print(f"## {path} ({len(rows) // 2} runs per side, {layers} layers)")
    print("| part | before us | after us | after/before | before calls | after calls |")
    print("|---|---|---|---|---|---|")
    for p in (*PARTS, "forward", "stream_plan"):
        if not us["before"][p]:
            continue
        b, a = statistics.median(us["before"][p]), statistics.median(us["after"][p])
        cb = calls["before"].get(p, calls["before"]["total"] if p == "forward" else "")
        ca = calls["after"].get(p, calls["after"]["total"] if p == "forward" else "")
        ratio = f"{a / b:.2f}" if b else "-"
        print(f"| {p} | {b:.0f} | {a:.0f} | {ratio} | {cb} | {ca} |")
