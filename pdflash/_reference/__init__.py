"""Pure-Python reference implementations of pdflash's native hot loops.

They exist for differential tests only and are never used in place of a
missing native module (see :mod:`pdflash._native`).
"""
