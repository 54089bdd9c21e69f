"""Host time of the adaptive width policy's ``widths()`` and ``observe()``
per call: an earlier ``verify_width.py`` (loaded from the file given) against
the installed one (with ``voi`` and with ``voi=0``), 2 layers of 16 top-4
experts, a synthetic step (geometric acceptance 0.3, fixed timings), the
median of 5 runs of 200 steps after 50. From the repository root:

    git show 8c77b7f:pdflash/engine/verify_width.py > /tmp/verify_width_before.py
    python3 -P bench/results/cpu/default-ab-2026-12-05/width_host.py /tmp/verify_width_before.py
"""

import importlib.util
import sys
import time
from types import ModuleType
from typing import Any

import numpy as np

import pdflash.engine.verify_width as new


def load(path: str, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def drive(m: Any, steps: int, c: int, seed: int, **kw: Any) -> tuple[float, float]:
    """Mean µs of ``widths()`` and of ``observe()`` over the steps after 50."""
    rng = np.random.default_rng(seed)
    p = m.AdaptiveWidth(
        block_size=16, num_layers=2, num_experts=16, top_k=4, expert_bytes=6144, **kw
    )
    t_w = t_o = 0.0
    for s in range(steps):
        reqs = [m.WidthRequest(i, 15) for i in range(c)]
        t = time.perf_counter()
        ks = p.widths(reqs)
        dt = time.perf_counter() - t
        outs = tuple(
            m.WidthOutcome(i, k, int(min(k, rng.geometric(0.3) - 1)), 4 * (k + 1))
            for i, k in enumerate(ks)
        )
        st = m.WidthStep(
            outs,
            wall_s=0.01 + 0.0003 * sum(ks),
            union_experts=int(2 * min(16, 4 + sum(ks))),
            copied_bytes=6144 * 10,
            link_bytes_per_s=1e7,
            verify_compute_s=0.006,
            exposed_fetch_s=0.003,
        )
        t = time.perf_counter()
        p.observe(st)
        do = time.perf_counter() - t
        if s >= 50:
            t_w += dt
            t_o += do
    return t_w / (steps - 50) * 1e6, t_o / (steps - 50) * 1e6


old = load(sys.argv[1], "vw_before")
for c in (1, 4):
    res: dict[str, list[tuple[float, float]]] = {"before": [], "new": [], "new_voi0": []}
    for rep in range(5):
        for name, m, kw in (
            ("before", old, {}),
            ("new", new, {}),
            ("new_voi0", new, {"explore_voi": False}),
        ):
            res[name].append(drive(m, 250, c, rep, **kw))
    for name, v in res.items():
        a = np.array(v)
        print(
            f"c={c} {name:9s} widths {np.median(a[:, 0]):6.1f} us  observe "
            f"{np.median(a[:, 1]):6.1f} us  (median of 5 runs of 200 steps)"
        )
