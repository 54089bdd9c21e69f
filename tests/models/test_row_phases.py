"""The offloaded block's per-phase row masks of a group (one upload and one
gather per group) against the per-phase masks they replace (one upload per
phase)."""

from __future__ import annotations

import numpy as np
import torch

from pdflash.models.offload import OffloadedMoE


def _rows_of_reference(flat: torch.Tensor, experts: np.ndarray, num_experts: int) -> torch.Tensor:
    """Bool ``[rows]``: the routed rows whose expert is in ``experts``."""
    sel = torch.zeros(num_experts, dtype=torch.bool)
    sel[torch.from_numpy(np.asarray(experts, dtype=np.int64))] = True
    return sel[flat]


def test_phase_rows_select_the_rows_of_each_phase() -> None:
    rng = np.random.default_rng(0)
    for num_experts in (2, 8, 32, 128):
        moe = OffloadedMoE.__new__(OffloadedMoE)  # only num_experts is read
        moe.num_experts = num_experts
        for _ in range(50):
            flat = torch.from_numpy(rng.integers(0, num_experts, int(rng.integers(1, 64))))
            routed = np.unique(flat.numpy())
            group = np.sort(rng.choice(routed, int(rng.integers(1, routed.size + 1)), False))
            ready = rng.random(group.size) < 0.5
            rows = moe._phase_rows(flat, group, ready)
            assert rows.dtype == torch.bool and rows.shape == (2, *flat.shape)
            for phase, part in ((0, group[ready]), (1, group[~ready])):
                assert torch.equal(rows[phase], _rows_of_reference(flat, part, num_experts))
            assert not (rows[0] & rows[1]).any()
