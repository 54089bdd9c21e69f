"""Top-level aten ops and CPU time of one route-ahead union pass (the
drafter proxy, one 16-row block), batched (StackedRouters) and per layer, on
8-layer tiny bf16 checkpoints. CPU only: a count of dispatched ops, not a GPU
time. Usage: python bench/results/cpu/stacked-router-2026-12-05/ops.py"""

from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch
from torch.profiler import ProfilerActivity, profile

from pdflash.h2d import H2DIssuer
from pdflash.models import load_adapter, write_synthetic_checkpoint
from pdflash.protocols import DraftedBlock
from pdflash.routeahead import ApproxRouterPredictor


def _measure(predictor: ApproxRouterPredictor, blocks: list[DraftedBlock]) -> str:
    predictor.predict_batch(blocks)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        predictor.predict_batch(blocks)
    ops = [e for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None]
    t0 = time.perf_counter()
    for _ in range(200):
        predictor.predict_batch(blocks)
    per_call_us = (time.perf_counter() - t0) / 200 * 1e6
    return f"{len(ops)} top-level aten ops, {per_call_us:.0f} us"


def main() -> None:
    root = Path(tempfile.mkdtemp())
    issuer = H2DIssuer(backend="host")
    for arch in ("gpt_oss", "qwen3_moe"):
        path = write_synthetic_checkpoint(
            root / arch, arch, "tiny", dtype=torch.bfloat16, seed=1, num_layers=8
        )
        adapter = load_adapter(path, issuer=issuer, cache_slots=8, dtype=torch.bfloat16)
        predictor = ApproxRouterPredictor(adapter, proxy="drafter")
        hidden = torch.randn(16, adapter.hidden_size).to(torch.bfloat16)
        ids = torch.zeros(16, dtype=torch.long)
        blocks = [DraftedBlock(0, ids, torch.arange(16), drafter_hidden=hidden)]
        with torch.inference_mode():  # the router class's shortcut checked
            adapter.router_logits(0, adapter.moe_norm(0, hidden))
        result = {}
        for mode in ("stacked", "loop"):
            with contextlib.ExitStack() as patched:
                if mode == "loop":  # the per-layer loop: the adapter offers no batched pass
                    patched.enter_context(
                        mock.patch.object(
                            type(adapter), "router_logits_all", lambda self, hidden: None
                        )
                    )
                result[mode] = _measure(predictor, blocks)
        print(arch, "layers", adapter.num_layers, result)
    issuer.close()


if __name__ == "__main__":
    main()
