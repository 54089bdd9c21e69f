"""Prototype (bench only): the scaled MXFP4 grouped GEMM with its weight bytes
(and optionally its scales) loaded through TMA tensor descriptors, so that
Triton's Hopper pipeliner multi-buffers them in shared memory; timed against
the library's ``grouped_qgemm`` (``mxfp4_dot="scaled"``) on gpt-oss-20b's
expert MLP (issue 13: the library kernel's byte loads are not pipelined, its
best configs run at 2.7-4.4x the HBM roofline).

Same contract as :func:`pdflash.models.fused_moe_triton.grouped_qgemm` (tile
map, ``x_rows`` gather, bias, ``ACT_GPTOSS`` over gpt-oss's interleaved
gate/up rows ``0/1`` step 2, ``ACT_NONE`` for down), for those two column
layouts only. The slab's blocks ``[S, N, K/32, 16]`` are viewed without a copy
as ``[S, N/C, C, K/2]`` bytes (``C`` = 2 for gate/up, 1 for down): one box
``[1, BLOCK_N, 1, BLOCK_K/2]`` per K block and projection (gate at ``c = 0``,
up at ``c = 1``), so no split of interleaved rows is needed. Scales:

* ``plain`` (the slab's ``[S, N, K/32]``, no copy): ordinary loads. A TMA box
  of it would be ``BLOCK_K/32`` bytes wide, under TMA's 16-byte minimum, and
  its row pitch ``K/32`` bytes (90 at K = 2880) is not a multiple of 16.
* ``tma``: a relaid copy ``[S, C, K/32, N/C]`` (:func:`relayout_scales`; the
  store would have to pack this layout), boxes ``[1, 1, BLOCK_K/32, BLOCK_N]``.

TMA constraints (checked by :func:`check_tma_config`, clear errors):
``BLOCK_K`` a power of two in 32..512 (the byte box's inner extent
``BLOCK_K/2`` is 16..256 bytes: 16-byte multiple, at most 256 per box dim),
``BLOCK_N`` a power of two in 16..256 (the relaid scale box's inner extent
is ``BLOCK_N`` bytes); ``K % 32 == 0`` (row pitch ``K/2`` bytes, a 16-byte
multiple); for ``tma`` scales ``N/C % 16 == 0``. Out-of-range boxes read
zeros (TMA's fill): bytes past ``K`` are 0 codes, rows past ``N/C`` are
masked on the store.

``tl.dot_scaled`` has no interpreter implementation: under
``TRITON_INTERPRET=1`` the kernel (``EMULATE_DOT``) dequantizes the same
loaded bytes and scales in registers and uses an fp32 ``tl.dot``, so the
interpreter checks the descriptors, indexing and epilogue, and the GPU run
checks every timed point against a dequantized fp32 reference.

Synthetic inputs, routing, reference and roofline are
``bench/h200/mxfp4_sweep.py``'s (imported). Variants: ``lib`` (the library
kernel, ``--lib-configs``), ``tma`` (bytes by TMA, plain scales), ``tma_s``
(bytes and relaid scales by TMA), ``tma_x`` / ``tma_sx`` (the same with the
activations by TMA too: gate/up's ``x`` gathered into row order first, one
torch launch, timed with the MLP; down's input already is), each over ``--configs``
``BLOCK_N:BLOCK_K:warps:stages``. ``--compile-only --shard I/N`` compiles a
shard and exits; ``--smoke``: a tiny shape on the CPU under
``TRITON_INTERPRET=1`` (set it in the environment), every point checked,
nothing timed. One JSON object on stdout's last line (``--json``); a table
sorted per token count on stderr."""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from typing import Any

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mxfp4_sweep as sweep  # type: ignore[import-not-found]

from pdflash.models.fused_moe_triton import ACT_GPTOSS, ACT_NONE, SlabWeight
from pdflash.models.mxfp4_triton import e2m1_to_f32

PROBE_VARIANTS = ("tma", "tma_s", "tma_x", "tma_sx")
VARIANTS = ("lib", *PROBE_VARIANTS)
#: probe tiles: BLOCK_N x BLOCK_K x warps x stages (stages now matter: the
#: TMA loads are multi-buffered)
CONFIGS = (
    "32:128:4:3,32:128:4:4,64:128:4:3,64:128:4:4,32:256:4:3,64:256:4:3,"
    "32:128:2:4,64:64:4:4,128:128:4:3,64:128:8:3"
)
#: the library's sweep leaders (commit f07caff)
LIB_CONFIGS = "32:64:2:3,64:64:2:3,32:64:4:3,64:64:4:3"
#: (BLOCK_N, BLOCK_K, warps, stages) the compile test checks
DEFAULT_CONFIG = (32, 128, 4, 3)


