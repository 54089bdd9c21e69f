"""One PD+host run with ``--host-plan lag`` on CPU (small gpt_oss shape,
cache 0.2, c=4, emulated link): prints every lag sample's inputs, the layer's
routed copies in flight at its routing read and the copies the last ahead
plan left it (ms of link time), to see what the rule measures.

    python -P bench/results/cpu/hostshare-2026-12-02/lag_samples.py [LINK_GBPS]
"""

from __future__ import annotations

import math
import sys

import torch
from pdflash.bench.engine_run import RunSpec, run_spec

from pdflash.hybrid import planner as planner_module
from pdflash.hybrid.planner import CostModelPlanner, LinkState

samples: list[tuple[int, float, float]] = []
_sample = CostModelPlanner._sample_lag


def _logged(self: CostModelPlanner, layer: int, link: LinkState) -> None:
    planned = self._ahead_copy_s
    if planned is not None and 0 <= layer < planned.size and not math.isnan(planned[layer]):
        in_flight_ms = link.ahead_bytes / link.bytes_per_s * 1e3
        samples.append((layer, in_flight_ms, float(planned[layer]) * 1e3))
    _sample(self, layer, link)


planner_module.CostModelPlanner._sample_lag = _logged  # type: ignore[method-assign]
torch.set_num_threads(1)
gbps = float(sys.argv[1]) if len(sys.argv) > 1 else 0.5
spec = RunSpec(
    arch="small-gpt_oss",
    baseline="PD+host",
    concurrency=4,
    cache_fraction=0.2,
    prompt_len=16,
    max_new_tokens=24,
    emulated_link_gbps=gbps,
    host_threads=1,
    host_workers=1,
    host_plan="lag",
)
row = run_spec(spec).row
print(f"tokens/s {row['output_tokens_per_s']:.2f}, link {row['link_gbps_measured']:.3f} GB/s")
print(
    "lags at the end (ms):",
    [round(x * 1e3, 2) for x in row["host_service"]["planner"]["link_lag_s"]],
)
for layer, in_flight, planned in samples:
    print(f"layer {layer} in flight {in_flight:6.2f} ms, plan's copies {planned:6.2f} ms")
