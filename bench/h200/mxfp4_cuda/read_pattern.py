"""How fast HBM serves the MXFP4 GEMM's weight reads in the kernel's order,
with no GEMM: a Triton kernel that only reads (and XOR-folds) a slab shaped
like gpt-oss-20b's gate_up codes for 32 experts (5760 rows each, one CTA per
128-row tile, 1440 CTAs; rows of 1408 bytes, the 22 whole 128-k chunks of
the real 1440, so that both orders below read exactly the same bytes) in
one of two orders:

* ``rows``: the kernel's, per 128-k chunk 64 bytes of each of the tile's 128
  rows (rows 1408 bytes apart), chunk after chunk;
* ``linear``: the same bytes per CTA, read as consecutive 8 KB pieces of the
  tile's contiguous 176 KB.

Bytes and grid are the same; only the order differs. If ``rows`` streams
well below ``linear`` (and the device-to-device copy probe), HBM's service of
scattered 64-byte row segments bounds the GEMM, whatever its instructions;
if they agree, the bound is in the GEMM kernel. One JSON line per (order,
stages): GB/s (1e9 bytes/s) over the bytes read, the median of interleaved
rounds, and the copy probe's GB/s.

    python3 -P bench/h200/mxfp4_cuda/read_pattern.py [--stages 3,4,6] [--rounds 7]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

from pdflash.engine.roofline import measure_hbm_gbps

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mxfp4_sweep import us_per_call  # noqa: E402  (bench/h200)

EXPERTS, ROWS = 32, 5760  # gpt-oss-20b gate_up
TILE_ROWS, CHUNK_BYTES = 128, 64  # the kernel's CTA (8 warps x 16 rows), one 128-k chunk
CHUNKS = 22  # whole 128-k chunks of a 2880-k row (the kernel's 23rd is 32 bytes)
ROW_BYTES = CHUNKS * CHUNK_BYTES


@triton.jit
def _read(
    src, out, ROW_WORDS: tl.constexpr, TILE: tl.constexpr, CHUNK_WORDS: tl.constexpr,
    NCHUNK: tl.constexpr, LINEAR: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * (TILE * ROW_WORDS)
    r = tl.arange(0, TILE)[:, None]
    w = tl.arange(0, CHUNK_WORDS)[None, :]
    acc = tl.zeros([TILE, CHUNK_WORDS], dtype=tl.int32)
    for c in tl.range(0, NCHUNK, num_stages=STAGES):
        if LINEAR:
            off = base + c * (TILE * CHUNK_WORDS) + r * CHUNK_WORDS + w
        else:
            off = base + r * ROW_WORDS + c * CHUNK_WORDS + w
        acc ^= tl.load(src + off)
    tl.store(out + pid, tl.reduce(tl.reshape(acc, [TILE * CHUNK_WORDS]), 0, _xor))


@triton.jit
def _xor(a, b):
    return a ^ b


def read_once(src: torch.Tensor, out: torch.Tensor, linear: bool, stages: int) -> None:
    tiles = out.numel()
    _read[(tiles,)](
        src, out, ROW_WORDS=ROW_BYTES // 4, TILE=TILE_ROWS, CHUNK_WORDS=CHUNK_BYTES // 4,
        NCHUNK=CHUNKS, LINEAR=linear, STAGES=stages, num_warps=8,
    )  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", default="3,4,6", help="software pipeline depths, comma-separated")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda")
    words = EXPERTS * ROWS * ROW_BYTES // 4
    src = torch.randint(-(2**31), 2**31 - 1, (words,), dtype=torch.int32, device=dev)
    tiles = EXPERTS * ROWS // TILE_ROWS
    outs = {o: torch.empty(tiles, dtype=torch.int32, device=dev) for o in ("rows", "linear")}
    stages = [int(s) for s in args.stages.split(",") if s]
    arms = [(o, s) for s in stages for o in ("rows", "linear")]
    for order, s in arms:
        read_once(src, outs[order], order == "linear", s)
    torch.cuda.synchronize()
    # the same bytes either way: each tile's XOR fold agrees
    if not torch.equal(outs["rows"], outs["linear"]):
        raise SystemExit("the two orders read different bytes")
    hbm = measure_hbm_gbps(dev)
    nbytes = tiles * TILE_ROWS * CHUNKS * CHUNK_BYTES
    times: dict[tuple[str, int], list[float]] = {a: [] for a in arms}
    for rnd in range(args.rounds):
        for order, s in arms[rnd % len(arms) :] + arms[: rnd % len(arms)]:
            us = us_per_call(lambda: read_once(src, outs[order], order == "linear", s), args.iters)
            times[(order, s)].append(us)
    for (order, s), ts in times.items():
        us = statistics.median(ts)
        row = {
            "order": order, "stages": s, "bytes": nbytes, "us": us, "rounds_us": ts,
            "gbps": nbytes / (us * 1e-6) / 1e9, "hbm_copy_gbps": hbm, "synthetic": True,
        }  # fmt: skip
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
