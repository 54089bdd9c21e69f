"""The ``pdflash-bench`` console script.

``pdflash-bench`` with no arguments runs the embedded default suite;
``pdflash-bench <suite> [--json] ...`` runs one suite. A suite's result may
carry ``"exit_code"`` (removed before printing) to make the command fail. A
suite module must stay cheap to import (heavy imports such as torch go inside
``run``), since building the parser imports every suite to collect its options.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from types import ModuleType

# subcommand -> module under pdflash.bench.suites
SUITES: dict[str, str] = {
    "h2d": "h2d",
    "moe": "moe",
    "routeahead": "routeahead",
    "engine": "engine",
    "sched": "sched",
    "default": "default",
    "matrix": "matrix",
    "ablation": "ablation",
    "report": "report",
    "bm": "bm",
    "bm1": "bm",
    "bm2": "bm",
    "bm3": "bm",
    "bm4": "bm",
    "bm5": "bm",
    "proxy": "proxy",
    "scale": "scale",
}
DEFAULT_SUITE = "default"


def _load_suite(name: str) -> ModuleType:
    return importlib.import_module(f"{__package__}.suites.{SUITES[name]}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdflash-bench",
        description="Benchmarks for pdflash. With no subcommand, runs the default suite.",
    )
    sub = parser.add_subparsers(dest="suite", metavar="SUITE")
    for name in SUITES:
        module = _load_suite(name)
        sp = sub.add_parser(name, help=module.HELP, description=module.HELP)
        sp.add_argument("--json", action="store_true", help="print one JSON object")
        module.add_arguments(sp)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if DEFAULT_SUITE in SUITES and (
        not args_list or (args_list[0].startswith("-") and args_list[0] not in ("-h", "--help"))
    ):
        # `pdflash-bench` and `pdflash-bench --quick ...` run the default suite
        args_list = [DEFAULT_SUITE, *args_list]
    if not args_list:
        parser.print_help()
        return 2
    args = parser.parse_args(args_list)
    result = _load_suite(args.suite).run(args)
    # A suite may ask for a non-zero exit status (e.g. `report` on invalid input).
    exit_code = int(result.pop("exit_code", 0)) if isinstance(result, dict) else 0
    if getattr(args, "json", False):
        print(json.dumps(result, indent=None, sort_keys=True))
    elif result is not None:
        print(json.dumps(result, indent=2, sort_keys=True))
    return exit_code


if __name__ == "__main__":
    raise SystemExit(main())
