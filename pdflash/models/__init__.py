"""Real Hugging Face MoE architectures with experts offloaded to host memory.

Entry point: :func:`load_adapter` (``MoEModelAdapter`` over a checkpoint
directory, experts in an :class:`ExpertStore`, run from an
:class:`~pdflash.cache.ExpertCache`). Extension: subclass
:class:`MoEAdapterBase` (or :class:`SwiGLUAdapter`) and register it with
:func:`register_adapter` or a ``pdflash.adapters`` entry point
(:data:`ENTRY_POINT_GROUP`).
"""

from __future__ import annotations

import os
from typing import Any

from pdflash.models.adapters import (
    ADAPTERS,
    ENTRY_POINT_GROUP,
    MoEAdapterBase,
    SwiGLUAdapter,
    UnknownArchitectureError,
    UnsupportedConfigError,
    available_architectures,
    get_adapter_class,
    register_adapter,
    unregister_adapter,
)
from pdflash.models.layout import ComponentSpec, ExpertFormat, ExpertLayout, SourcePart
from pdflash.models.offload import (
    MoEBlockSpec,
    OffloadedMoE,
    OffloadedMoEBlock,
    UnknownMoEPartError,
    install_offloaded_blocks,
)
from pdflash.models.store import (
    CheckpointError,
    ExpertStore,
    ForeignExpertError,
    SafetensorsCheckpoint,
)
from pdflash.models.synthetic import (
    PRESET_ARCH,
    PRESETS,
    synthetic_config,
    write_synthetic_checkpoint,
)


def read_model_type(path: str | os.PathLike[str]) -> str:
    """``model_type`` from a checkpoint's config.json."""
    from pathlib import Path

    from pdflash.models.config_check import read_config_json

    cfg = Path(path) / "config.json"
    model_type = read_config_json(path).get("model_type")
    if not isinstance(model_type, str):
        raise CheckpointError(f"{cfg}: no model_type")
    return model_type


def load_adapter(path: str | os.PathLike[str], **kwargs: Any) -> MoEAdapterBase:
    """The adapter for a checkpoint directory; ``kwargs`` go to
    :class:`MoEAdapterBase` (``device``, ``dtype``, ``issuer``,
    ``cache_fraction`` | ``cache_bytes`` | ``cache_slots``,
    ``max_batch_tokens``, ``policy``, ``attn_implementation``,
    ``check_finite`` (default True: NaN/Inf weights are refused),
    ``expert_nbytes`` (pad every stored expert to that many bytes, see
    :meth:`ExpertLayout.padded`), ``owned_experts`` (pack only those experts:
    an expert-parallel rank's share), ...)."""
    from pathlib import Path

    model_type = read_model_type(path)
    try:
        cls = get_adapter_class(model_type)
    except UnknownArchitectureError as exc:
        raise UnknownArchitectureError(f"{Path(path) / 'config.json'}: {exc}") from exc
    return cls(path, **kwargs)


__all__ = [
    "ADAPTERS",
    "ENTRY_POINT_GROUP",
    "PRESETS",
    "PRESET_ARCH",
    "CheckpointError",
    "ComponentSpec",
    "ExpertFormat",
    "ExpertLayout",
    "ExpertStore",
    "ForeignExpertError",
    "MoEAdapterBase",
    "MoEBlockSpec",
    "OffloadedMoE",
    "OffloadedMoEBlock",
    "SafetensorsCheckpoint",
    "SourcePart",
    "SwiGLUAdapter",
    "UnknownArchitectureError",
    "UnknownMoEPartError",
    "UnsupportedConfigError",
    "available_architectures",
    "get_adapter_class",
    "install_offloaded_blocks",
    "load_adapter",
    "read_model_type",
    "register_adapter",
    "synthetic_config",
    "unregister_adapter",
    "write_synthetic_checkpoint",
]
