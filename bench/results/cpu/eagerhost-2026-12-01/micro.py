"""Micro-timings of the two CPU-visible cuts, before (the device-side code
they replaced, inlined here) and after, interleaved: the gate lookahead's
``predict_next`` and a layer's routed counts. Median µs per call.

    python -P bench/results/cpu/eagerhost-2026-12-01/micro.py > micro.json
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pdflash.models import load_adapter, write_synthetic_checkpoint
from pdflash.models.offload import routed_ids_on_host
from pdflash.routeahead import NextLayerLookahead
from pdflash.routeahead.predictors import _topk_gate_scores


def predict_next_before(look: NextLayerLookahead, layer: int, hidden: torch.Tensor) -> Any:
    ad: Any = look.adapter
    e, nxt = ad.num_experts, layer + 1
    with torch.inference_mode():
        logits = ad.router_logits(nxt, ad.moe_norm(nxt, hidden))
        ids, probs = _topk_gate_scores(logits, look.experts_per_token, e)
        scores = torch.zeros(e, dtype=torch.float32, device=hidden.device)
        scores.index_add_(0, ids.reshape(-1), probs.reshape(-1))
        order = torch.argsort(scores, descending=True, stable=True)
        order = order[scores[order] > 0]
        return (order + nxt * e).cpu().numpy(), scores[order].cpu().numpy()


def counts_before(num_experts: int, topk: torch.Tensor) -> Any:
    flat = topk.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    return counts.index_add_(0, flat, torch.ones_like(flat)).cpu().numpy()


def counts_after(num_experts: int, topk: torch.Tensor) -> Any:
    # a fresh tensor each call (the clone), so the shared read's memo never hits
    return np.bincount(routed_ids_on_host(topk.clone()), minlength=num_experts)


def median_us(fn: Callable[[], Any], n: int = 400) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    out: dict[str, dict[str, float]] = {}
    shapes = (("gpt_oss", "num_local_experts", 32, 4), ("qwen3_moe", "num_experts", 128, 8))
    with tempfile.TemporaryDirectory() as tmp:
        for arch, key, experts, k in shapes:
            path = write_synthetic_checkpoint(
                f"{tmp}/{arch}",
                arch,
                "tiny",
                num_layers=2,
                dtype=torch.float32,
                config_overrides={key: experts, "num_experts_per_tok": k},
            )
            adapter: Any = load_adapter(path, device="cpu")
            look = NextLayerLookahead(adapter)
            for rows in (2, 256):
                hidden = torch.randn(rows, adapter.hidden_size)
                topk = torch.stack([torch.randperm(experts)[:k] for _ in range(rows)])
                fns: dict[str, Callable[[], Any]] = {
                    "predict_next_before": lambda: predict_next_before(look, 0, hidden),  # noqa: B023
                    "predict_next_after": lambda: look.predict_next(0, hidden),  # noqa: B023
                    "counts_before": lambda: counts_before(experts, topk),  # noqa: B023
                    "counts_after": lambda: counts_after(experts, topk),  # noqa: B023
                }
                got: dict[str, list[float]] = {name: [] for name in fns}
                for _ in range(3):  # interleaved repeats
                    for name, fn in fns.items():
                        got[name].append(median_us(fn))
                out[f"{arch} rows={rows}"] = {
                    n: round(statistics.median(v), 1) for n, v in got.items()
                }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
