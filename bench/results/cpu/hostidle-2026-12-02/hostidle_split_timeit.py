"""``HostExpertService.split`` per call, the service switched on (it plans
and hosts nothing) vs off, on a cache's two residency arrays (numpy only).
Run: ``python -P bench/results/cpu/hostidle-2026-12-02/hostidle_split_timeit.py``."""

import timeit
from typing import Any

import numpy as np

from pdflash.hybrid import CostModelPlanner, ForcedHostPlanner, HostCostModel
from pdflash.hybrid.service import HostExpertService


class _Cache:
    """What a split reads of the expert cache: ``slot_of`` and ``ticket``."""

    def __init__(self, num_ids: int, held: list[int]) -> None:
        self.slot_of = np.full(num_ids, -1, dtype=np.int64)
        self.slot_of[held] = np.arange(len(held))
        self.ticket = np.full(max(1, len(held)), -1, dtype=np.int64)


def _per_call_us(svc: HostExpertService, cache: _Cache, n: int = 20000) -> float:
    ids = np.array([8, 9, 12, 13], dtype=np.int64)
    tok = np.array([4, 4, 4, 4], dtype=np.int64)

    def call() -> None:
        svc.split(1, ids, tok, cache, routed=(0.0, 1e-6))

    return min(timeit.repeat(call, number=n, repeat=5)) / n * 1e6


def main() -> None:
    planners: tuple[tuple[str, Any], ...] = (
        ("forced", ForcedHostPlanner(every=None, ids=())),
        ("makespan", CostModelPlanner(HostCostModel(1e-3, 0.0), 1024)),
    )
    for name, planner in planners:
        # the split never reaches the executor here (nothing is hosted)
        svc = HostExpertService(
            None,  # type: ignore[arg-type]
            planner,
            num_experts=8,
            expert_nbytes=1024,
            link_bytes_per_s=1e9,
        )
        cache = _Cache(32, [0, 1, 9])
        for enabled in (True, False):
            svc.enabled = enabled
            print(f"{name:9s} enabled={enabled!s:5s} split {_per_call_us(svc, cache):.1f} us/call")


if __name__ == "__main__":
    main()
