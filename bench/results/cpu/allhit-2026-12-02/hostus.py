"""Host µs per all-hit ``OffloadedMoE.forward_routed`` call on the CPU (fp32),
min over rounds, at the published expert counts / top-k with a tiny hidden
size (64), so the host's dispatch and Python dominate; also the call's torch
dispatch count and its time outside the grouped MLP's ``forward``.

    PYTHONPATH=<an install of the version> python -P hostus.py qwen3_moe 16
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pdflash.h2d import H2DIssuer
from pdflash.models import load_adapter, write_synthetic_checkpoint

PRESETS = {"qwen3_moe": "qwen3-30b-a3b", "gpt_oss": "gpt-oss-20b"}


class _Count(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.n = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.n += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    arch, tokens = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    ov: dict[str, Any] = dict(
        hidden_size=64, vocab_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=16
    )
    if arch == "qwen3_moe":
        ov.update(moe_intermediate_size=32, intermediate_size=64)
    else:
        ov.update(intermediate_size=32)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_synthetic_checkpoint(
            Path(tmp) / arch,
            arch,
            PRESETS[arch],
            num_layers=1,
            dtype=torch.float32,
            config_overrides=ov,
        )
        issuer = H2DIssuer(backend="host", device=0)
        ad = load_adapter(
            path, device=torch.device("cpu"), dtype=torch.float32, issuer=issuer, cache_fraction=1.0
        )
        rt, cache = ad.runtime, ad.cache
        assert rt is not None and cache is not None
        cache.wait_ready(cache.prefetch(np.arange(cache.num_ids)))
        grouped: Any = rt.grouped
        inner = [0.0]
        forward = grouped.forward

        def timed_forward(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            out = forward(*a, **k)
            inner[0] += time.perf_counter() - t
            return out

        grouped.forward = timed_forward
        x = torch.randn(tokens, ad.hidden_size, generator=torch.Generator().manual_seed(1))
        with torch.inference_mode():
            x = ad.moe_norm(0, x)
            ids, w = ad.route(0, x)

            def call() -> Any:
                return rt.forward_routed(0, x, ids, w)

            for _ in range(50):
                call()
            total, outside = [], []
            for _ in range(9):
                inner[0] = 0.0
                n = 300
                t0 = time.perf_counter()
                for _ in range(n):
                    call()
                dt = (time.perf_counter() - t0) / n * 1e6
                total.append(dt)
                outside.append(dt - inner[0] / n * 1e6)
                cache.stats()  # the deferred accesses applied between rounds
            with _Count() as count:
                call()
        row = {
            "arch": arch,
            "tokens": tokens,
            "total_us_min": round(min(total), 1),
            "outside_mlp_us_min": round(min(outside), 1),
            "dispatches": count.n,
        }
        print(json.dumps(row))
        ad.close()
        issuer.close()


if __name__ == "__main__":
    main()
