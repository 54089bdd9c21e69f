"""Interleaved repeats of the bare ``pdflash-bench`` default's B1, B2 and PD
runs at one concurrency (the default suite's own specs: tiny synthetic
model, forced acceptance, cache 0.25, the host copy backend at its emulated
10 MB/s link); arms rotated per repeat. Run from anywhere with pdflash
installed:

    python3 default_ab.py CONCURRENCY REPEATS OUT.jsonl
"""

import argparse
import json
import sys
import time

from pdflash.bench.engine_run import RunSpec, run_spec
from pdflash.bench.suites import default

conc, reps, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
args = argparse.Namespace(
    quick=False,
    concurrency=[conc],
    cache_fraction=[0.25],
    device="cpu",
    emulated_link_gbps=None,
    marginal_rule="verify",
)
arms = {
    s["baseline"]: s
    for s in default.default_specs(args, on_gpu=False)
    if s["baseline"] in ("B1", "B2", "PD")
}
keys = (
    "output_tokens_per_s",
    "bytes_per_token",
    "exposed_fetch_s",
    "link_busy_s",
    "compute_busy_s",
    "wall_s",
    "steps",
    "acceptance_length_mean",
    "predict_s",
    "draft_s",
    "verify_s",
    "scheduler_us_per_step",
    "pd_parts",
    "verify_width",
    "token_only_differing_step_fraction",
    "h2d_bytes",
    "route_ahead_gate",
)
names = list(arms)
with open(out, "a") as f:
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            t0 = time.time()
            row = run_spec(RunSpec(**{**arms[name], "repeat": rep})).row
            rec = {"arm": name, "repeat": rep, "concurrency": conc, "run_s": time.time() - t0}
            f.write(json.dumps({**rec, **{k: row.get(k) for k in keys}}) + "\n")
            f.flush()
