"""pdflash-bench: benchmark suites and recorded results.

Installed as ``pdflash.bench`` (never as a top-level ``bench`` module).
"""
