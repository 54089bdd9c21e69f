"""CPU A/B on the replayed learned trace of ../../h200/proxy-lookahead-2026-12-05/
(small-qwen3_moe, 4 MoE layers, synthetic fp32 weights, cache 0.2, c=1 closed
loop of 4 requests, fixed:1 width, link emulated at 0.5 GB/s), arms
interleaved and rotated per repeat. Run from the repository root:

    python3 bench/results/cpu/lookahead-replay-2026-12-05/ab.py score REPEATS OUT.jsonl
    python3 bench/results/cpu/lookahead-replay-2026-12-05/ab.py source REPEATS OUT.jsonl
    python3 bench/results/cpu/lookahead-replay-2026-12-05/ab.py every REPEATS OUT.jsonl
    python3 bench/results/cpu/lookahead-replay-2026-12-05/ab.py parts REPEATS OUT.jsonl
    python3 bench/results/cpu/lookahead-replay-2026-12-05/ab.py prev REPEATS OUT.jsonl

``score``: B1, PD (lookahead_score prob), PDshare (share); ``source``: B1 and
PD replaying the trace's recorded lookahead, and B1router / PDrouter on the
same trace with the lookahead arrays removed (the synthetic router predicts);
``every`` (thirty-seventh session): B1, PD and PDevery (lookahead_score every);
``parts`` (same session): B1, PD (its parts controller), PD-all-on (the stream
always on) and PD-no-stream (route-ahead's one batch + the plain lookahead);
``prev`` (same session): B1, PD and PD-all-on, each PD label also with
route_ahead_source previous_round (no router pass: under a replay the union's
approximate router is the synthetic one); ``tail`` (thirty-eighth session):
B1, PD, PD and PD-all-on with lookahead_tail background, PD with
lookahead_score every, PD-all-on; ``tailfast``: the same arms on a 2 GB/s
emulated link (more of the link idle).
"""

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pdflash.bench.engine_run import RunSpec, run_spec

from pdflash import traces as tf

TRACE = "bench/results/h200/proxy-lookahead-2026-12-05/trace_gpu_t1.npz"


def without_lookahead() -> str:
    t = tf.load_trace(TRACE)
    for name in tf.LOOKAHEAD_ARRAYS:
        setattr(t, name, None)
    return str(tf.save_trace(t, Path(tempfile.mkdtemp()) / "trace_no_lookahead.npz"))


mode, reps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
arms: dict[str, dict[str, Any]]
if mode == "score":
    arms = {
        "B1": dict(baseline="B1"),
        "PD": dict(baseline="PD"),
        "PDshare": dict(baseline="PD", lookahead_score="share"),
    }
elif mode == "every":
    arms = {
        "B1": dict(baseline="B1"),
        "PD": dict(baseline="PD"),
        "PDevery": dict(baseline="PD", lookahead_score="every"),
    }
elif mode == "parts":
    arms = {
        "B1": dict(baseline="B1"),
        "PD": dict(baseline="PD"),
        "PDallon": dict(baseline="PD-all-on"),
        "PDnostream": dict(baseline="PD-no-stream"),
    }
elif mode in ("tail", "tailfast"):
    arms = {
        "B1": dict(baseline="B1"),
        "PD": dict(baseline="PD"),
        "PDtail": dict(baseline="PD", lookahead_tail="background"),
        "PDevery": dict(baseline="PD", lookahead_score="every"),
        "PDallon": dict(baseline="PD-all-on"),
        "PDallontail": dict(baseline="PD-all-on", lookahead_tail="background"),
    }
elif mode == "prev":
    arms = {
        "B1": dict(baseline="B1"),
        "PD": dict(baseline="PD"),
        "PDprev": dict(baseline="PD", route_ahead_source="previous_round"),
        "PDallon": dict(baseline="PD-all-on"),
        "PDallonprev": dict(baseline="PD-all-on", route_ahead_source="previous_round"),
    }
else:
    plain = without_lookahead()
    arms = {
        "B1router": dict(baseline="B1", trace=plain),
        "PDrouter": dict(baseline="PD", trace=plain),
        "B1": dict(baseline="B1"),
        "PD": dict(baseline="PD"),
    }
base: dict[str, Any] = dict(
    arch="small-qwen3_moe",
    layers=4,
    device="cpu",
    cache_fraction=0.2,
    concurrency=1,
    arrivals="closed",
    users=1,
    num_requests=4,
    prompt_len=32,
    max_new_tokens=24,
    block_size=16,
    routing_source="trace",
    acceptance="trace",
    trace=TRACE,
    emulated_link_gbps=2.0 if mode == "tailfast" else 0.5,
    verify_width="fixed:1",
)
keys = (
    "output_tokens_per_s",
    "bytes_per_token",
    "exposed_fetch_s",
    "exposed_fetch_miss_s",
    "link_busy_s",
    "expert_cache_hit_rate",
    "lookahead_source",
    "lookahead_score",
    "lookahead_tail",
    "stream_tail",
    "background_bytes_submitted",
    "route_ahead_bytes_submitted",
    "wasted_prefetch_bytes",
    "wall_s",
)
with open(out, "a") as f:
    names = list(arms)
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            t0 = time.time()
            row = run_spec(RunSpec(**{**base, **arms[name]}, repeat=rep)).row
            rec = {"arm": name, "repeat": rep, "run_s": time.time() - t0}
            f.write(json.dumps({**rec, **{k: row.get(k) for k in keys}}) + "\n")
            f.flush()
