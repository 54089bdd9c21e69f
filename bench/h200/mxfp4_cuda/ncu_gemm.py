"""The library's CUDA MXFP4 GEMM at gpt-oss-20b's expert MLP shape: the two
projections (gate_up with the clamped SwiGLU, down) per variant and token
count, each timed alone (CUDA events around ``--iters`` calls, after warm-up
calls), one JSON line per (variant, tokens). Each point also launches its two
projections once inside an NVTX range named ``ncu``: a target for Nsight
Compute's per-kernel counters, e.g.

    ncu --nvtx --nvtx-include 'ncu/' --section SpeedOfLight \\
        python3 -P bench/h200/mxfp4_cuda/ncu_gemm.py --tokens 256 --variants 10

Synthetic weights (random codes, scale bytes 118..130), random routing; the
HBM roofline of the weights' bytes is from the engine rows' copy probe
(:func:`pdflash.engine.roofline.measure_hbm_gbps`). ``--weights aliased``
makes every expert's slab entry the same expert (slot stride 0): the same
grid, tiles and instructions, but 8.3 + 4.1 MB of weights that stay in L2,
so the time says what the kernel takes when HBM is out of the way (its
roofline figures are then only the distinct case's, for comparison).
``--layouts natural,chunk_major`` also times each variant on a chunk-major
copy of the blocks (per slot ``[K/128][N][64]``: each 128-k chunk of a CTA's
consecutive rows one contiguous run instead of 64-byte pieces 1440 bytes
apart; launched through the native seam with ``stride_wc = N * 64``), in the
same interleaved rounds; its outputs must equal the natural layout's bit for
bit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

from pdflash.engine.roofline import measure_hbm_gbps
from pdflash.models import compressed_gemm
from pdflash.models import mxfp4_cuda_gemm as cg
from pdflash.models.fused_moe_triton import SlabWeight
from pdflash.models.mxfp4_cuda_gemm import ACT_GPTOSS, grouped_mxfp4_gemm, pick_variant

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mxfp4_sweep import us_per_call  # noqa: E402  (bench/h200)

HIDDEN, INTER, EXPERTS, TOP_K = 2880, 2880, 32, 4
ALPHA, LIMIT = 1.702, 7.0


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="256", help="token counts, comma-separated")
    ap.add_argument("--variants", default="", help="variant indices (default: the library's pick)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median is kept")
    ap.add_argument(
        "--layouts", default="natural",
        help="blocks layouts timed, comma-separated: natural, chunk_major",
    )  # fmt: skip
    ap.add_argument(
        "--weights", choices=("distinct", "aliased"), default="distinct",
        help="aliased: every slot reads expert 0's bytes (L2-resident weights)",
    )  # fmt: skip
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)

    def mx(n: int, k: int) -> SlabWeight:
        blocks = torch.randint(0, 256, (EXPERTS, n, k // 32, 16), generator=g, device=dev)
        scales = torch.randint(118, 131, (EXPERTS, n, k // 32), generator=g, device=dev)
        bias = (torch.randn(EXPERTS, n, generator=g, device=dev) * 0.1).bfloat16()
        blocks, scales = blocks.to(torch.uint8), scales.to(torch.uint8)
        if args.weights == "aliased":  # slot stride 0: every slot is expert 0
            blocks, scales, bias = (t[:1].expand_as(t) for t in (blocks, scales, bias))
        return SlabWeight("mxfp4", blocks, scales, bias)

    natural = {"gate_up": mx(2 * INTER, HIDDEN), "down": mx(HIDDEN, INTER)}
    kinds = {v.index: v.kind for v in cg.variants()}
    # kind-3 variants read the codes repacked, made once on first use (as a
    # slab holding them would be)
    repacked: dict[str, SlabWeight] = {}

    def weights(v: int, name: str) -> tuple[SlabWeight, str]:
        if kinds[v] != cg.KIND_WGMMA_RC:
            return natural[name], cg.CODES_NATURAL
        if name not in repacked:
            w = natural[name]
            src = w.data[:1] if args.weights == "aliased" else w.data
            repacked[name] = dataclasses.replace(w, data=cg.repack_codes(src).expand_as(w.data))
        return repacked[name], cg.CODES_REPACKED

    layouts = [lay for lay in args.layouts.split(",") if lay]
    if not set(layouts) <= {"natural", "chunk_major"}:
        raise SystemExit(f"unknown --layouts {args.layouts!r}")
    if args.weights == "aliased" and "chunk_major" in layouts:
        raise SystemExit("--weights aliased times the natural layout only")
    # the chunk-major copies (blocks, stride_ws, stride_wn, stride_wc), per weights tensor
    tiled: dict[int, tuple[torch.Tensor, int, int, int]] = {}

    def chunk_major(blocks: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
        if blocks.data_ptr() not in tiled:
            tiled[blocks.data_ptr()] = cg.chunk_major_blocks(blocks)
        return tiled[blocks.data_ptr()]

    def gemm(v: int, layout: str, name: str, x: torch.Tensor, x_rows: torch.Tensor,
             tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor], block_m: int,
             act: int) -> torch.Tensor:  # fmt: skip
        w, codes = weights(v, name)
        gate_up = (0, 1, 2)
        if layout == "natural":
            return grouped_mxfp4_gemm(
                x, x_rows, tiles, block_m, w, act=act, gate_up=gate_up, alpha=ALPHA,
                limit=LIMIT, variant=v, codes=codes,
            )  # fmt: skip
        mod = cg.native()
        blocks, ws, wn, wc = chunk_major(w.data)
        n_out = w.n // 2 if act else w.n
        out = torch.empty(x_rows.numel(), n_out, dtype=torch.bfloat16, device=x.device)
        slot, start, end = tiles
        assert w.bias is not None
        rc = mod.launch(
            v, x.data_ptr(), x.stride(0), x_rows.data_ptr(), blocks.data_ptr(), ws, wn, wc,
            w.scale.data_ptr(), w.scale.stride(0), w.scale.stride(1), 1,
            w.bias.data_ptr(), w.bias.stride(0), out.data_ptr(), out.stride(0),
            slot.data_ptr(), start.data_ptr(), end.data_ptr(), int(slot.numel()),
            block_m, w.n, w.k, n_out, act, *(gate_up if act else (0, 0, 1)), ALPHA, LIMIT,
            mod.OUT_NATURAL, torch.cuda.current_stream().cuda_stream,
        )  # fmt: skip
        if rc != mod.OK:
            raise SystemExit(f"chunk-major launch of variant {v}: {mod.error_string(rc)}")
        return out

    hbm = measure_hbm_gbps(dev)
    if isinstance(hbm, str):
        raise SystemExit(f"no HBM roofline: {hbm}")
    per_row = {name: (w.data[0, 0].numel() + w.scale[0, 0].numel()) for name, w in natural.items()}
    for tokens in _ints(args.tokens):
        x = torch.randn(tokens, HIDDEN, generator=g, device=dev).bfloat16()
        ids = torch.rand(tokens, EXPERTS, generator=g, device=dev).topk(TOP_K, dim=1).indices
        key, order = ids.flatten().sort(stable=True)
        x_rows = (order // TOP_K).to(torch.int32)
        rows = key.numel()
        block_m = compressed_gemm.pick_block_m(rows, EXPERTS)
        tiles = compressed_gemm.tile_map(key, EXPERTS, block_m, EXPERTS)
        direct = torch.arange(rows, dtype=torch.int32, device=dev)
        active = int(key.unique().numel())
        out: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        variants = _ints(args.variants) or [pick_variant(block_m, dev)]
        arms = [(v, lay) for v in variants for lay in layouts]
        times: dict[tuple[int, str], dict[str, list[float]]] = {
            arm: {"gate_up": [], "down": []} for arm in arms
        }

        def run_gate_up(arm: tuple[int, str]) -> None:
            h = gemm(*arm, "gate_up", x, x_rows, tiles, block_m, ACT_GPTOSS)
            out.setdefault(arm, {})["h"] = h

        def run_down(arm: tuple[int, str]) -> None:
            out[arm]["y"] = gemm(*arm, "down", out[arm]["h"], direct, tiles, block_m, 0)

        for arm in arms:
            for _ in range(3):
                run_gate_up(arm)
                run_down(arm)
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push("ncu")
            run_gate_up(arm)
            run_down(arm)
            torch.cuda.nvtx.range_pop()
            torch.cuda.synchronize()
        # (every slot is live and the tile map covers every row: whole outputs compare)
        for v, lay in arms:
            if lay != "natural" and (v, "natural") in out:
                for part in ("h", "y"):
                    a, b = out[(v, lay)][part], out[(v, "natural")][part]
                    if not torch.equal(a.view(torch.int16), b.view(torch.int16)):
                        raise SystemExit(f"variant {v} {lay}: {part} differs from natural")
        for rnd in range(args.rounds):
            for arm in arms[rnd % len(arms) :] + arms[: rnd % len(arms)]:
                times[arm]["gate_up"].append(us_per_call(lambda a=arm: run_gate_up(a), args.iters))
                times[arm]["down"].append(us_per_call(lambda a=arm: run_down(a), args.iters))
        for v, lay in arms:
            row: dict[str, object] = {
                "variant": v, "layout": lay, "tokens": tokens, "rows": rows, "block_m": block_m,
                "active_experts": active, "hbm_gbps": hbm, "iters": args.iters,
                "synthetic": True, "weights": args.weights,
            }  # fmt: skip
            for name, n in (("gate_up", 2 * INTER), ("down", HIDDEN)):
                ts = times[(v, lay)][name]
                us = sorted(ts)[len(ts) // 2]
                roof = active * n * per_row[name] / (hbm * 1e9) * 1e6
                row[f"{name}_us"] = us
                row[f"{name}_rounds_us"] = ts
                row[f"{name}_roofline_us"] = roof
                row[f"{name}_over_roofline"] = us / roof
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
