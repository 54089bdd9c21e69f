"""The offloaded block's per-row phase codes (one upload per group) against
the per-phase row masks they replace (one upload per phase)."""

from __future__ import annotations

import numpy as np
import torch

from pdflash.models.offload import OffloadedMoE


def _rows_of_reference(flat: torch.Tensor, experts: np.ndarray, num_experts: int) -> torch.Tensor:
    """Bool ``[rows]``: the routed rows whose expert is in ``experts``."""
    sel = torch.zeros(num_experts, dtype=torch.bool)
    sel[torch.from_numpy(np.asarray(experts, dtype=np.int64))] = True
    return sel[flat]


def test_row_phases_select_the_rows_of_each_phase() -> None:
    rng = np.random.default_rng(0)
    for num_experts in (2, 8, 32, 128):
        moe = OffloadedMoE.__new__(OffloadedMoE)  # only num_experts is read
        moe.num_experts = num_experts
        for _ in range(50):
            flat = torch.from_numpy(rng.integers(0, num_experts, int(rng.integers(1, 64))))
            routed = np.unique(flat.numpy())
            group = np.sort(rng.choice(routed, int(rng.integers(1, routed.size + 1)), False))
            ready = rng.random(group.size) < 0.5
            phase = moe._row_phases(flat, group, ready)
            assert phase.dtype == torch.int8 and phase.shape == flat.shape
            for code, part in ((0, group[ready]), (1, group[~ready])):
                want = _rows_of_reference(flat, part, num_experts)
                assert torch.equal(phase == code, want)
            assert torch.equal(phase == -1, ~_rows_of_reference(flat, group, num_experts))
