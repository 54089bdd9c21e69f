#!/usr/bin/env bash
# Issue 13: does a chunk-major slab layout (each 128-k chunk of a CTA's rows
# one contiguous run) lift the MXFP4 GEMM toward its HBM roofline? Session
# 62's read_pattern.py measured the kernel's order of 64-byte row segments at
# 2.2-2.3 TB/s against 3.0 for linear 8 KB pieces (H100), and the GEMM with
# L2-resident weights 17% faster than from HBM. One call (~4 minutes with the
# build), each step under a hard timeout:
#   gputests  the launcher's chunk stride (stride_wc) bit for bit against the
#             natural layout, and the native seam's argument checks
#   gemm      both projections of gpt-oss's MLP, variants 8, 10, 15, natural
#             and chunk-major blocks interleaved, 256 / 64 tokens
#   OUT=/path bash bench/h200/layout_check.sh
# Everything lands in ONE file, $OUT/layout_check.tgz.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=scratch_pack.sh
source "$HERE/scratch_pack.sh" layout_check.tgz
GPUTESTS="tests/models/test_mxfp4_cuda_gemm_gpu.py::test_chunk_major_blocks_give_the_natural_layouts_bits tests/models/test_mxfp4_cuda_gemm.py"
exec bash "$HERE/run.sh" \
  "gputests=timeout -k 5 90 python3 -P -m pytest -q -rs -p no:cacheprovider $GPUTESTS > $OUT/gputests.txt 2>&1; rc=\$?; tail -8 $OUT/gputests.txt; exit \$rc" \
  "gemm=timeout -k 5 150 python3 -P $HERE/mxfp4_cuda/ncu_gemm.py --tokens 256,64 --variants 8,10,15 --layouts natural,chunk_major --rounds 7 --iters 20"
