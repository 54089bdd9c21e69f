"""Host µs and torch calls of one route-ahead step
(``ApproxRouterPredictor`` through ``predict_batch``) on a synthetic tiny
target (CPU, float32, 1 thread): median of ``REPS`` steps after a warm-up.

    python3 -P lookahead_routeahead_step.py ARCH LAYERS BLOCKS PROXY REPS
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from pdflash.bench.op_count import DispatchCounter

from pdflash.models import load_adapter, write_synthetic_checkpoint
from pdflash.protocols import DraftedBlock
from pdflash.routeahead import ApproxRouterPredictor, predict_batch

arch, layers, count, proxy, reps = (
    sys.argv[1],
    int(sys.argv[2]),
    int(sys.argv[3]),
    sys.argv[4],
    int(sys.argv[5]),
)
torch.set_num_threads(1)
key = "num_experts" if arch == "qwen3_moe" else "num_local_experts"
with tempfile.TemporaryDirectory() as tmp:
    path = write_synthetic_checkpoint(
        Path(tmp) / arch,
        arch,
        "tiny",
        num_layers=layers,
        dtype=torch.float32,
        seed=3,
        config_overrides={key: 32, "num_experts_per_tok": 4},
    )
    adapter = load_adapter(path, dtype=torch.float32)
    predictor = ApproxRouterPredictor(adapter, proxy=proxy)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(0)
    blocks = [
        DraftedBlock(i, torch.randint(3, 128, (16,), generator=gen), torch.arange(16))
        for i in range(count)
    ]
    for _ in range(5):
        predict_batch(predictor, blocks)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        predict_batch(predictor, blocks)
        times.append(time.perf_counter() - t0)
    counter = DispatchCounter()
    with counter:
        predict_batch(predictor, blocks)
print(
    json.dumps(
        {
            "what": "one route-ahead step (ApproxRouterPredictor), synthetic tiny target, CPU",
            "arch": arch,
            "layers": layers,
            "blocks": count,
            "proxy": proxy,
            "step_us": 1e6 * statistics.median(times),
            "torch_calls": sum(counter.ops.values()),
        }
    )
)
