"""The fused MXFP4 expert MLP (gate_up with gpt-oss's clamped SwiGLU, then
down; ``pdflash.models.fused_moe_triton.grouped_qgemm``) on gpt-oss-20b's
expert shape, over a grid of kernel variants x tile configs x token counts:
which orientation and tiles read the MXFP4 bytes fastest (issue 13's
"<= 2x the roofline" for the compressed slab).

Variants: ``registers`` / ``scaled`` (MXFP4 values built in registers then
``tl.dot``, or ``tl.dot_scaled``).
Each (variant, config) runs alone (the autotuner handed one config), every
point checked against a dequantized fp32 reference of the same routed rows.

Synthetic: random e2m1 bytes, scale bytes 118..130, random routing (top-4 of
32 experts, every expert active at 16+ tokens), bf16 activations. Timing:
CUDA events around ``--iters`` back-to-back calls, the median of
``--rounds`` rounds; the roofline reads the active experts' MXFP4 bytes
(blocks + scales + biases) once at the HBM copy rate measured in the same
process (``pdflash.engine.roofline.measure_hbm_gbps``).

``--compile-only --shard I/N``: compile this shard's combinations and exit
(run N at once to compile in parallel; the timing run then reads Triton's
cache). ``--smoke``: a tiny shape on the CPU under ``TRITON_INTERPRET=1``
(set it in the environment), each point checked, nothing timed: a local
check of this script. One JSON object on stdout's last line (``--json``)."""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from typing import Any

import torch

HIDDEN, INTER, EXPERTS, TOP_K = 2880, 2880, 32, 4
ALPHA, LIMIT = 1.702, 7.0
VARIANTS = ("registers", "scaled")
CONFIGS = "32:64:2:3,64:64:2:3,32:128:2:3,32:64:4:3,64:64:4:3,128:64:4:3,64:64:8:3,64:128:8:3"


