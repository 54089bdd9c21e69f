"""Weight policies: pure-Python objects that set per-request weights.

A policy is called once per step, before the scan, with arrays over the live
requests in ring order (never once per item), and returns one weight per
request. Weights scale the DRR quantum (``Q_i = w_i * Q``): a request with
weight 2 is owed twice the service of a weight-1 request while both are
backlogged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from pdflash.scheduler.config import MIN_WEIGHT


@dataclass(frozen=True)
class PolicyInput:
    """What a policy sees at a step (all arrays aligned, ring order)."""

    step_index: int  # 0 for the first step(); a logical clock, never wall time
    request_ids: npt.NDArray[np.int64]
    base_weights: npt.NDArray[np.float64]  # as given to add_request / set_weight
    deficits: npt.NDArray[np.float64]
    pending_tokens: npt.NDArray[np.int64]  # 1 + drafts; 0 = no pending demand
    steps_since_served: npt.NDArray[np.int64]  # -1 = never served


@runtime_checkable
class WeightPolicy(Protocol):
    """Sets the weights used for one step."""

    def weights(self, view: PolicyInput) -> npt.NDArray[np.float64]:
        """One finite weight >= ``MIN_WEIGHT`` per live request (ring order)."""
        ...


class FairPolicy:
    """The default: every request keeps its base weight (plain weighted DRR)."""

    def weights(self, view: PolicyInput) -> npt.NDArray[np.float64]:
        result: npt.NDArray[np.float64] = view.base_weights.copy()
        return result


@dataclass
class DeadlinePolicy:
    """Example SLO policy: boost requests whose deadline is near.

    Deadlines are in *steps* (the scheduler's logical clock), so schedules
    stay deterministic. A request ``horizon`` or more steps from its deadline
    keeps its base weight; closer, the weight grows linearly up to
    ``max_boost`` times the base at (or past) the deadline. Requests without a
    deadline keep their base weight.
    """

    horizon: int = 8
    max_boost: float = 4.0
    deadlines: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.horizon < 1:
            raise ValueError(f"horizon must be >= 1, got {self.horizon!r}")
        if not (1.0 <= self.max_boost < math.inf):
            raise ValueError(f"max_boost must be finite and >= 1, got {self.max_boost!r}")

    def set_deadline(self, request_id: int, step: int) -> None:
        self.deadlines[int(request_id)] = int(step)

    def set_deadlines(self, deadlines: Mapping[int, int]) -> None:
        for rid, step in deadlines.items():
            self.set_deadline(rid, step)

    def forget(self, request_id: int) -> None:
        self.deadlines.pop(int(request_id), None)

    def weights(self, view: PolicyInput) -> npt.NDArray[np.float64]:
        n = len(view.request_ids)
        slack = np.full(n, self.horizon, dtype=np.float64)
        for k, rid in enumerate(view.request_ids.tolist()):
            d = self.deadlines.get(rid)
            if d is not None:
                slack[k] = d - view.step_index
        urgency = np.clip((self.horizon - slack) / self.horizon, 0.0, 1.0)
        boost = 1.0 + urgency * (self.max_boost - 1.0)
        return np.maximum(view.base_weights * boost, MIN_WEIGHT)
