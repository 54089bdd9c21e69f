"""The bare ``pdflash-bench`` default workload with more labels and repeats
(relative CPU figures only).

Same specs as ``pdflash-bench`` with no arguments on the CPU (tiny synthetic
model, forced acceptance, 0.01 GB/s emulated link, cache 0.25, c = 1 and 4,
``2c`` live requests, M from the verify's compute), but with the labels and
repeats given, interleaved round-robin by ``matrix.plan``. Usage (from the
repository root, the package installed):

    python bench/results/cpu/controller-2026-12-01/run_default.py OUT \
        [--baselines B1,B2,PD,PD-full-width] [--repeats 3] [--concurrency 1,4]
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> int:
    from pdflash.bench.suites import default, matrix

    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--baselines", default="B1,B2,PD,PD-full-width")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", default="1,4")
    args = ap.parse_args()
    ns = argparse.Namespace(
        arch=["tiny"],
        weights="synthetic",
        draft="synthetic",
        seed=0,
        slo=2.0,
        layers=None,
        num_requests=None,
        prompt_len=32,
        max_new_tokens=96,
        device="cpu",
        emulated_link_gbps=default.CPU_EMULATED_LINK_GBPS,
        acceptance="auto",
        mean_tau=None,
        eviction="auto",
        block_sizes=[16],
        concurrency=[int(c) for c in args.concurrency.split(",")],
        cache_fraction=[0.25],
        baselines=args.baselines.split(","),
        repeats=args.repeats,
    )
    specs = matrix.plan(ns)
    for spec in specs:
        conc = spec["concurrency"]
        spec["num_requests"] = conc * 4
        spec["max_running"] = default.LIVE_PER_CONCURRENCY * conc
        spec["byte_budget_from"] = "verify"
    matrix.run_matrix(specs, args.out, show_progress=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
