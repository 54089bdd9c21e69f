"""Acceptance-aware horizon: predict only for the positions likely accepted.

A verify round of a B-position block (anchor + B-1 drafted tokens) commits
``a`` tokens, 1 <= a <= B: the accepted drafted tokens plus the target's own
next token. Their logits come from the block's first ``a`` positions, so an
engine that truncates verify to the expected accepted prefix needs the
experts of those positions only, and a route-ahead prefetch for positions
past it is likely waste.

:class:`AcceptanceHorizon` keeps each request's last ``window`` acceptance
lengths and sets the horizon to their ``quantile`` by the nearest-rank method
(the ``ceil(q * n)``-th smallest; q=0.9 covers 90% of recent rounds), plus
``margin``, clamped to ``[min_horizon, block_size]``. A request with no
history gets ``None`` (the whole block).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from typing import TYPE_CHECKING

from pdflash.protocols import DraftedBlock

if TYPE_CHECKING:
    from pdflash.protocols import HorizonPolicy


class AcceptanceHorizon:
    def __init__(
        self,
        block_size: int,
        *,
        window: int = 8,
        quantile: float = 0.9,
        margin: int = 0,
        min_horizon: int = 1,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if window <= 0:
            raise ValueError(f"window must be positive, got {window}")
        if not 0.0 < quantile <= 1.0:
            raise ValueError(f"quantile must be in (0, 1], got {quantile}")
        if margin < 0:
            raise ValueError(f"margin must be >= 0, got {margin}")
        if not 1 <= min_horizon <= block_size:
            raise ValueError(f"min_horizon must be in [1, {block_size}], got {min_horizon}")
        self.block_size = block_size
        self.window = window
        self.quantile = quantile
        self.margin = margin
        self.min_horizon = min_horizon
        self._recent: dict[int, deque[int]] = {}

    def observe(self, request_id: int, acceptance_length: int) -> None:
        """Tokens the request's last verify committed, in ``[1, block_size]``."""
        if not 1 <= acceptance_length <= self.block_size:
            raise ValueError(
                f"acceptance_length must be in [1, {self.block_size}], got {acceptance_length}"
            )
        self._recent.setdefault(request_id, deque(maxlen=self.window)).append(acceptance_length)

    def horizon(self, request_id: int) -> int | None:
        """Positions to predict for, or None (whole block) without history."""
        recent = self._recent.get(request_id)
        if not recent:
            return None
        ordered = sorted(recent)
        rank = max(1, math.ceil(self.quantile * len(ordered)))
        k = ordered[rank - 1] + self.margin
        return max(self.min_horizon, min(self.block_size, k))

    def apply(self, block: DraftedBlock) -> DraftedBlock:
        """A copy of ``block`` with its ``horizon`` set for its request."""
        return dataclasses.replace(block, horizon=self.horizon(block.request_id))

    def forget(self, request_id: int) -> None:
        self._recent.pop(request_id, None)


if TYPE_CHECKING:
    # mypy: AcceptanceHorizon is the engine's horizon policy
    def _is_horizon_policy(horizon: AcceptanceHorizon) -> HorizonPolicy:
        return horizon
