"""Compiled hot loops of pdflash (Cython), one module per concept.

This package holds only extension modules and their ``.pxd``/``.pyi``
companions. It never imports :mod:`pdflash`; the Python API talks to it
through the Protocols in :mod:`pdflash.protocols`.
"""
