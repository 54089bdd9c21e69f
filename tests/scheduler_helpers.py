"""What the scheduler tests share (``from scheduler_helpers import ...``;
tests/ is on the path, see conftest.py)."""

from __future__ import annotations

from pdflash import SchedulerConfig
from pdflash._reference.scheduler import ReferenceScheduler


def reference_for(cfg: SchedulerConfig) -> ReferenceScheduler:
    """The pure-Python reference of a ``VerifyScheduler(cfg)``: the same
    budgets, quantum, request cap, experts and fixed step bytes."""
    return ReferenceScheduler(
        cfg.token_budget,
        cfg.byte_budget,
        cfg.quantum,
        cfg.max_requests_per_step,
        cfg.num_flat,
        cfg.fixed_step_bytes,
    )
