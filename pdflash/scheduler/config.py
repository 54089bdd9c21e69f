"""Configuration of the verify scheduler."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

#: Smallest accepted request weight. NOTE: the head of a step opens new laps
#: until it can pay for its item, so ``cost / (weight * quantum)`` laps may
#: run inside one step; a floor on weights keeps that loop short.
MIN_WEIGHT = 2.0**-10

#: Largest cost of a *normal* item in dominant-cost units: a grant never
#: exceeds the token budget (``t / T <= 1``) and a normal item's marginal
#: bytes never exceed the byte budget (``mb / M <= 1``). Items above it are
#: the oversize exception.
NORMAL_ITEM_COST_MAX = 1.0


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


#: ``T * (F + every expert's bytes)`` must stay below this, so the marginal
#: rule's products ``g * (F + B)`` and ``tokens * mb`` are exact in int64.
MARGINAL_PRODUCT_MAX = 2**62


def check_fixed_step_bytes(value: object, token_budget: int, total_bytes: int = 0) -> int:
    """``F`` as an int, or ValueError: an int ``>= 0`` with
    ``T * (F + total_bytes) <= 2**62``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 0:
        raise ValueError(f"fixed_step_bytes must be None or an int >= 0, got {value!r}")
    f = int(value)
    if token_budget * (f + total_bytes) > MARGINAL_PRODUCT_MAX:
        raise ValueError(
            f"token_budget * (fixed_step_bytes + every expert's bytes) = "
            f"{token_budget} * ({f} + {total_bytes}) exceeds 2**62 (int64 products)"
        )
    return f


@dataclass(frozen=True)
class SchedulerConfig:
    """Budgets and shape of a :class:`~pdflash.scheduler.VerifyScheduler`.

    Attributes:
        token_budget: ``T``, tokens verified per step (all grants together).
        missing_byte_budget: ``M``, bytes of non-resident experts a step may
            need (the union over its batch). ``None`` or ``math.inf`` is
            token-only mode: bytes are reported but never limit or charge
            a step (baseline B2).
        quantum: ``Q``, credit a weight-1 request receives per DRR lap, in
            dominant-cost units (1.0 = one whole step's budget). Must be at
            least the largest normal item cost (1.0; or
            ``max_tokens_per_item / T`` in token-only mode when that is set).
        max_requests_per_step: cap on the batch size (``None``: no cap).
        num_layers, num_experts: the expert grid; flat expert id
            ``g = layer * num_experts + expert``.
        max_tokens_per_item: optional bound on ``1 + drafted_tokens``;
            demands above it are rejected.
        fixed_step_bytes: ``F``, the bytes the link moves during a step's
            fixed time (``t_fixed * link rate``: drafting, the forward's
            fixed cost, host work). Set, ``M`` is soft against shared
            experts (the marginal rule, docs/scheduler.md rule 4.4): an
            item whose marginal bytes do not fit the bytes left is still
            admitted when it raises the step's modelled tokens per second,
            ``g * (F + B) > tokens * mb``. ``None`` keeps ``M`` hard.
            Ignored in token-only mode.
    """

    token_budget: int
    missing_byte_budget: int | float | None = None
    quantum: float = 1.0
    max_requests_per_step: int | None = None
    num_layers: int = 48
    num_experts: int = 128
    max_tokens_per_item: int | None = None
    fixed_step_bytes: int | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.token_budget) or self.token_budget < 1:
            raise ValueError(f"token_budget must be an int >= 1, got {self.token_budget!r}")
        m = self.missing_byte_budget
        if m is not None and not (isinstance(m, float) and m == math.inf):
            if isinstance(m, float) and m.is_integer():
                object.__setattr__(self, "missing_byte_budget", int(m))
            elif not _is_int(m):
                raise ValueError(
                    "missing_byte_budget must be an int >= 1 (bytes), None or math.inf "
                    f"(token-only mode), got {m!r}"
                )
            if int(m) < 1:
                raise ValueError(f"missing_byte_budget must be >= 1 byte, got {m!r}")
        for name in ("num_layers", "num_experts"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        cap = self.max_requests_per_step
        if cap is not None and (not _is_int(cap) or cap < 1):
            raise ValueError(f"max_requests_per_step must be None or an int >= 1, got {cap!r}")
        mt = self.max_tokens_per_item
        if mt is not None and (not _is_int(mt) or mt < 1):
            raise ValueError(f"max_tokens_per_item must be None or an int >= 1, got {mt!r}")
        f = self.fixed_step_bytes
        if f is not None:
            check_fixed_step_bytes(f, self.token_budget)
        q = self.quantum
        if isinstance(q, bool) or not isinstance(q, numbers.Real) or not math.isfinite(q):
            raise ValueError(f"quantum must be a finite number, got {q!r}")
        c_max = self.largest_normal_cost
        if q < c_max:
            raise ValueError(
                f"quantum={q!r} is below the largest normal item cost {c_max!r}: with "
                "Q < c_max a weight-1 request could need several laps (and the head "
                "several waiting steps) for one normal item"
            )

    @property
    def token_only(self) -> bool:
        """True when the byte budget is unbounded (baseline B2)."""
        return self.missing_byte_budget is None or self.missing_byte_budget == math.inf

    @property
    def byte_budget(self) -> int | None:
        """``M`` as an int, or ``None`` in token-only mode."""
        if self.token_only:
            return None
        return int(self.missing_byte_budget)  # type: ignore[arg-type]

    @property
    def marginal_rule(self) -> bool:
        """True when ``M`` is soft against shared experts (``F`` set, 2-D mode)."""
        return self.fixed_step_bytes is not None and not self.token_only

    @property
    def num_flat(self) -> int:
        """Number of flat expert ids, ``num_layers * num_experts``."""
        return self.num_layers * self.num_experts

    @property
    def largest_normal_cost(self) -> float:
        """The largest cost a non-oversize item can have (see ``quantum``)."""
        if self.token_only and self.max_tokens_per_item is not None:
            return min(self.max_tokens_per_item, self.token_budget) / self.token_budget
        return NORMAL_ITEM_COST_MAX
