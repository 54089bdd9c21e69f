"""Per-step books of PD's verify scheduler on the bare ``pdflash-bench``
default workload (relative CPU figures only).

Runs the default's specs (tiny synthetic model, forced acceptance, 0.01 GB/s
emulated link, cache 0.25, ``2c`` live requests, M from the verify's
compute) for the labels given, interleaved round-robin by ``matrix.plan``,
and records every measured engine step into ``steps.jsonl`` beside the
matrix's ``rows.jsonl``: wall, tokens verified / committed / expected to be
committed (a survival estimate of the step's own, learned from the run's
verify outcomes as the PD controller's is), requests waiting and served,
and, for every batcher call, each scheduler's choice (requests, tokens
granted, drafts trimmed, predicted-missing bytes) and its host microseconds
(the 2-D scheduler and its token-only shadow timed apart). Usage (from the
repository root, the package installed):

    python bench/results/cpu/schedprobe-2026-12-01/sched_steps_probe.py OUT \
        [--baselines PD,PD-all-on,PD-token-sched] [--repeats 3] [--concurrency 1,4] \
        [--verify-width auto] [--byte-budget BYTES] [--rate-of verified] \
        [--marginal-rule verify|off]

(``--marginal-rule``, added for ../marginal-2026-12-02: ``off`` runs the
2-D scheduler with M hard, as when this folder's rows were recorded;
``verify`` with the marginal rule; left out, RunSpec's default.)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

_STEPS: list[dict[str, Any]] = []
_SELECTS: list[dict[str, Any]] = []
_RUN: dict[str, Any] = {"label": None, "measured": False}


def _choice(decision: Any, demands: Any, nbytes: int) -> dict[str, Any]:
    asked = {d.request_id: d.tokens for d in demands}
    grants = decision.grants
    return {
        "served": len(grants),
        "tokens": int(sum(g for _, g in grants)),
        "trimmed": int(sum(1 for rid, g in grants if g < asked.get(rid, g))),
        "trimmed_tokens": int(sum(asked.get(rid, g) - g for rid, g in grants)),
        "missing_bytes": len(decision.missing) * nbytes,
    }


def _install() -> None:
    from pdflash.engine import batching
    from pdflash.engine.engine import Engine
    from pdflash.engine.pd_controller import expected_committed
    from pdflash.engine.verify_width import SurvivalEstimator

    plain_select = batching.DeficitBatcher.select

    def timed_select(self: Any, demands: Any, resident: Any) -> Any:
        t0 = time.perf_counter()
        decision = plain_select(self, demands, resident)
        us = (time.perf_counter() - t0) * 1e6
        _SELECTS.append(
            {
                "batcher": self.name,
                "us": us,
                "waiting": len(demands),
                "asked_tokens": int(sum(d.tokens for d in demands)),
                **_choice(decision, demands, int(self._shape[3])),
            }
        )
        return decision

    batching.DeficitBatcher.select = timed_select  # type: ignore[method-assign]

    plain_step = Engine._step
    plain_reset = Engine.reset_stats

    def reset(self: Any) -> None:
        plain_reset(self)
        _RUN["measured"] = True
        self._probe_survival = SurvivalEstimator(self.config.block_size - 1)

    def step(self: Any) -> Any:
        _SELECTS.clear()
        t0 = self.clock()
        report = plain_step(self)
        wall = self.clock() - t0
        if not _RUN["measured"] or not report.verified:
            return report
        surv = getattr(self, "_probe_survival", None)
        if surv is None:
            surv = self._probe_survival = SurvivalEstimator(self.config.block_size - 1)
        expected = expected_committed(surv, report.verify_outcomes)
        for rid, v, a in report.verify_outcomes:
            surv.observe(rid, v, a)
        for rid in report.finished:
            surv.forget(rid)
        batcher = self.batcher
        executed = None
        if isinstance(batcher, batching.ShadowComparison):
            executed = "deficit_tokens" if batcher.execute_shadow else "deficit_2d"
        elif isinstance(batcher, batching.DeficitBatcher):
            executed = batcher.name
        _STEPS.append(
            {
                **_RUN["key"],
                "step": len([s for s in _STEPS if s["run"] == _RUN["key"]["run"]]),
                "wall_s": wall,
                "admitted": report.admitted,
                "verified_requests": report.verified,
                "verified_tokens": report.verified_tokens,
                "committed_tokens": report.committed_tokens,
                "expected_committed": expected,
                "scheduler_us_engine": report.scheduler_us,
                "executed": executed,
                "selects": list(_SELECTS),
            }
        )
        return report

    Engine._step = step  # type: ignore[method-assign]
    Engine.reset_stats = reset  # type: ignore[method-assign]


def _set_rate(rate_of: str) -> None:
    """Every PDController built from now on judges by ``rate_of``."""
    from pdflash.engine.pd_controller import PDController

    plain_init = PDController.__init__

    def init(self: Any, **kw: Any) -> None:
        kw.setdefault("rate_of", rate_of)
        plain_init(self, **kw)

    PDController.__init__ = init  # type: ignore[method-assign]


def main() -> int:
    from pdflash.bench.suites import default, matrix
    from pdflash.bench.suites.matrix import load_engine

    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--baselines", default="PD,PD-all-on,PD-token-sched")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--verify-width", default="auto", help="as matrix --verify-width")
    ap.add_argument(
        "--byte-budget",
        type=int,
        default=None,
        help="PD's M in bytes (default: the bytes the link moves while one verify computes)",
    )
    ap.add_argument(
        "--rate-of",
        default=None,
        help="the PD controller's rate (PDController rate_of; default: its own default)",
    )
    ap.add_argument(
        "--marginal-rule",
        default=None,
        choices=["off", "verify"],
        help="PD's marginal rule (RunSpec.marginal_rule; default: RunSpec's)",
    )
    args = ap.parse_args()
    _install()
    if args.rate_of is not None:
        _set_rate(args.rate_of)
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
        verify_width=[args.verify_width],
    )
    specs = matrix.plan(ns)
    for spec in specs:
        conc = spec["concurrency"]
        spec["num_requests"] = conc * 4
        spec["max_running"] = default.LIVE_PER_CONCURRENCY * conc
        if args.byte_budget is None:
            spec["byte_budget_from"] = "verify"
        else:
            spec["byte_budget"] = args.byte_budget
        if args.marginal_rule is not None:
            spec["marginal_rule"] = args.marginal_rule
    spec_cls, run_fn = load_engine()

    def run(spec: Any, progress: Any = None) -> Any:
        _RUN["measured"] = False
        _RUN["key"] = {
            "run": f"{spec.baseline} c={spec.concurrency} r={spec.repeat}",
            "baseline": spec.baseline,
            "concurrency": spec.concurrency,
            "repeat": spec.repeat,
        }
        return run_fn(spec, progress=progress)

    args.out.mkdir(parents=True, exist_ok=True)
    matrix.run_matrix(specs, args.out, engine=(spec_cls, run), show_progress=False)
    with (args.out / "steps.jsonl").open("a") as f:
        for s in _STEPS:
            f.write(json.dumps(s) + "\n")
    print(f"{len(_STEPS)} steps -> {args.out / 'steps.jsonl'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
