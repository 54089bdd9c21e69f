"""``HostExpertService.split`` per call, the service switched on (it plans
and hosts nothing) vs off, on the tests' fake cache (numpy only). Run from
the repository root: ``python -P bench/results/cpu/hostidle-2026-12-02/split_timeit.py``."""

import sys
import timeit

import numpy as np

sys.path.insert(0, "tests")
from hybrid.test_host_idle import _Cache, _service

from pdflash.hybrid import CostModelPlanner, ForcedHostPlanner, HostCostModel

ids = np.array([8, 9, 12, 13], dtype=np.int64)
tok = np.array([4, 4, 4, 4], dtype=np.int64)
for name, planner in (
    ("forced", ForcedHostPlanner(every=None, ids=())),
    ("makespan", CostModelPlanner(HostCostModel(1e-3, 0.0), 1024)),
    ("queue", CostModelPlanner(HostCostModel(1e-3, 0.0), 1024, rule="queue")),
):
    svc = _service(planner)
    cache = _Cache(32, [0, 1, 9])
    for enabled in (True, False):
        svc.enabled = enabled
        n = 20000
        t = min(
            timeit.repeat(
                lambda svc=svc, cache=cache: svc.split(1, ids, tok, cache, routed=(0.0, 1e-6)),
                number=n,
                repeat=5,
            )
        )
        print(f"{name:9s} enabled={enabled!s:5s} split {t / n * 1e6:.1f} us/call")
