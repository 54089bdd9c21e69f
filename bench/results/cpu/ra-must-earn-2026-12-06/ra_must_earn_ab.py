"""Route-ahead as a must-earn part probed first (a design candidate, not the
default), interleaved with PD, B1 and PD-no-route-ahead on the bare
default's specs.

``PDme`` is PD whose controller probes route-ahead first in each round
(``pd_controller.PARTS`` reordered) and judges it must-earn
(``DEFAULT_STANCES``), both changed in this process for its runs only (its
rows say so in ``arm_patch``). Everything else is
``bench/h200/default_ab.py``'s (specs, arms, a warm run of each arm, order
rotated each repeat).

    python3 -P bench/results/cpu/ra-must-earn-2026-12-06/ra_must_earn_ab.py OUT \
        --repeats 8 [--emulated-link-gbps 50]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import MappingProxyType
from typing import Any

from pdflash.bench.pair_ratios import pair_ratios

from pdflash.engine import pd_controller

ROOT = Path(__file__).resolve().parents[4]


def _load_default_ab() -> Any:
    """bench/h200/default_ab.py as a module (it puts its own folder on sys.path)."""
    path = ROOT / "bench" / "h200" / "default_ab.py"
    spec = importlib.util.spec_from_file_location("default_ab", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["default_ab"] = module
    spec.loader.exec_module(module)
    return module


default_ab = _load_default_ab()


@contextmanager
def route_ahead_first_and_must_earn() -> Iterator[str]:
    saved = (pd_controller.PARTS, pd_controller.ALL_PARTS, pd_controller.DEFAULT_STANCES)
    pd_controller.PARTS = ("route_ahead", "scheduler_2d", "stream")
    pd_controller.ALL_PARTS = (pd_controller.HOST_PART, *pd_controller.PARTS)
    pd_controller.DEFAULT_STANCES = MappingProxyType({**saved[2], "route_ahead": "must_earn"})
    try:
        yield "pd_controller.PARTS route_ahead first; DEFAULT_STANCES route_ahead=must_earn"
    finally:
        pd_controller.PARTS, pd_controller.ALL_PARTS, pd_controller.DEFAULT_STANCES = saved


def run(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    if name != "PDme":
        return dict(default_ab.run_arm(name, spec))
    with route_ahead_first_and_must_earn() as patch:
        row = dict(default_ab.run_arm("PD", spec))
    row["arm"] = name
    row["arm_patch"] = patch
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--emulated-link-gbps", type=float, default=None)
    args = parser.parse_args()
    args.device = "cpu"
    names = ["B1", "PD", "PDme", "PDnora"]
    args.out.mkdir(parents=True, exist_ok=True)
    rows_path = args.out / "rows.jsonl"
    with rows_path.open("a") as f:
        for rep in range(-1, args.repeats):  # -1: the warm runs, unrecorded
            for conc in args.concurrency:
                specs = default_ab._arm_specs(
                    ["B1", "PD", "PDnora"], default_ab._default_specs(args, conc, False)
                )
                order = names[rep % len(names) :] + names[: rep % len(names)]
                for name in order:
                    spec = specs["PD" if name == "PDme" else name]
                    row = run(name, {**spec, "repeat": max(rep, 0)})
                    if rep >= 0:
                        f.write(json.dumps(row, default=str) + "\n")
                        f.flush()
    rows = [json.loads(line) for line in rows_path.open()]
    for pair in ("PDme/B1", "PD/B1", "PDme/PD", "PDme/PDnora"):
        num, den = pair.split("/")
        for point in pair_ratios(rows, num, den):
            print(json.dumps({"pair": pair, **point}, default=str))


if __name__ == "__main__":
    main()
