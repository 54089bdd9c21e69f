"""Loads the compiled modules and fails loudly when one is missing.

NOTE: the pure-Python references in :mod:`pdflash._reference` exist for
differential tests only. They are never substituted for a missing native
module: a broken build must be visible, not silently 30x slower.
"""

from __future__ import annotations

import importlib
from types import ModuleType

#: Every extension module a complete build produces.
NATIVE_MODULES: tuple[str, ...] = (
    "_build_info",
    "_cachebooks",
    "_deficit",
    "_hostmlp",
    "_hostsignal",
    "_issuer",
    "_mxfp4gemm",
    "_routeahead",
)


class NativeExtensionError(ImportError):
    """A pdflash_native extension module is missing or failed to load."""


def load_native(name: str) -> ModuleType:
    """Import ``pdflash_native.<name>`` or raise :class:`NativeExtensionError`."""
    qualified = f"pdflash_native.{name}"
    try:
        return importlib.import_module(qualified)
    except ImportError as exc:
        raise NativeExtensionError(
            f"pdflash's native module {qualified!r} is missing or failed to load ({exc}). "
            "pdflash does not fall back to Python; rebuild it with `pip install .` "
            "(see the README) and check the build log for that module."
        ) from exc


def load_all() -> dict[str, ModuleType]:
    """Import every native module; the first failure raises, naming it."""
    return {name: load_native(name) for name in NATIVE_MODULES}
