"""On CUDA, in bfloat16 (the served dtype): the router logits without the
router's routing equal the router's forward bit for bit, and the next-layer
lookahead's predictions equal the old path's (skips without CUDA)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pdflash.models.adapters import base as adapter_base
from pdflash.routeahead import NextLayerLookahead

pytestmark = pytest.mark.gpu

ARCHS = {"qwen3_moe": "num_experts", "gpt_oss": "num_local_experts"}


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_router_logits_and_lookahead_on_cuda_bf16(
    tmp_path: Path, arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdflash.models import load_adapter, write_synthetic_checkpoint

    path = write_synthetic_checkpoint(
        tmp_path / arch,
        arch,
        "tiny",
        num_layers=4,
        dtype=torch.bfloat16,
        seed=3,
        config_overrides={ARCHS[arch]: 32, "num_experts_per_tok": 4},
    )
    adapter = load_adapter(path, device="cuda", dtype=torch.bfloat16)
    look = NextLayerLookahead(adapter)
    gen = torch.Generator().manual_seed(0)
    hidden = int(adapter.config.hidden_size)
    cases = []
    for rows in (1, 2, 16):
        for layer in range(adapter.num_layers - 1):
            x = torch.randn(rows, hidden, generator=gen).to("cuda", torch.bfloat16)
            with torch.no_grad():
                normed = adapter.moe_norm(layer + 1, x)
                got = adapter.router_logits(layer + 1, normed)
                want = adapter._block(layer + 1).route(normed)[0]
                assert got.dtype == want.dtype == torch.bfloat16
                assert torch.equal(got, want)
                cases.append((layer, x, look.predict_next(layer, x)))
    with monkeypatch.context() as m:  # the old path: the router's whole forward
        m.setattr(adapter_base, "router_logits_only", lambda router, x: None)
        for layer, x, (ids, scores) in cases:
            with torch.no_grad():
                old_ids, old_scores = look.predict_next(layer, x)
            # index_add_ on CUDA adds with atomics: up to 2 tokens per expert
            # the sum does not depend on their order (bit for bit)
            if x.shape[0] <= 2:
                np.testing.assert_array_equal(ids, old_ids)
                np.testing.assert_array_equal(scores, old_scores)
            else:
                np.testing.assert_array_equal(np.sort(ids), np.sort(old_ids))
                np.testing.assert_allclose(
                    np.sort(scores), np.sort(old_scores), rtol=1e-6, atol=1e-7
                )
