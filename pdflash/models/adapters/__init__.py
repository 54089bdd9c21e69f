"""Architecture adapters and their registry.

Three ways an architecture gets an adapter, looked up by ``config.model_type``
in this order:

1. :func:`register_adapter` — any :class:`MoEAdapterBase` subclass, defined
   anywhere (a user's module, a test), registered at run time;
2. the built-in adapters in :data:`ADAPTERS` (one small file each here);
3. the ``pdflash.adapters`` entry-point group (:data:`ENTRY_POINT_GROUP`): a
   separate package declares ``<model_type> = "its_pkg.module:AdapterClass"``
   in its packaging metadata; the entry point is loaded only when a checkpoint
   of that ``model_type`` is asked for.

Writing one: subclass :class:`MoEAdapterBase` (or :class:`SwiGLUAdapter` for
gate/up/down experts), set the class attributes and implement the expert
layout/formats/MLP; see the README's "Add an architecture".
"""

from __future__ import annotations

import importlib
import importlib.metadata
import threading

from pdflash.models.adapters._swiglu import SwiGLUExpertsMixin, SwiGLUGroupedExperts
from pdflash.models.adapters.base import MoEAdapterBase, SlabExperts, UnsupportedConfigError

#: the public name of the SwiGLU expert base (gate/up/down experts, as
#: qwen3_moe, qwen2_moe, mixtral, olmoe and glm4_moe store them)
SwiGLUAdapter = SwiGLUExpertsMixin

#: built-in adapters: config.model_type -> "module:Class" under pdflash.models.adapters
ADAPTERS: dict[str, str] = {
    "qwen3_moe": "qwen3_moe:Qwen3MoeAdapter",
    "gpt_oss": "gpt_oss:GptOssAdapter",
    "mixtral": "mixtral:MixtralAdapter",
    "olmoe": "olmoe:OlmoeAdapter",
    "qwen2_moe": "qwen2_moe:Qwen2MoeAdapter",
    "glm4_moe": "glm4_moe:Glm4MoeAdapter",
}

#: the entry-point group other packages declare adapters in (name = model_type)
ENTRY_POINT_GROUP = "pdflash.adapters"

_registered: dict[str, type[MoEAdapterBase]] = {}
_lock = threading.Lock()


class UnknownArchitectureError(ValueError):
    """No adapter is registered for a ``model_type``."""


def _check_adapter_class(model_type: str, adapter_cls: object, origin: str) -> type[MoEAdapterBase]:
    if not (isinstance(adapter_cls, type) and issubclass(adapter_cls, MoEAdapterBase)):
        raise TypeError(
            f"{origin}: the adapter for {model_type!r} must be a subclass of "
            f"pdflash.models.MoEAdapterBase, got {adapter_cls!r}"
        )
    arch = getattr(adapter_cls, "arch", None)
    if arch != model_type:
        raise ValueError(
            f"{origin}: {adapter_cls.__name__}.arch is {arch!r}, but it is registered for "
            f"model_type {model_type!r} (they must be equal)"
        )
    missing = [
        name for name in ("modeling", "hf_block_class") if getattr(adapter_cls, name, None) is None
    ]
    if missing:
        raise TypeError(f"{origin}: {adapter_cls.__name__} does not set {missing}")
    return adapter_cls


def register_adapter(
    model_type: str, adapter_cls: type[MoEAdapterBase], *, replace: bool = False
) -> None:
    """Use ``adapter_cls`` (a :class:`MoEAdapterBase` subclass whose ``arch``
    is ``model_type``) for checkpoints of ``model_type``.

    A registered class takes precedence over a built-in adapter and over an
    entry point of the same name, but registering over a built-in or an
    earlier registration needs ``replace=True`` (an accident otherwise).
    """
    if not isinstance(model_type, str) or not model_type:
        raise ValueError(f"model_type must be a non-empty string, got {model_type!r}")
    cls = _check_adapter_class(model_type, adapter_cls, "register_adapter")
    with _lock:
        taken = model_type in _registered or model_type in ADAPTERS
        if taken and not replace and _registered.get(model_type) is not cls:
            where = "registered" if model_type in _registered else "built in"
            raise ValueError(
                f"an adapter for {model_type!r} is already {where}; pass replace=True to replace it"
            )
        _registered[model_type] = cls


def unregister_adapter(model_type: str) -> None:
    """Undo :func:`register_adapter` (built-in adapters come back)."""
    with _lock:
        if model_type not in _registered:
            raise KeyError(f"no adapter registered for {model_type!r} with register_adapter")
        del _registered[model_type]


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    """The group's entry points by name (read, not loaded)."""
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def available_architectures() -> list[str]:
    """Every ``model_type`` with an adapter: registered, built-in, entry points."""
    return sorted({*_registered, *ADAPTERS, *_entry_points()})


def get_adapter_class(model_type: str) -> type[MoEAdapterBase]:
    """The adapter class for a config's ``model_type``."""
    cls = _registered.get(model_type)
    if cls is not None:
        return cls
    target = ADAPTERS.get(model_type)
    if target is not None:
        module_name, cls_name = target.split(":")
        module = importlib.import_module(f"{__name__}.{module_name}")
        builtin: type[MoEAdapterBase] = getattr(module, cls_name)
        return builtin
    ep = _entry_points().get(model_type)
    if ep is None:
        raise UnknownArchitectureError(
            f"no pdflash adapter for model_type {model_type!r}; supported: "
            f"{available_architectures()} (add one with pdflash.models.register_adapter or "
            f"a {ENTRY_POINT_GROUP!r} entry point)"
        )
    origin = f"entry point {ep.name} = {ep.value!r} (group {ENTRY_POINT_GROUP!r})"
    try:
        loaded = ep.load()
    except Exception as exc:
        raise ImportError(f"{origin} failed to load: {type(exc).__name__}: {exc}") from exc
    return _check_adapter_class(model_type, loaded, origin)


__all__ = [
    "ADAPTERS",
    "ENTRY_POINT_GROUP",
    "MoEAdapterBase",
    "SlabExperts",
    "SwiGLUAdapter",
    "SwiGLUGroupedExperts",
    "UnknownArchitectureError",
    "UnsupportedConfigError",
    "available_architectures",
    "get_adapter_class",
    "register_adapter",
    "unregister_adapter",
]
