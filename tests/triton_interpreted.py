"""Kernel modules loaded fresh under Triton's interpreter (triton picks the
interpreter at decoration time), so their kernels run on CPU tensors."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

import pytest


def fresh_module(name: str, fresh_name: str) -> ModuleType:
    """A new copy of module ``name``, registered as ``fresh_name``."""
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.origin is not None
    fresh = importlib.util.spec_from_file_location(fresh_name, spec.origin)
    assert fresh is not None and fresh.loader is not None
    module = importlib.util.module_from_spec(fresh)
    sys.modules[fresh.name] = module  # a dataclass looks its module up by name
    fresh.loader.exec_module(module)
    return module


def interpreted(*modules: tuple[str, str]) -> ModuleType:
    """The last of ``(name, fresh_name)`` pairs loaded fresh under
    ``TRITON_INTERPRET=1``; each earlier one is loaded fresh too and stands
    in for ``name`` while the later ones import (an interpreted kernel cannot
    call a compiled helper). Skips where triton is not installed."""
    pytest.importorskip("triton")
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")
    try:
        for name, fresh_name in modules[:-1]:
            mp.setitem(sys.modules, name, fresh_module(name, fresh_name))
        return fresh_module(*modules[-1])
    finally:
        mp.undo()
