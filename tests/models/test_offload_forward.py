"""OffloadedMoE.forward_routed against hand-computed outputs: several experts
per token, routing weights, and a cache smaller than one layer's experts (so
the layer runs in groups, waiting on real copies)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import numpy.typing as npt
import pytest
import torch

from pdflash.cache import ExpertCache
from pdflash.h2d import H2DIssuer
from pdflash.models.offload import OffloadedMoE

H = 2


class ScaleExperts:
    """Host experts whose weights are ``H`` floats equal to ``g + 1``: expert
    ``g`` multiplies its tokens by ``g + 1``."""

    def __init__(self, num_layers: int, num_experts: int) -> None:
        self.num_layers, self.num_experts = num_layers, num_experts
        self.expert_nbytes = 4 * H
        n = num_layers * num_experts
        self.values = np.repeat(np.arange(1, n + 1, dtype=np.float32)[:, None], H, axis=1)

    def host_ptrs(self, flat_ids: npt.ArrayLike) -> npt.NDArray[np.int64]:
        ids = np.asarray(flat_ids, dtype=np.int64)
        return self.values.ctypes.data + ids * self.expert_nbytes


def _moe(num_slots: int) -> tuple[OffloadedMoE, ExpertCache, H2DIssuer]:
    src = ScaleExperts(2, 4)
    issuer = H2DIssuer(backend="host")
    issuer.register_source(src.values.ctypes.data, src.values.nbytes)  # a valid copy source
    cache = ExpertCache(src, issuer, num_slots=num_slots, top_k=2, max_batch_tokens=1)
    store = SimpleNamespace(
        expert_nbytes=src.expert_nbytes,
        num_experts=src.num_experts,
        layout=SimpleNamespace(views=lambda t: {"w": t.view(torch.float32)}),
    )
    moe = OffloadedMoE(store, cache, lambda x, w: x * w["w"])  # type: ignore[arg-type]
    return moe, cache, issuer


@pytest.mark.parametrize("num_slots", [2, 8])
def test_forward_routed_hand_computed(num_slots: int) -> None:
    moe, cache, issuer = _moe(num_slots)
    try:
        x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
        ids = torch.tensor([[0, 1], [2, 3], [1, 3]])
        weights = torch.tensor([[0.5, 0.25], [1.0, 2.0], [0.1, 0.2]])
        # layer 1 experts are flat ids 4..7, scaling by 5..8:
        # token 0: 0.5*5 + 0.25*6 = 4; token 1: 1*7 + 2*8 = 23; token 2: 0.1*6 + 0.2*8 = 2.2
        expected = torch.tensor([[4.0, 8.0], [69.0, 92.0], [11.0, 13.2]])
        out = moe.forward_routed(1, x, ids, weights)
        torch.testing.assert_close(out, expected)
        assert cache.copies == 4 and int(cache.pins.sum()) == 0
        # again, with whatever the cache kept: the same output
        torch.testing.assert_close(moe.forward_routed(1, x, ids, weights), expected)
        # layer 0 (scales 1..4), one expert per token
        out0 = moe.forward_routed(0, x, torch.tensor([[3], [0], [3]]), torch.ones(3, 1))
        torch.testing.assert_close(out0, x * torch.tensor([[4.0], [1.0], [4.0]]))
        assert int(cache.pins.sum()) == 0
    finally:
        issuer.close()


def test_forward_routed_dtype_and_empty_batch() -> None:
    moe, _, issuer = _moe(2)
    try:
        empty = moe.forward_routed(
            0, torch.zeros(0, H), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2)
        )
        assert empty.shape == (0, H)
        # bfloat16 activations with float32 weights: the output keeps x's dtype
        x = torch.tensor([[1.0, 2.0]], dtype=torch.bfloat16)
        moe.expert_fn = lambda x, w: x * w["w"].to(x.dtype)
        out = moe.forward_routed(0, x, torch.tensor([[0, 1]]), torch.tensor([[0.5, 0.5]]))
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, torch.tensor([[1.5, 3.0]], dtype=torch.bfloat16))
    finally:
        issuer.close()
