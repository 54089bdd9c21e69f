"""CPU A/B of the adaptive width's cost gate (``adaptive:cost``) where the
width pays: the replayed learned trace of
bench/results/h100/session39-2026-12-05/proxy-approx/ on small-qwen3_moe (4
MoE layers, **synthetic** fp32 weights), cache 0.2, closed loop of 4
requests a client, 24 new tokens, link **emulated** at 0.5 GB/s (the
fortieth session's setting, ../../explore-voi-2026-12-05/); arms interleaved
and rotated per repeat. Run from the repository root:

    python3 bench/results/cpu/width-cost-2026-12-06/replay/replay_ab.py CONCURRENCY REPEATS OUT.jsonl

Arms: B1f1 (B1 at ``fixed:1``); PD (its preset: ``adaptive``, now
``cost=1``); PDwcost0 (``adaptive:cost=0``: the width never stands down).
"""

import json
import sys
from typing import Any

from pdflash.bench.engine_run import RunSpec, run_spec

TRACE = "bench/results/h100/session39-2026-12-05/proxy-approx/trace_gpu_t1.npz"
conc, reps, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
arms: dict[str, dict[str, Any]] = {
    "B1f1": {"baseline": "B1", "verify_width": "fixed:1"},
    "PD": {"baseline": "PD"},
    "PDwcost0": {"baseline": "PD", "verify_width": "adaptive:cost=0"},
}
base: dict[str, Any] = {
    "arch": "small-qwen3_moe",
    "layers": 4,
    "device": "cpu",
    "cache_fraction": 0.2,
    "concurrency": conc,
    "arrivals": "closed",
    "users": conc,
    "num_requests": 4 * conc,
    "prompt_len": 32,
    "max_new_tokens": 24,
    "block_size": 16,
    "routing_source": "trace",
    "acceptance": "trace",
    "trace": TRACE,
    "emulated_link_gbps": 0.5,
}
names = list(arms)
with open(out, "a") as f:
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            row = run_spec(RunSpec(**{**base, **arms[name]}, repeat=rep)).row
            row["arm"] = name
            f.write(json.dumps(row, default=str) + "\n")
            f.flush()
            gate = (row.get("verify_width") or {}).get("cost_gate") or {}
            print(
                f"rep {rep} c={conc} {name}: {row['output_tokens_per_s']:.2f} tok/s, "
                f"width stood down: {gate.get('standing_down')}, switches {gate.get('switch_count')}",
                flush=True,
            )
