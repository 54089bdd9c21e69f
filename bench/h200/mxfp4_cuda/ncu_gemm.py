"""The library's CUDA MXFP4 GEMM at gpt-oss-20b's expert MLP shape, the two
projections (gate_up with the clamped SwiGLU, down) at one token count, each
launched once inside an NVTX range named ``ncu`` after warm-up calls: a target
for Nsight Compute's per-kernel counters, e.g.

    ncu --nvtx --nvtx-include 'ncu/' --section SpeedOfLight \\
        python3 -P bench/h200/mxfp4_cuda/ncu_gemm.py --tokens 256

Synthetic weights (random codes, scale bytes 118..130), random routing.
Without ncu it prints each projection's µs (CUDA events, 20 calls).
"""

from __future__ import annotations

import argparse

import torch

from pdflash.models import compressed_gemm
from pdflash.models.fused_moe_triton import SlabWeight
from pdflash.models.mxfp4_cuda_gemm import ACT_GPTOSS, grouped_mxfp4_gemm

HIDDEN, INTER, EXPERTS, TOP_K = 2880, 2880, 32, 4
ALPHA, LIMIT = 1.702, 7.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--variant", type=int, default=None, help="default: the library's pick")
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)

    def mx(n: int, k: int) -> SlabWeight:
        blocks = torch.randint(0, 256, (EXPERTS, n, k // 32, 16), generator=g, device=dev)
        scales = torch.randint(118, 131, (EXPERTS, n, k // 32), generator=g, device=dev)
        bias = (torch.randn(EXPERTS, n, generator=g, device=dev) * 0.1).bfloat16()
        return SlabWeight("mxfp4", blocks.to(torch.uint8), scales.to(torch.uint8), bias)

    gate_up, down = mx(2 * INTER, HIDDEN), mx(HIDDEN, INTER)
    x = torch.randn(args.tokens, HIDDEN, generator=g, device=dev).bfloat16()
    ids = torch.rand(args.tokens, EXPERTS, generator=g, device=dev).topk(TOP_K, dim=1).indices
    key, order = ids.flatten().sort(stable=True)
    x_rows = (order // TOP_K).to(torch.int32)
    rows = key.numel()
    block_m = compressed_gemm.pick_block_m(rows, EXPERTS)
    tiles = compressed_gemm.tile_map(key, EXPERTS, block_m, EXPERTS)
    direct = torch.arange(rows, dtype=torch.int32, device=dev)

    def step() -> torch.Tensor:
        h = grouped_mxfp4_gemm(
            x, x_rows, tiles, block_m, gate_up, act=ACT_GPTOSS, gate_up=(0, 1, 2),
            alpha=ALPHA, limit=LIMIT, variant=args.variant,
        )  # fmt: skip
        return grouped_mxfp4_gemm(h, direct, tiles, block_m, down, variant=args.variant)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("ncu")
    step()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        step()
    end.record()
    end.synchronize()
    tiles_live = int((tiles[0] >= 0).sum())
    print(
        f"tokens {args.tokens} rows {rows} block_m {block_m} live tiles {tiles_live}: "
        f"{start.elapsed_time(end) * 1e3 / 20:.1f} us per MLP (both projections)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
