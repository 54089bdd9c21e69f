# cython: language_level=3
"""Facts about how this copy of pdflash_native was compiled."""

import cython

cuda_compiled: bool = bool(PDFLASH_WITH_CUDA)
cython_version: str = cython.__version__


def summary() -> dict:
    """Return the build facts as a plain dict (recorded in every bench row)."""
    return {"cuda_compiled": cuda_compiled, "cython_version": cython_version}
