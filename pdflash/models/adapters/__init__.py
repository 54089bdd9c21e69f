"""Architecture adapters and their registry.

Adding an architecture = one file here with a :class:`MoEAdapterBase`
subclass (its expert naming/layout, expert MLP, q/k norm placement) and one
line in :data:`ADAPTERS`.
"""

from __future__ import annotations

import importlib

from pdflash.models.adapters.base import MoEAdapterBase, UnsupportedConfigError

#: config.model_type -> "module:Class" under pdflash.models.adapters
ADAPTERS: dict[str, str] = {
    "qwen3_moe": "qwen3_moe:Qwen3MoeAdapter",
    "gpt_oss": "gpt_oss:GptOssAdapter",
    "mixtral": "mixtral:MixtralAdapter",
    "olmoe": "olmoe:OlmoeAdapter",
}


class UnknownArchitectureError(ValueError):
    """No adapter is registered for a ``model_type``."""


def get_adapter_class(model_type: str) -> type[MoEAdapterBase]:
    """The adapter class for a config's ``model_type``."""
    try:
        target = ADAPTERS[model_type]
    except KeyError:
        raise UnknownArchitectureError(
            f"no pdflash adapter for model_type {model_type!r}; supported: {sorted(ADAPTERS)}"
        ) from None
    module_name, cls_name = target.split(":")
    module = importlib.import_module(f"{__name__}.{module_name}")
    cls: type[MoEAdapterBase] = getattr(module, cls_name)
    return cls


__all__ = [
    "ADAPTERS",
    "MoEAdapterBase",
    "UnknownArchitectureError",
    "UnsupportedConfigError",
    "get_adapter_class",
]