def check_tma_config(n_rows: int, k: int, block_n: int, block_k: int, tma_scales: bool) -> None:
    """TMA's box and pitch rules for this kernel's views (module docstring);
    ``n_rows`` = output columns per projection (``N / C``)."""

    def pow2(v: int) -> bool:
        return v > 0 and v & (v - 1) == 0

    if not (pow2(block_k) and 32 <= block_k <= 512):
        raise ValueError(
            f"BLOCK_K={block_k}: the byte box's inner extent BLOCK_K/2 must be a power of two "
            "of 16..256 bytes (TMA: 16-byte multiple, <= 256 per box dim), so BLOCK_K in 32..512"
        )
    if not (pow2(block_n) and 16 <= block_n <= 256):
        raise ValueError(
            f"BLOCK_N={block_n}: a power of two in 16..256 (TMA box dim <= 256; the relaid "
            "scale box's inner extent is BLOCK_N bytes, >= 16)"
        )
    if k % 32:
        raise ValueError(f"K={k}: the byte rows' pitch K/2 must be a multiple of 16 bytes")
    if tma_scales and n_rows % 16:
        raise ValueError(
            f"{n_rows} output columns: the relaid scales' row pitch must be a multiple of "
            "16 bytes for TMA scales"
        )


def relayout_scales(scale: torch.Tensor, col_step: int) -> torch.Tensor:
    """Scales ``[S, N, K/32]`` as ``[S, C, K/32, N/C]`` (contiguous), ``C =
    col_step``: row ``n = j*C + c`` at ``[s, c, :, j]``, so a TMA box's inner
    extent runs over output columns (>= 16 bytes) instead of K groups."""
    s, n, g = scale.shape
    return scale.reshape(s, n // col_step, col_step, g).permute(0, 2, 3, 1).contiguous()


@triton.jit
def _mx_dot(xt, packed, scales, acc, EMULATE_DOT: tl.constexpr, BLOCK_K: tl.constexpr):
    """``acc + xt @ W^T`` for MXFP4 ``packed [BLOCK_N, BLOCK_K/2]`` (low
    nibble first) with e8m0 ``scales [BLOCK_N, BLOCK_K/32]``."""
    if EMULATE_DOT:  # the interpreter: no tl.dot_scaled; dequantize, fp32 dot
        codes = packed.to(tl.int32)
        vals = tl.reshape(tl.join(e2m1_to_f32(codes & 15), e2m1_to_f32(codes >> 4)), (
            packed.shape[0], BLOCK_K // 32, 32
        ))  # fmt: skip
        s = scales.to(tl.int32)
        scale = tl.where(s == 0, 0x00400000, s << 23).to(tl.float32, bitcast=True)
        w = tl.reshape(vals * scale[:, :, None], (packed.shape[0], BLOCK_K))
        out = tl.dot(xt.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
    else:
        out = tl.dot_scaled(xt, None, "bf16", tl.trans(packed), scales, "e2m1", acc, fast_math=True)
    return out


@triton.jit
def _scales_tile(
    sc_ptr, s_desc, slot, s_base, rows, row_live, n0, c: tl.constexpr, k0,
    stride_sn, stride_sk,
    KG: tl.constexpr, SCALES_TMA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``[BLOCK_N, BLOCK_K/32]`` scale bytes of rows ``rows`` (slab row
    ``n = j*C + c``) at K block ``k0``."""
    if SCALES_TMA:
        box = s_desc.load([slot, c, k0 // 32, n0])
        out = tl.trans(tl.reshape(box, (BLOCK_K // 32, BLOCK_N)))
    else:
        groups = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        out = tl.load(
            s_base + rows[:, None] * stride_sn + groups[None, :] * stride_sk,
            mask=row_live[:, None] & (groups[None, :] < KG),
            other=0,
        )
    return out


@triton.jit
def _tma_qgemm_kernel(
    x_ptr, x_rows_ptr, stride_xm, stride_xk, x_desc,
    w_desc,
    sc_ptr, stride_ss, stride_sn, stride_sk, s_desc,
    bias_ptr, stride_bs,
    out_ptr, stride_om,
    tile_slot_ptr, tile_start_ptr, tile_end_ptr,
    N, alpha, limit,
    K: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, SCALES_TMA: tl.constexpr,
    X_TMA: tl.constexpr, EMULATE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Program ``(t, n)``: tile ``t``'s rows times output columns ``n *
    BLOCK_N ..`` (``N`` of them per projection) of its slot; ``ACT`` != 0:
    gate at slab rows ``2j``, up at ``2j + 1`` (gpt-oss), else row ``j``.
    ``X_TMA``: the activations are rows ``start ..`` of ``x_desc`` (already
    in sorted row order: no gather), else gathered through ``x_rows``."""
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.load(tile_slot_ptr + pid_t)
    if slot < 0:  # past the last live tile
        return
    start = tl.load(tile_start_ptr + pid_t)
    end = tl.load(tile_end_ptr + pid_t)
    rows = start + tl.arange(0, BLOCK_M)
    row_live = rows < end
    x_rows = tl.load(x_rows_ptr + rows, mask=row_live, other=0).to(tl.int64)
    x_base = x_ptr + x_rows[:, None] * stride_xm

    n0 = pid_n * BLOCK_N
    j = n0 + tl.arange(0, BLOCK_N)
    j_live = j < N
    C: tl.constexpr = 2 if ACT != 0 else 1
    s_base = sc_ptr + slot.to(tl.int64) * stride_ss
    acc_g = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    acc_u = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if X_TMA:  # rows past the tile's end belong to the next tile: their outputs are masked
            xt = x_desc.load([start, k0]).to(tl.bfloat16)
        else:
            ks = k0 + tl.arange(0, BLOCK_K)
            x_live = row_live[:, None] & (ks[None, :] < K)
            xt = tl.load(x_base + ks[None, :] * stride_xk, mask=x_live, other=0.0).to(tl.bfloat16)
        packed = tl.reshape(w_desc.load([slot, n0, 0, k0 // 2]), (BLOCK_N, BLOCK_K // 2))
        sg = _scales_tile(
            sc_ptr, s_desc, slot, s_base, j * C, j_live, n0, 0, k0, stride_sn, stride_sk,
            K // 32, SCALES_TMA, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        acc_g = _mx_dot(xt, packed, sg, acc_g, EMULATE_DOT, BLOCK_K)
        if ACT != 0:
            packed = tl.reshape(w_desc.load([slot, n0, 1, k0 // 2]), (BLOCK_N, BLOCK_K // 2))
            su = _scales_tile(
                sc_ptr, s_desc, slot, s_base, j * C + 1, j_live, n0, 1, k0, stride_sn,
                stride_sk, K // 32, SCALES_TMA, BLOCK_N, BLOCK_K,
            )  # fmt: skip
            acc_u = _mx_dot(xt, packed, su, acc_u, EMULATE_DOT, BLOCK_K)

    if HAS_BIAS:
        b_base = bias_ptr + slot.to(tl.int64) * stride_bs
        acc_g += tl.load(b_base + j * C, mask=j_live, other=0.0).to(tl.float32)[None, :]
        if ACT != 0:
            acc_u += tl.load(b_base + j * C + 1, mask=j_live, other=0.0).to(tl.float32)[None, :]
    if ACT != 0:  # gpt-oss: clamped SwiGLU
        gate = tl.minimum(acc_g, limit)
        up = tl.minimum(tl.maximum(acc_u, -limit), limit)
        y = (up + 1.0) * (gate / (1.0 + tl.exp(-gate * alpha)))
    else:
        y = acc_g
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + j[None, :]
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=row_live[:, None] & j_live[None, :])


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def tma_grouped_qgemm(
    x: torch.Tensor,
    x_rows: torch.Tensor | None,
    tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    block_m: int,
    w: SlabWeight,
    config: tuple[int, int, int, int],
    *,
    act: int = ACT_NONE,
    gate_up: tuple[int, int, int] = (0, 0, 1),
    alpha: float = 1.0,
    limit: float = 0.0,
    scales_t: torch.Tensor | None = None,
    x_tma: bool = False,
) -> torch.Tensor:
    """``grouped_qgemm``'s contract (MXFP4, bf16 activations; ``ACT_GPTOSS``
    with ``gate_up=(0, 1, 2)`` or ``ACT_NONE``) through TMA descriptors, at
    one ``config`` (BLOCK_N, BLOCK_K, warps, stages). ``scales_t``: the
    :func:`relayout_scales` copy to load scales by TMA too (None: plain loads
    of ``w.scale``). ``x_rows`` None: ``x`` is already in sorted row order.
    ``x_tma``: activations by TMA too, over ``x`` in row order (gathered
    here through ``x_rows`` first, one torch launch, where given: Hopper's
    TMA has no row gather)."""
    w.check()
    if w.fmt != "mxfp4":
        raise ValueError("the TMA probe multiplies MXFP4 slab weights only")
    if act == ACT_GPTOSS and tuple(gate_up) == (0, 1, 2):
        col_step = 2
    elif act == ACT_NONE:
        col_step = 1
    else:
        raise ValueError("the TMA probe takes ACT_GPTOSS with gate_up=(0, 1, 2) or ACT_NONE")
    if x.dim() != 2 or x.shape[1] != w.k or x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"x must be bf16/fp32 [rows, {w.k}], got {x.dtype} {tuple(x.shape)}")
    if x_rows is not None and x_rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"x_rows must be int32 or int64, got {x_rows.dtype}")
    block_n, block_k, warps, stages = config
    s, n, kg, _ = w.data.shape
    if n % col_step:
        raise ValueError(f"{n} weight rows do not split into gate/up pairs")
    n_out = n // col_step
    check_tma_config(n_out, w.k, block_n, block_k, scales_t is not None)
    if not w.data.is_contiguous():
        raise ValueError("the TMA probe views the slab's blocks as contiguous [S, N/C, C, K/2]")
    blocks = w.data.view(s, n_out, col_step, kg * 16)
    w_desc = TensorDescriptor.from_tensor(blocks, [1, block_n, 1, block_k // 2])
    s_desc = None
    if scales_t is not None:
        if tuple(scales_t.shape) != (s, col_step, kg, n_out) or not scales_t.is_contiguous():
            raise ValueError("scales_t must be relayout_scales(w.scale, col_step)")
        s_desc = TensorDescriptor.from_tensor(scales_t, [1, 1, block_k // 32, block_n])
    if x_tma and x_rows is not None:
        x, x_rows = x.index_select(0, x_rows), None
    if x_rows is None:
        x_rows = torch.arange(x.shape[0], dtype=torch.int32, device=x.device)
    x_desc = None
    if x_tma:
        if block_k > 256 or block_m > 256 or (x.stride(0) * x.element_size()) % 16:
            raise ValueError(
                "TMA activations: BLOCK_K and BLOCK_M <= 256 (box dims) and a row pitch of a "
                "multiple of 16 bytes"
            )
        x_desc = TensorDescriptor.from_tensor(x, [block_m, block_k])
    n_rows = int(x_rows.numel())
    out = torch.empty((n_rows, n_out), dtype=x.dtype, device=x.device)
    slot, start, end = tiles
    if n_rows == 0 or slot.numel() == 0:
        return out
    bias = w.bias
    grid = (int(slot.numel()), triton.cdiv(n_out, block_n))
    _tma_qgemm_kernel[grid](
        x, x_rows, x.stride(0), x.stride(1), x_desc,
        w_desc,
        w.scale, w.scale.stride(0), w.scale.stride(1), w.scale.stride(2), s_desc,
        bias if bias is not None else w.scale, bias.stride(0) if bias is not None else 0,
        out, out.stride(0),
        slot, start, end,
        n_out, float(alpha), float(limit),
        K=w.k, ACT=act, HAS_BIAS=bias is not None, SCALES_TMA=scales_t is not None,
        X_TMA=x_tma, EMULATE_DOT=_interpreting(),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def _probe_mlp(
    gate_up: SlabWeight,
    down: SlabWeight,
    gate_up_scales_t: torch.Tensor | None,
    down_scales_t: torch.Tensor | None,
    config: tuple[int, int, int, int],
    x_tma: bool,
    x: torch.Tensor,
    x_rows: torch.Tensor,
    tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    block_m: int,
) -> torch.Tensor:
    h = tma_grouped_qgemm(
        x, x_rows, tiles, block_m, gate_up, config, act=ACT_GPTOSS, gate_up=(0, 1, 2),
        alpha=sweep.ALPHA, limit=sweep.LIMIT, scales_t=gate_up_scales_t, x_tma=x_tma,
    )  # fmt: skip
    # h is in sorted row order: no gather
    return tma_grouped_qgemm(
        h, None, tiles, block_m, down, config, scales_t=down_scales_t, x_tma=x_tma
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sweep.add_run_arguments(ap)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--configs", default=CONFIGS, help="probe BLOCK_N:BLOCK_K:warps:stages,...")
    ap.add_argument("--lib-configs", default=LIB_CONFIGS, help="the library kernel's, same form")
    args = ap.parse_args(argv)
    if args.smoke:
        if not _interpreting():
            raise SystemExit("--smoke runs on the CPU: set TRITON_INTERPRET=1 in the environment")
        sweep.HIDDEN, sweep.INTER, sweep.EXPERTS, sweep.TOP_K = 64, 64, 4, 2
        args.configs, args.compile_only, args.tokens = "16:32:4:2,32:64:4:3", False, "4,16"
        args.variants = ",".join(PROBE_VARIANTS)  # the library's scaled dot is GPU only

    from pdflash.engine.roofline import measure_hbm_gbps
    from pdflash.models import fused_moe_triton as k
    from pdflash.models.compressed_gemm import pick_block_m

    dev = torch.device("cpu" if args.smoke else "cuda")
    t_start = time.monotonic()
    g = torch.Generator().manual_seed(0)
    slab = sweep._slab(g, dev)
    gate_up, down = sweep.slab_weights(k, slab)
    scales_t = (relayout_scales(gate_up.scale, 2), relayout_scales(down.scale, 1))

    def parse(text: str) -> list[tuple[int, int, int, int]]:
        return k.parse_configs(text) if text else []

    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"--variants: {sorted(unknown)} not among {VARIANTS}")
    grid = [
        (v, c) for v in variants for c in parse(args.lib_configs if v == "lib" else args.configs)
    ]
    grid = sweep.shard_of(grid, args.shard)
    hbm = None if args.compile_only or args.smoke else measure_hbm_gbps(dev)
    points = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(tokens, sweep.HIDDEN, generator=g).bfloat16().to(dev)
        key, x_rows = sweep._routing(g, tokens, dev)
        block_m = pick_block_m(int(key.numel()), sweep.EXPERTS)
        tiles = k.tile_map(key, sweep.EXPERTS, block_m, sweep.EXPERTS)
        rows = torch.arange(key.numel(), dtype=torch.int32, device=dev)
        want = None if args.compile_only else sweep._reference(x, key, x_rows, slab)
        nbytes = sweep._active_bytes(key, slab)
        for variant, config in grid:
            if time.monotonic() - t_start > args.budget_s:
                break
            point: dict[str, Any] = {
                "variant": variant, "config": list(config), "tokens": tokens, "block_m": block_m,
                "synthetic": True,
            }  # fmt: skip
            if variant == "lib":
                tuner = k._grouped_qgemm_kernel
                tuner.configs = [k._config(*config)]
                tuner.cache.clear()
                mlp = functools.partial(
                    sweep._mlp, k, gate_up, down, x, x_rows, tiles, block_m, rows, "scaled"
                )
            else:
                gu_t, dn_t = scales_t if "s" in variant[4:] else (None, None)
                mlp = functools.partial(
                    _probe_mlp, gate_up, down, gu_t, dn_t, config, "x" in variant[4:], x, x_rows,
                    tiles, block_m,
                )  # fmt: skip
            sweep.measure(point, mlp, want, not args.smoke, args, hbm, nbytes)
            points.append(point)
    result: dict[str, Any] = {
        "kind": "mxfp4_tma_probe",
        "synthetic": True,
        "shape": {
            "hidden": sweep.HIDDEN,
            "intermediate": sweep.INTER,
            "experts": sweep.EXPERTS,
            "top_k": sweep.TOP_K,
        },
        "hbm_gbps": hbm,
        "compile_only": args.compile_only,
        "smoke": args.smoke,
        "shard": args.shard,
        "wall_s": time.monotonic() - t_start,
        "points": points,
    }
    if not args.compile_only and not args.smoke:
        timed = [p for p in points if "us" in p]
        best: dict[str, dict[str, Any]] = {}
        for p in timed:
            key_t = f"{p['tokens']}/{p['variant']}"
            if p["max_rel_err"] < 2e-2 and (key_t not in best or p["us"] < best[key_t]["us"]):
                best[key_t] = p
        result["best_per_tokens_variant"] = best
        for p in sorted(timed, key=lambda p: (p["tokens"], p["us"])):
            over = f"x{p['over_roofline']:.2f}" if p["over_roofline"] else "  n/a"
            print(
                f"{p['tokens']:4d} tok {p['variant']:6s} {p['config']!s:18s} "
                f"{p['us']:8.1f} us  {over} roof  err {p['max_rel_err']:.2e}",
                file=sys.stderr,
            )
    errors = [p for p in points if "error" in p or p.get("max_rel_err", 0.0) >= 2e-2]
    result["failed_points"] = len(errors)
    if args.json:
        print(json.dumps(result))
    return 1 if args.smoke and (errors or not points) else 0


if __name__ == "__main__":
    sys.exit(main())
