"""Where PD's host time beyond B1's goes on the bare default (CPU): every
engine stage and PD's own calls timed by perf_counter wrappers, split by
whether PD's controller read the step at rest, for B1 and PD at one
concurrency (the default suite's specs at an emulated 50 GB/s).

    python3 -P tax.py 1 > tax_c1.txt    # run from outside the checkout
"""

from __future__ import annotations

import argparse
import collections
import importlib
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "h200"))
default_ab: Any = importlib.import_module("default_ab")  # bench/h200/default_ab.py

from pdflash.bench.engine_run import RunSpec, run_spec  # noqa: E402

from pdflash.engine import batching, engine, pd_controller, prefetch, verify_width  # noqa: E402

STATE = {"rest": False}
TIMES: dict[tuple[str, bool], list[float]] = collections.defaultdict(list)

WRAPPED: list[tuple[Any, str]] = [
    (engine.Engine, "_step"),
    (engine.Engine, "_prefill_admitted"),
    (engine.Engine, "_draft_stage"),
    (engine.Engine, "_predict"),
    (engine.Engine, "_schedule"),
    (engine.Engine, "_prefetch_before_verify"),
    (engine.Engine, "_record_verify"),
    (engine.Engine, "_commit_verified"),
    (engine.Engine, "_end_step"),
    (verify_width.WidthHook, "begin_step"),
    (verify_width.WidthHook, "trim"),
    (verify_width.WidthHook, "record"),
    (verify_width.WidthHook, "end_step"),
    (verify_width.AdaptiveWidth, "widths"),
    (verify_width.AdaptiveWidth, "observe"),
    (batching.DeficitBatcher, "select"),
    (batching.FCFSBatcher, "select"),
    (prefetch.ExpertPrefetcher, "background"),
    (pd_controller, "before_step"),
    (pd_controller, "after_step"),
]


def _wrap(owner: Any, name: str) -> None:
    fn: Callable[..., Any] = getattr(owner, name)
    label = f"{getattr(owner, '__name__', owner)}.{name}"

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[(label, STATE["rest"])].append(time.perf_counter() - start)
            if name == "before_step":  # the controller's reading of this step
                STATE["rest"] = bool(args[0].resting)

    setattr(owner, name, timed)


def _clear_on_reset() -> None:
    """The run's clock starts at ``Engine.reset_stats`` (after its warm-up
    and calibration steps): what ran before it is dropped."""
    reset = engine.Engine.reset_stats

    def cleared(self: Any, *args: Any, **kwargs: Any) -> Any:
        TIMES.clear()
        return reset(self, *args, **kwargs)

    setattr(engine.Engine, "reset_stats", cleared)  # noqa: B010


def main() -> None:
    conc = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    for owner, name in WRAPPED:
        _wrap(owner, name)
    _clear_on_reset()
    args = argparse.Namespace(device="cpu", emulated_link_gbps=50.0)
    specs = default_ab._default_specs(args, conc, False)
    for arm in ("B1", "PD"):
        run_spec(RunSpec(**specs[arm]))  # warm
    for arm in ("B1", "PD"):
        kept: dict[tuple[str, bool], list[float]] = collections.defaultdict(list)
        walls = []
        for _ in range(runs):
            STATE["rest"] = False
            row = run_spec(RunSpec(**specs[arm])).row
            walls.append(1e3 * row["wall_s"] / row["steps"])
            for key, ds in TIMES.items():
                kept[key] += ds
        engine_steps = len(kept[("Engine._step", False)]) + len(kept[("Engine._step", True)])
        print(
            f"{arm} c={conc}: {engine_steps / runs:.1f} steps a run on the clock, "
            f"measured wall {statistics.median(walls):.3f} ms a step (median of {runs} runs)"
        )
        print("  at rest | calls a step | total us a step | median us a call | stage")
        for (label, rest), ds in sorted(kept.items(), key=lambda kv: (kv[0][1], -sum(kv[1]))):
            if label == "Engine._step":
                continue
            print(
                f"  {'rest' if rest else 'no  '}    | {len(ds) / engine_steps:5.2f} | "
                f"{1e6 * sum(ds) / engine_steps:8.1f} | {1e6 * statistics.median(ds):8.1f} | {label}"
            )


if __name__ == "__main__":
    main()