def _slab(g: torch.Generator, dev: torch.device) -> dict[str, torch.Tensor]:
    def mx(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = torch.randint(0, 256, (EXPERTS, n, k // 32, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(118, 131, (EXPERTS, n, k // 32), generator=g, dtype=torch.uint8)
        return blocks.to(dev), scales.to(dev)

    gu_b, gu_s = mx(2 * INTER, HIDDEN)
    dn_b, dn_s = mx(HIDDEN, INTER)
    return {
        "gate_up_blocks": gu_b,
        "gate_up_scales": gu_s,
        "gate_up_bias": (torch.randn(EXPERTS, 2 * INTER, generator=g) * 0.1).bfloat16().to(dev),
        "down_blocks": dn_b,
        "down_scales": dn_s,
        "down_bias": (torch.randn(EXPERTS, HIDDEN, generator=g) * 0.1).bfloat16().to(dev),
    }


def _routing(
    g: torch.Generator, tokens: int, dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows sorted by expert: (expert key per row, token per row)."""
    experts = torch.rand(tokens, EXPERTS, generator=g).topk(TOP_K, dim=1).indices.flatten()
    order = torch.argsort(experts, stable=True)
    return experts[order].to(torch.int32).to(dev), (order // TOP_K).to(torch.int32).to(dev)


def _reference(
    x: torch.Tensor, key: torch.Tensor, x_rows: torch.Tensor, slab: dict[str, torch.Tensor]
) -> torch.Tensor:
    from pdflash.models.layout import dequantize_mxfp4_torch

    out = torch.empty(key.numel(), HIDDEN, device=x.device)
    for e in key.unique().tolist():
        rows = (key == e).nonzero().flatten()
        xe = x[x_rows[rows].long()].float()
        gu = dequantize_mxfp4_torch(
            slab["gate_up_blocks"][e], slab["gate_up_scales"][e], torch.float32
        )
        h = xe @ gu.T + slab["gate_up_bias"][e].float()
        gate, up = h[:, ::2].clamp(max=LIMIT), h[:, 1::2].clamp(-LIMIT, LIMIT)
        a = (up + 1) * (gate * torch.sigmoid(gate * ALPHA))
        a = a.bfloat16().float()  # the kernel writes the activation in bf16
        dn = dequantize_mxfp4_torch(slab["down_blocks"][e], slab["down_scales"][e], torch.float32)
        out[rows] = a @ dn.T + slab["down_bias"][e].float()
    return out


def _active_bytes(key: torch.Tensor, slab: dict[str, torch.Tensor]) -> int:
    per_expert = sum(int(t[0].numel()) * t.element_size() for t in slab.values())
    return per_expert * int(key.unique().numel())


def _mlp(
    k: Any,
    gate_up: Any,
    down: Any,
    x: torch.Tensor,
    x_rows: torch.Tensor,
    tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    block_m: int,
    rows: torch.Tensor,
    dot: str,
) -> torch.Tensor:
    h = k.grouped_qgemm(
        x, x_rows, tiles, block_m, gate_up, act=k.ACT_GPTOSS, gate_up=(0, 1, 2), alpha=ALPHA,
        limit=LIMIT, mxfp4_dot=dot,
    )  # fmt: skip
    out: torch.Tensor = k.grouped_qgemm(h, rows, tiles, block_m, down, mxfp4_dot=dot)
    return out


def us_per_call(fn: Any, iters: int) -> float:
    """One round: ``iters`` back-to-back calls of ``fn`` between two CUDA
    events, µs a call (no warm-up: callers that interleave rounds of
    several functions warm up once themselves)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) * 1e3 / iters


def _timed(fn: Any, iters: int, rounds: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    return statistics.median(us_per_call(fn, iters) for _ in range(rounds))


def add_run_arguments(ap: argparse.ArgumentParser) -> None:
    """The options a grid run shares with ``mxfp4_tma_probe.py`` (each adds
    its own ``--variants`` and ``--configs``)."""
    ap.add_argument("--tokens", default="16,64,256")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--shard", default="0/1", help="I/N: this process's share of the grid")
    ap.add_argument("--budget-s", type=float, default=300.0, help="no new point after this")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--smoke", action="store_true")


def parse_block_ms(text: str) -> list[int | None]:
    """``--block-m``: ``auto`` (None: the library's pick) and/or powers of
    two in 16..128 (tl.dot's smallest M is 16), a clear error on anything
    else."""
    out: list[int | None] = []
    for item in text.split(","):
        if item == "auto":
            out.append(None)
        elif item.isdigit() and int(item) in (16, 32, 64, 128):
            out.append(int(item))
        else:
            raise SystemExit(f"--block-m: {item!r} is not auto, 16, 32, 64 or 128")
    return out


def slab_weights(k: Any, slab: dict[str, torch.Tensor]) -> tuple[Any, Any]:
    """The slab's gate_up and down projections as ``k.SlabWeight`` (``k``
    the fused kernel module)."""
    return tuple(
        k.SlabWeight("mxfp4", slab[f"{n}_blocks"], slab[f"{n}_scales"], slab[f"{n}_bias"])
        for n in ("gate_up", "down")
    )


def shard_of(grid: list[Any], shard: str) -> list[Any]:
    """Shard ``I/N``'s share of ``grid`` (every N-th point from the I-th)."""
    i, n = (int(v) for v in shard.split("/"))
    return grid[i::n]


def measure(
    point: dict[str, Any],
    mlp: Any,
    want: torch.Tensor | None,
    timed: bool,
    args: argparse.Namespace,
    hbm: object,
    nbytes: int,
) -> None:
    """Run ``mlp`` once, put its error against ``want`` (relative to the
    largest output) into ``point``, and where ``timed`` its µs per call and
    roofline ratio; a config that does not compile or fit records its error
    instead (the grid goes on)."""
    try:
        got = mlp()
        if want is not None:
            scale = max(1.0, float(want.abs().max()))
            point["max_rel_err"] = float((got.float() - want).abs().max()) / scale
        if want is not None and timed:
            us = _timed(mlp, args.iters, args.rounds)
            roof = nbytes / (float(hbm) * 1e9) * 1e6 if isinstance(hbm, float) else None
            point.update(us=us, roofline_us=roof, over_roofline=us / roof if roof else None)
    except Exception as exc:  # a config that does not compile or fit: say so, go on
        point["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    print(json.dumps(point), file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(ap)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--configs", default=CONFIGS, help="BLOCK_N:BLOCK_K:warps:stages,...")
    ap.add_argument(
        "--block-m",
        default="auto",
        help="row tiles to time, comma-separated: auto (pick_block_m, the library's) and/or "
        "16/32/64/128",
    )
    args = ap.parse_args(argv)
    block_ms = parse_block_ms(args.block_m)
    if args.smoke:
        global HIDDEN, INTER, EXPERTS, TOP_K
        HIDDEN, INTER, EXPERTS, TOP_K = 64, 64, 4, 2
        args.configs, args.compile_only = "32:64:4:1", False

    from pdflash.engine.roofline import measure_hbm_gbps
    from pdflash.models import fused_moe_triton as k
    from pdflash.models.compressed_gemm import pick_block_m

    dev = torch.device("cpu" if args.smoke else "cuda")
    t_start = time.monotonic()
    g = torch.Generator().manual_seed(0)
    slab = _slab(g, dev)
    gate_up, down = slab_weights(k, slab)
    configs = k.parse_configs(args.configs)
    grid = [(v, c) for v in args.variants.split(",") for c in configs]
    unknown = {v for v, _ in grid} - set(VARIANTS)
    if unknown:
        raise SystemExit(f"--variants: {sorted(unknown)} not among {VARIANTS}")
    grid = shard_of(grid, args.shard)
    hbm = None if args.compile_only or args.smoke else measure_hbm_gbps(dev)
    points = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(tokens, HIDDEN, generator=g).bfloat16().to(dev)
        key, x_rows = _routing(g, tokens, dev)
        auto_m = pick_block_m(int(key.numel()), EXPERTS)
        rows = torch.arange(key.numel(), dtype=torch.int32, device=dev)
        want = None if args.compile_only else _reference(x, key, x_rows, slab)
        nbytes = _active_bytes(key, slab)
        for block_m, variant, (bn, bk, warps, stages) in (
            (m, v, c) for m in dict.fromkeys(auto_m if b is None else b for b in block_ms)
            for v, c in grid
        ):  # fmt: skip
            if time.monotonic() - t_start > args.budget_s:
                break
            tiles = k.tile_map(key, EXPERTS, block_m, EXPERTS)
            dot = variant
            tuner = k._grouped_qgemm_kernel
            tuner.configs = [k._config(bn, bk, warps, stages)]
            tuner.cache.clear()

            mlp = functools.partial(_mlp, k, gate_up, down, x, x_rows, tiles, block_m, rows, dot)

            point: dict[str, Any] = {
                "variant": variant, "config": [bn, bk, warps, stages], "tokens": tokens,
                "block_m": block_m, "block_m_auto": block_m == auto_m,
            }  # fmt: skip
            measure(point, mlp, want, not args.smoke, args, hbm, nbytes)
            points.append(point)
    result = {
        "kind": "mxfp4_sweep",
        "synthetic": True,
        "shape": {"hidden": HIDDEN, "intermediate": INTER, "experts": EXPERTS, "top_k": TOP_K},
        "hbm_gbps": hbm,
        "compile_only": args.compile_only,
        "shard": args.shard,
        "wall_s": time.monotonic() - t_start,
        "points": points,
    }
    if not args.compile_only and not args.smoke:
        timed = [p for p in points if "us" in p]
        best: dict[str, Any] = {}
        for p in timed:
            key_t = str(p["tokens"])
            if p["max_rel_err"] < 2e-2 and (key_t not in best or p["us"] < best[key_t]["us"]):
                best[key_t] = p
        result["best_per_tokens"] = best
        for p in sorted(timed, key=lambda p: (p["tokens"], p["us"])):
            print(
                f"{p['tokens']:4d} tok m{p['block_m']:<4d}{p['variant']:15s} {p['config']!s:18s} "
                f"{p['us']:8.1f} us  x{p['over_roofline'] or 0:.2f} roof  err {p['max_rel_err']:.2e}",
                file=sys.stderr,
            )
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
