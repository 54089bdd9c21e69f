"""One run_spec in a fresh process; prints the row's setup_s as one JSON line.

usage: python setup_cost.py ARCH BASELINE LAYERS [DTYPE]
"""

from __future__ import annotations

import json
import os
import sys
import time

t_start = time.perf_counter()
from pdflash.bench.engine_run import RunSpec, run_spec  # noqa: E402

arch, baseline, layers = sys.argv[1], sys.argv[2], int(sys.argv[3])
dtype = sys.argv[4] if len(sys.argv) > 4 else "bfloat16"
spec = RunSpec(
    arch=arch,
    baseline=baseline,
    layers=layers,
    dtype=dtype,
    device="cpu",
    concurrency=2,
    prompt_len=16,
    max_new_tokens=8,
    acceptance="forced",
)
import_s = time.perf_counter() - t_start
t0 = time.perf_counter()
row = run_spec(spec).row
print(
    json.dumps(
        {
            "arch": arch,
            "baseline": baseline,
            "layers": layers,
            "import_s": import_s,
            "run_spec_s": time.perf_counter() - t0,
            "setup_s": row["setup_s"],
            "host_weights": (row.get("host_service") or {}).get("host_weights"),
            "cache": os.environ.get("PDFLASH_CACHE"),
        }
    )
)
