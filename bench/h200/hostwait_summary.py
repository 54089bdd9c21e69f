"""One JSON line comparing the eager_host steps of hostwait_check.sh: per
step the hand-off that ran (and why, where it fell back), the forward's
thread time, the forward to the device's end, the thread's wait for the host
per hosting layer, and the parts that launch the next layer (attention,
router, readback: the routing read, where a stream-waiting thread now waits).
Usage: python3 bench/h200/hostwait_summary.py results.jsonl"""

from __future__ import annotations

import json
import sys
from typing import Any

from pdflash.report.writers import read_jsonl


def main(path: str) -> int:
    steps: dict[str, Any] = {}
    for rec in read_jsonl(path):
        res = rec.get("result")
        if not rec["step"].startswith("big_") or not isinstance(res, dict):
            continue
        host = res.get("host") or {}
        handoff = host.get("handoff") or {}
        parts = res.get("parts_us") or {}
        steps[rec["step"]] = {
            "rc": rec["rc"],
            "handoff_mode": handoff.get("mode"),
            "handoff_reason": handoff.get("reason"),
            "forward_us": res.get("forward_us"),
            "forward_synced_us": res.get("forward_synced_us"),
            "wait_us_per_hosting_layer": host.get("wait_us_per_hosting_layer"),
            "hosting_layers_per_step": host.get("hosting_layers_per_step"),
            "host_write_us_per_hosting_layer": (host.get("pieces_us_per_hosting_layer") or {}).get(
                "host_write"
            ),
            "attention_us": parts.get("attention"),
            "router_us": parts.get("router"),
            "readback_us": parts.get("readback"),
        }
    verdict: dict[str, Any] = {}
    for suffix in ("", "4"):
        t, s = steps.get(f"big_thread{suffix}"), steps.get(f"big_stream{suffix}")
        if not t or not s or not t["forward_synced_us"] or not s["forward_synced_us"]:
            continue
        verdict[f"stream_over_thread{suffix}"] = {
            "forward_synced": s["forward_synced_us"] / t["forward_synced_us"],
            "stream_ran": s["handoff_mode"] == "stream",
        }
    print(json.dumps({"steps": steps, "verdict": verdict}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
