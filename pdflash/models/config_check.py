"""Validation of a checkpoint's ``config.json`` before anything is built.

transformers fills a missing key with its class default (the published
model's shapes) and accepts nonsense values (``rms_norm_eps=0``, a head count
that does not divide the hidden size), which then fail far away or silently
give NaNs. :func:`read_config_json` and :func:`check_model_config` refuse
such a config with a :class:`~pdflash.models.store.CheckpointError` naming
the file and the key.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pdflash.models.store import CheckpointError

#: keys a config.json must state (never taken from transformers' defaults)
REQUIRED_KEYS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "num_experts_per_tok",
)
#: integer keys that must be >= 1 when present
POSITIVE_INT_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_experts_per_tok",
    "max_position_embeddings",
)


def read_config_json(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The parsed ``config.json`` of a checkpoint directory (or the file itself)."""
    p = Path(path)
    cfg = p / "config.json" if p.is_dir() else p
    if not cfg.is_file():
        raise CheckpointError(f"{p}: no config.json")
    try:
        raw = json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{cfg}: not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{cfg}: expected a JSON object, got {type(raw).__name__}")
    return raw


def _int_value(cfg: Path, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise CheckpointError(f"{cfg}: {key} must be an integer, got {value!r}")
    return int(value)


def check_raw_keys(raw: Mapping[str, Any], cfg: Path) -> None:
    """Every :data:`REQUIRED_KEYS` present and every positive key an integer >= 1."""
    missing = [k for k in REQUIRED_KEYS if raw.get(k) is None]
    if missing:
        raise CheckpointError(f"{cfg}: missing required key(s) {missing}")
    for key in POSITIVE_INT_KEYS:
        if raw.get(key) is None:
            continue
        if _int_value(cfg, key, raw[key]) < 1:
            raise CheckpointError(f"{cfg}: {key} must be >= 1, got {raw[key]!r}")


def check_model_config(config: Any, num_experts: int, cfg: Path) -> None:
    """Shapes and constants of a resolved (transformers) MoE config."""

    def get(key: str) -> Any:
        return getattr(config, key, None)

    for key in POSITIVE_INT_KEYS:
        value = get(key)
        if value is not None and _int_value(cfg, key, value) < 1:
            raise CheckpointError(f"{cfg}: {key} must be >= 1, got {value!r}")
    eps = get("rms_norm_eps")
    if eps is not None:
        if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
            raise CheckpointError(f"{cfg}: rms_norm_eps must be a number, got {eps!r}")
        if not (math.isfinite(float(eps)) and float(eps) > 0):
            raise CheckpointError(f"{cfg}: rms_norm_eps must be finite and > 0, got {eps!r}")
    heads = int(get("num_attention_heads"))
    kv_heads = get("num_key_value_heads")
    if kv_heads is not None and heads % int(kv_heads):
        raise CheckpointError(
            f"{cfg}: num_key_value_heads ({kv_heads}) must divide num_attention_heads ({heads})"
        )
    if get("head_dim") is None and int(get("hidden_size")) % heads:
        raise CheckpointError(
            f"{cfg}: hidden_size ({get('hidden_size')}) is not a multiple of "
            f"num_attention_heads ({heads}) and no head_dim is given"
        )
    top_k = int(get("num_experts_per_tok"))
    if num_experts < 1:
        raise CheckpointError(f"{cfg}: the config has no experts ({num_experts})")
    if top_k > num_experts:
        raise CheckpointError(
            f"{cfg}: num_experts_per_tok ({top_k}) exceeds the number of experts ({num_experts})"
        )
