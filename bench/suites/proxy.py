"""``pdflash-bench proxy``: the trained proxy target and drafter (see
:mod:`pdflash.bench.proxy`); this module only registers the subcommand."""

from __future__ import annotations

from pdflash.bench.proxy.cli import HELP, add_arguments, run

__all__ = ["HELP", "add_arguments", "run"]
