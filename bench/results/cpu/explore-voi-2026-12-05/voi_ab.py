"""CPU A/B of the adaptive width's value-of-information exploration rule
(``adaptive:voi``, fortieth session) on the replayed learned trace of
../../h100/session39-2026-12-05/proxy-approx/ (routing, acceptance, gate
lookahead and route-ahead's approximate router all **learned**, replayed on
small-qwen3_moe, 4 MoE layers, **synthetic** fp32 weights), cache 0.2,
closed loop of 4 requests a client, 24 new tokens, link emulated at
LINK_GBPS (default 0.5); arms interleaved and rotated per repeat. Run from
the repository root:

    python3 bench/results/cpu/explore-voi-2026-12-05/voi_ab.py CONCURRENCY REPEATS OUT.jsonl [LINK_GBPS]

Arms: B1f1 (B1 at one draft, ``fixed:1``); PD (its preset: ``adaptive``,
``voi=1``); PDvoi0 (``adaptive:voi=0``: every due exploration runs, the rule
before); PDx0 (``adaptive:explore=0``: never explores).
"""

import json
import sys
import time
from typing import Any

from pdflash.bench.engine_run import RunSpec, run_spec

TRACE = "bench/results/h100/session39-2026-12-05/proxy-approx/trace_gpu_t1.npz"
conc, reps, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
link_gbps = float(sys.argv[4]) if len(sys.argv) > 4 else 0.5
arms: dict[str, dict[str, Any]] = {
    "B1f1": dict(baseline="B1", verify_width="fixed:1"),
    "PD": dict(baseline="PD"),
    "PDvoi0": dict(baseline="PD", verify_width="adaptive:voi=0"),
    "PDx0": dict(baseline="PD", verify_width="adaptive:explore=0"),
}
base: dict[str, Any] = dict(
    arch="small-qwen3_moe",
    layers=4,
    device="cpu",
    cache_fraction=0.2,
    concurrency=conc,
    arrivals="closed",
    users=conc,
    num_requests=4 * conc,
    prompt_len=32,
    max_new_tokens=24,
    block_size=16,
    routing_source="trace",
    acceptance="trace",
    trace=TRACE,
    emulated_link_gbps=link_gbps,
)
keys = (
    "output_tokens_per_s",
    "bytes_per_token",
    "exposed_fetch_s",
    "exposed_fetch_miss_s",
    "link_busy_s",
    "h2d_bytes",
    "steps",
    "wall_s",
    "route_ahead_gate",
    "routeahead_batch_precision",
    "verify_width",
    "pd_parts",
)
with open(out, "a") as f:
    names = list(arms)
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            t0 = time.time()
            row = run_spec(RunSpec(**{**base, **arms[name]}, repeat=rep)).row
            rec = {"arm": name, "repeat": rep, "concurrency": conc, "run_s": time.time() - t0}
            f.write(json.dumps({**rec, **{k: row.get(k) for k in keys}}) + "\n")
            f.flush()
