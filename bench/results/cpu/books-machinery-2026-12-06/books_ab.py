"""The PD controller's books charging the whole prefetch machinery (tree
``220a713``) against the books as they were (each part's own stages only),
interleaved with B1 and PD-no-route-ahead on the bare default's specs.

``PDpartbooks`` is PD whose books charge ``part_host_s`` (the controller's
``_books_host`` replaced by ``_host`` for its runs; its rows say so in
``arm_patch``). Everything else is ``bench/h200/default_ab.py``'s (its specs,
arms, warm runs and order rotated each repeat).

    python3 -P bench/results/cpu/books-machinery-2026-12-06/books_ab.py OUT \
        --concurrency 1 4 --repeats 10 [--emulated-link-gbps 50]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
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
def part_books() -> Iterator[None]:
    saved = pd_controller._books_host
    pd_controller._books_host = pd_controller._host
    try:
        yield
    finally:
        pd_controller._books_host = saved


def run(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    if name != "PDpartbooks":
        return dict(default_ab.run_arm(name, spec))
    with part_books():
        row = dict(default_ab.run_arm("PD", spec))
    row["arm"] = name
    row["arm_patch"] = "pd_controller._books_host=_host"
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--emulated-link-gbps", type=float, default=None)
    args = parser.parse_args()
    args.device = "cpu"
    names = ["B1", "PD", "PDpartbooks", "PDnora"]
    args.out.mkdir(parents=True, exist_ok=True)
    rows_path = args.out / "rows.jsonl"
    for conc in args.concurrency:  # warm runs, unrecorded
        specs = default_ab._arm_specs(
            ["B1", "PD", "PDnora"], default_ab._default_specs(args, conc, False)
        )
        for name in names:
            run(name, {**specs["PD" if name == "PDpartbooks" else name], "repeat": args.repeats})
    with rows_path.open("a") as f:
        for rep in range(args.repeats):
            for conc in args.concurrency:
                specs = default_ab._arm_specs(
                    ["B1", "PD", "PDnora"], default_ab._default_specs(args, conc, False)
                )
                order = names[rep % len(names) :] + names[: rep % len(names)]
                for name in order:
                    spec = specs["PD" if name == "PDpartbooks" else name]
                    row = run(name, {**spec, "repeat": rep})
                    f.write(json.dumps(row, default=str) + "\n")
                    f.flush()
    rows = [json.loads(line) for line in rows_path.open()]
    for pair in ("PD/B1", "PDpartbooks/B1", "PDnora/B1", "PD/PDpartbooks", "PD/PDnora"):
        num, den = pair.split("/")
        for point in pair_ratios(rows, num, den):
            print(json.dumps({"pair": pair, **point}, default=str))


if __name__ == "__main__":
    main()
