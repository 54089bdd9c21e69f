"""Route-ahead predictors on CUDA tensors agree with the CPU run (skips without CUDA)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pdflash.protocols import DraftedBlock
from pdflash.routeahead import (
    ApproxRouterPredictor,
    NextLayerLookahead,
    RouteAheadStats,
    predict_batch,
)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("proxy", ["embed", "block_attention"])
def test_predictions_on_cuda_match_cpu(tmp_path: Path, arch: str, proxy: str) -> None:
    from pdflash.models import load_adapter, write_synthetic_checkpoint

    key = "num_experts" if arch == "qwen3_moe" else "num_local_experts"
    path = write_synthetic_checkpoint(
        tmp_path / arch,
        arch,
        "tiny",
        num_layers=4,
        dtype=torch.float32,
        seed=3,
        config_overrides={key: 64, "num_experts_per_tok": 2},
    )
    cpu = load_adapter(path, dtype=torch.float32)
    gpu = load_adapter(path, device="cuda", dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    blocks = [torch.randint(3, 128, (16,), generator=gen) for _ in range(4)]

    def run(adapter: object, device: str) -> np.ndarray:
        predictor = ApproxRouterPredictor(adapter, proxy=proxy)  # type: ignore[arg-type]
        drafted = [
            DraftedBlock(i, ids.to(device), torch.arange(16, device=device))
            for i, ids in enumerate(blocks)
        ]
        return predict_batch(predictor, drafted)

    on_cpu, on_gpu = run(cpu, "cpu"), run(gpu, "cuda")
    assert on_gpu.shape == on_cpu.shape == (4, 4, 64)
    # float32 on both; a near-tie may flip one top-k choice, nothing more
    differ = int(((on_gpu > 0) != (on_cpu > 0)).sum())
    assert differ <= max(2, int(0.01 * (on_cpu > 0).sum())), differ
    np.testing.assert_allclose(on_gpu, on_cpu, atol=0.05)

    look_cpu, look_gpu = NextLayerLookahead(cpu), NextLayerLookahead(gpu)
    hidden = cpu.embed(blocks[0])
    ids_cpu, _ = look_cpu.predict_next(0, hidden)
    ids_gpu, scores_gpu = look_gpu.predict_next(0, hidden.to("cuda"))
    assert ids_gpu.dtype == np.int64 and scores_gpu.dtype == np.float32
    assert ((ids_gpu // 64) == 1).all()
    assert len(set(ids_cpu.tolist()) ^ set(ids_gpu.tolist())) <= 2

    stats = RouteAheadStats.for_adapter(gpu)
    stats.update(on_gpu > 0, on_cpu > 0)
    assert stats.snapshot().requests == 4
    cpu.close()
    gpu.close()
