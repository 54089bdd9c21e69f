"""One module per ``pdflash-bench`` subcommand.

Each module defines ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> dict`` returning a JSON-serialisable result.
"""
