"""Pure-Python references of pdflash's native hot loops.

For differential tests and benchmarks only: pdflash never falls back to
these when a native module is missing (see :mod:`pdflash._native`).
"""
