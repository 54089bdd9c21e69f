"""CPU A/B of route-ahead's replayed approximate router (thirty-eighth
session): a trace of a CPU-trained ``cpu-tiny`` proxy (its routing,
acceptance, gate lookahead and approximate router all **learned**) replayed
on the ``tiny-qwen3_moe`` shape (2 layers, 8 experts top-2, **synthetic**
weights; the trace's 4 layers of 16 experts top-4 mapped onto it), cache
0.25, c=1 closed loop of 4 requests, ``fixed:1`` width, link emulated at
LINK_GBPS (default 0.5; at 0.01 an expert's 15 KB copy takes ~1.5 ms). Arms interleaved and rotated per repeat. Run from the repository
root, with the trace written by ``pdflash-bench proxy trace`` (README):

    python3 bench/results/cpu/approx-replay-2026-12-05/approx_ab.py TRACE REPEATS OUT.jsonl [LINK_GBPS]

Arms: B1; PD with the trace's approximate router (``route_ahead_approx_source``
``trace``); PDrouter, the same trace with the approximate-router arrays
removed (the union's router pass predicts the synthetic router, as every
replay did before); PDembed, PD with ``route_ahead_proxy=embed`` (the
trace's router over its tokens' embeddings); PD-all-on on the first two.
"""

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pdflash.bench.engine_run import RunSpec, run_spec

from pdflash import traces as tf

trace, reps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
link_gbps = float(sys.argv[4]) if len(sys.argv) > 4 else 0.5
t = tf.load_trace(trace)
assert t.has_approx, "the trace must record the approximate router"
for name in tf.APPROX_ARRAYS:
    setattr(t, name, None)
plain = str(tf.save_trace(t, Path(tempfile.mkdtemp()) / "trace_no_approx.npz"))
arms: dict[str, dict[str, Any]] = {
    "B1": dict(baseline="B1"),
    "PD": dict(baseline="PD"),
    "PDrouter": dict(baseline="PD", trace=plain),
    "PDembed": dict(baseline="PD", route_ahead_proxy="embed"),
    "PDallon": dict(baseline="PD-all-on"),
    "PDallonrouter": dict(baseline="PD-all-on", trace=plain),
}
base: dict[str, Any] = dict(
    arch="tiny-qwen3_moe",
    device="cpu",
    cache_fraction=0.25,
    concurrency=1,
    arrivals="closed",
    users=1,
    num_requests=4,
    prompt_len=32,
    max_new_tokens=24,
    block_size=int(t.provenance["block_size"]),
    routing_source="trace",
    acceptance="trace",
    trace=trace,
    emulated_link_gbps=link_gbps,
    verify_width="fixed:1",
)
keys = (
    "output_tokens_per_s",
    "bytes_per_token",
    "exposed_fetch_s",
    "exposed_fetch_miss_s",
    "link_busy_s",
    "expert_cache_hit_rate",
    "route_ahead_approx_source",
    "route_ahead_proxy",
    "routeahead_coverage",
    "routeahead_precision",
    "route_ahead_bytes_submitted",
    "wasted_prefetch_bytes",
    "predict_s",
    "wall_s",
    "pd_parts",
)
with open(out, "a") as f:
    names = list(arms)
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            t0 = time.time()
            row = run_spec(RunSpec(**{**base, **arms[name]}, repeat=rep)).row
            rec = {"arm": name, "repeat": rep, "run_s": time.time() - t0}
            f.write(json.dumps({**rec, **{k: row.get(k) for k in keys}}, default=str) + "\n")
            f.flush()
