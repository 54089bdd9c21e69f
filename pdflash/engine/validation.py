"""Checks on what a client passes to :meth:`pdflash.engine.Engine.add_request`.

Every check raises ``ValueError`` or ``TypeError`` naming the argument and
the bad value; none changes any state, so a rejected request leaves the
engine exactly as it was.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

#: seeds go to ``torch.Generator.manual_seed`` (an unsigned 64-bit value)
SEED_MAX = (1 << 64) - 1


def is_int(value: Any) -> bool:
    """A Python or numpy integer, not a bool (``True`` is not a token id)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def check_int(name: str, value: Any, *, low: int, high: int | None = None) -> int:
    """``value`` as an ``int`` in ``[low, high]``; TypeError/ValueError otherwise."""
    if not is_int(value):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    v = int(value)
    if v < low or (high is not None and v > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bound}, got {v}")
    return v


def token_ids(name: str, ids: Any, vocab_size: int) -> list[int]:
    """A flat list of integer token ids in ``[0, vocab_size)``.

    Accepts a sequence of Python/numpy integers, or a 1-D numpy/torch array of
    an integer dtype. Refuses strings, bools, floats (even integral-valued),
    nested sequences and empty input.
    """
    if isinstance(ids, (str, bytes)):
        raise TypeError(f"{name} must be a sequence of integer token ids, got {type(ids).__name__}")
    if isinstance(ids, torch.Tensor):
        if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
            raise TypeError(f"{name} must hold integer token ids, got a {ids.dtype} tensor")
        if ids.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(ids.shape)}")
        out = [int(t) for t in ids.tolist()]
    elif isinstance(ids, np.ndarray):
        if ids.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integer token ids, got a {ids.dtype} array")
        if ids.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got shape {ids.shape}")
        out = [int(t) for t in ids.tolist()]
    elif isinstance(ids, Sequence):
        out = []
        for i, t in enumerate(ids):
            if not is_int(t):
                raise TypeError(
                    f"{name}[{i}] must be an integer token id, got {type(t).__name__} {t!r}"
                )
            out.append(int(t))
    else:
        raise TypeError(f"{name} must be a sequence of integer token ids, got {type(ids).__name__}")
    bad = [t for t in out if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{name} token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    return out


def positive_seconds(name: str, value: Any) -> float | None:
    """``None`` or a finite positive number of seconds."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    v = float(value)
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{name} must be finite and positive, got {value!r}")
    return v


def max_positions(adapter: Any) -> int | None:
    """The target's ``max_position_embeddings`` (None when it does not say)."""
    value: Any = getattr(adapter, "max_position_embeddings", None)
    if value is None:
        value = getattr(getattr(adapter, "config", None), "max_position_embeddings", None)
    if not is_int(value) or int(value) <= 0:
        return None
    return int(value)
