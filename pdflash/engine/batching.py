"""Choosing each step's verify batch.

:class:`VerifyBatcher` is the seam: FCFS under a token budget (B0, B1, B3)
is built in; the deficit scheduler of :mod:`pdflash.scheduler` (B2 in
token-only mode, PD in 2-D mode) plugs in through :class:`DeficitBatcher`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt


@dataclass
class VerifyDemand:
    """A request waiting for verify: ``tokens`` = 1 + drafts (trimmable to 1)."""

    request_id: int
    tokens: int
    predicted: npt.NDArray[np.int64] | None = None  # flat expert ids


@dataclass
class BatchDecision:
    grants: list[tuple[int, int]]  # (request_id, tokens), in execution order
    missing: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    scheduler_us: float = 0.0


class VerifyBatcher(Protocol):
    name: str

    def add(self, request_id: int, weight: float = 1.0) -> None: ...

    def remove(self, request_id: int) -> None: ...

    def select(
        self, demands: Sequence[VerifyDemand], resident: npt.NDArray[np.bool_] | None
    ) -> BatchDecision: ...


class FCFSBatcher:
    """Arrival order under a token budget; the last request is trimmed to fit."""

    name = "fcfs"

    def __init__(self, token_budget: int) -> None:
        if token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {token_budget}")
        self.token_budget = token_budget
        self._order: dict[int, int] = {}
        self._seq = 0

    def add(self, request_id: int, weight: float = 1.0) -> None:
        if request_id not in self._order:
            self._order[request_id] = self._seq
            self._seq += 1

    def remove(self, request_id: int) -> None:
        self._order.pop(request_id, None)

    def select(
        self, demands: Sequence[VerifyDemand], resident: npt.NDArray[np.bool_] | None
    ) -> BatchDecision:
        left = self.token_budget
        grants: list[tuple[int, int]] = []
        for d in sorted(
            demands, key=lambda d: (self._order.get(d.request_id, 1 << 62), d.request_id)
        ):
            if left <= 0:
                break
            g = min(d.tokens, left)
            grants.append((d.request_id, g))
            left -= g
        return BatchDecision(grants=grants)


class DeficitBatcher:
    """The DESIGN §4 deficit verify scheduler behind :class:`VerifyBatcher`.

    ``byte_budget=None`` is token-only mode (baseline B2); an int is the 2-D
    mode (PD), charging each item the marginal bytes of its predicted experts
    that are not resident. The scheduler's union of the batch's missing
    experts comes back in :attr:`BatchDecision.missing` so the engine
    prefetches exactly that.
    """

    def __init__(
        self,
        *,
        token_budget: int,
        byte_budget: int | None,
        num_layers: int,
        num_experts: int,
        expert_nbytes: int,
        max_tokens_per_item: int | None = None,
    ) -> None:
        from pdflash.scheduler import SchedulerConfig, VerifyScheduler

        self.name = "deficit_tokens" if byte_budget is None else "deficit_2d"
        cfg = SchedulerConfig(
            token_budget=token_budget,
            missing_byte_budget=byte_budget,
            num_layers=num_layers,
            num_experts=num_experts,
            max_tokens_per_item=max_tokens_per_item,
        )
        self.scheduler = VerifyScheduler(cfg)
        self.scheduler.set_expert_bytes(
            np.full((num_layers, num_experts), expert_nbytes, dtype=np.int64)
        )
        self._empty = np.zeros(0, dtype=np.int64)
        self._live: set[int] = set()

    def add(self, request_id: int, weight: float = 1.0) -> None:
        if request_id not in self._live:
            self.scheduler.add_request(request_id, weight)
            self._live.add(request_id)

    def remove(self, request_id: int) -> None:
        if request_id in self._live:
            self.scheduler.remove_request(request_id)
            self._live.discard(request_id)

    def select(
        self, demands: Sequence[VerifyDemand], resident: npt.NDArray[np.bool_] | None
    ) -> BatchDecision:
        for d in demands:
            pred = d.predicted if d.predicted is not None else self._empty
            self.scheduler.update_demand(d.request_id, d.tokens - 1, pred)
        if resident is not None:
            self.scheduler.set_resident(resident)
        result = self.scheduler.step()
        grants = list(zip(result.request_ids.tolist(), result.token_grants.tolist(), strict=True))
        return BatchDecision(grants=grants, missing=np.array(result.union_ids, dtype=np.int64))
