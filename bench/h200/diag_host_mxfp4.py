"""One-off H200 diagnostics (session of 2026-12-01), JSON lines on stdout.

1. Where the Triton MXFP4 dequantizer and the torch path disagree on CUDA
   (every byte x every scale byte, per output dtype): counts and the first
   mismatches (scale byte, block byte, both values).
2. One expert's MLP on the host CPU in torch, with the weight stored
   [in, out] (pdflash's packed layout: ``x @ w``) vs [out, in] (``x @ w.t()``,
   the layout of the H200 compute probe), bf16 and fp32, at the thread counts the
   hybrid service uses, gpt-oss-20b and Qwen3-30B-A3B expert shapes.
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.nn.functional as F


def mxfp4_mismatches() -> None:
    from pdflash.models.layout import dequantize_mxfp4_torch
    from pdflash.models.mxfp4_triton import dequantize_mxfp4_triton

    dev = torch.device("cuda")
    blocks = torch.arange(256, dtype=torch.uint8, device=dev).view(1, 16, 16).repeat(256, 1, 1)
    scales = torch.arange(256, dtype=torch.uint8, device=dev).view(256, 1).repeat(1, 16)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = dequantize_mxfp4_triton(blocks, scales, dtype).float()
        want = dequantize_mxfp4_torch(blocks, scales, dtype).float()
        same = (got == want) | (got.isnan() & want.isnan())
        same &= got.signbit() == want.signbit()
        bad = (~same).nonzero()
        rows = sorted({int(r) for r in bad[:, 0].tolist()})
        first = [
            {
                "scale": int(r),
                "col": int(c),
                "triton": float(got[r, c]),
                "torch": float(want[r, c]),
            }
            for r, c in bad[:8].tolist()
        ]
        print(
            json.dumps(
                {
                    "mxfp4_dtype": str(dtype),
                    "mismatches": int(bad.shape[0]),
                    "scale_bytes_with_mismatch": rows[:40],
                    "first": first,
                }
            ),
            flush=True,
        )


def _mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, i: int) -> torch.Tensor:
    h = x @ w1
    return (F.silu(h[:, :i]) * h[:, i:]) @ w2


def _time_us(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, i: int) -> float:
    for _ in range(3):
        _mlp(x, w1, w2, i)
    n = 10
    t0 = time.perf_counter()
    for _ in range(n):
        _mlp(x, w1, w2, i)
    return (time.perf_counter() - t0) / n * 1e6


def host_expert_layouts() -> None:
    for threads in (14, os.cpu_count() or 16):
        torch.set_num_threads(threads)
        for name, h, i in (("gpt-oss-20b", 2880, 2880), ("qwen3-30b-a3b", 2048, 768)):
            for dt in (torch.bfloat16, torch.float32):
                w1_out_in = torch.randn(2 * i, h, dtype=dt) * 0.02
                w2_out_in = torch.randn(h, i, dtype=dt) * 0.02
                layouts = {
                    # pdflash's packed layout: [in, out] contiguous, x @ w
                    "in_out": (w1_out_in.t().contiguous(), w2_out_in.t().contiguous()),
                    # the H200 compute probe's layout: [out, in] contiguous, x @ w.t()
                    "out_in": (w1_out_in.t(), w2_out_in.t()),
                }
                for t in (1, 4, 16):
                    x = torch.randn(t, h, dtype=dt)
                    for label, (w1, w2) in layouts.items():
                        us = _time_us(x, w1, w2, i)
                        row = {
                            "host_expert": name,
                            "dtype": str(dt),
                            "threads": threads,
                            "tokens": t,
                            "layout": label,
                            "us": round(us, 1),
                        }
                        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    try:
        mxfp4_mismatches()
    except Exception as exc:  # report and go on to the host part
        print(json.dumps({"mxfp4_error": f"{type(exc).__name__}: {exc}"}), flush=True)
    host_expert_layouts()
