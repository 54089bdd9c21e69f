"""The offloaded block's per-phase row masks of a group (chosen on the host
from the host routing, one upload per group) against the per-phase masks
they replace (one upload per phase) and the device gather before them."""

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
            rows = moe._phase_rows(flat.numpy(), group, ready, flat.device)
            assert rows.dtype == torch.bool and rows.shape == (2, *flat.shape)
            for phase, part in ((0, group[ready]), (1, group[~ready])):
                assert torch.equal(rows[phase], _rows_of_reference(flat, part, num_experts))
            assert not (rows[0] & rows[1]).any()


def _phase_rows_by_gather(
    flat: torch.Tensor, group: np.ndarray, ready: np.ndarray, num_experts: int
) -> torch.Tensor:
    """The previous selection: a ``[2, experts]`` table gathered by ``flat``."""
    table = torch.zeros((2, num_experts), dtype=torch.bool)
    host = table.numpy()
    host[0, group[ready]] = True
    host[1, group[~ready]] = True
    return table[:, flat]


def test_phase_rows_equal_the_gathered_table() -> None:
    rng = np.random.default_rng(1)
    for num_experts in (1, 4, 32, 128):
        moe = OffloadedMoE.__new__(OffloadedMoE)
        moe.num_experts = num_experts
        for _ in range(40):
            flat = torch.from_numpy(rng.integers(0, num_experts, int(rng.integers(1, 256))))
            routed = np.unique(flat.numpy())
            group = rng.choice(routed, int(rng.integers(1, routed.size + 1)), False)
            ready = rng.random(group.size) < rng.random()
            want = _phase_rows_by_gather(flat, group, ready, num_experts)
            got = moe._phase_rows(flat.numpy(), group, ready, torch.device("cpu"))
            assert got.dtype == want.dtype and torch.equal(got, want)
