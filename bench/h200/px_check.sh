#!/usr/bin/env bash
# Issue 13: where variant 14 (PDFLASH_MXFP4_CUDA_BM64=wgmma_px: variant 10's
# wgmma kernel reading x by cp.async from a chunk-permuted copy) loses, and
# whether variant 15 (variant 10 reading repacked codes: ~40% fewer integer
# dequant instructions) wins. Session
# 60 ran this script's earlier form at ba7bc5c (GPU tests, the all-hit block
# under auto and wgmma_px: 1.21x slower at 256 tokens;
# bench/results/h100/session60-2026-12-07/). This form, on one lent GPU in one
# call (about 9 minutes with the build), each step under a hard timeout:
#   gputests   variant 15 against variant 10 bit for bit (and the seam's
#              refusals), variant 14's bit tests again
#   kernels_*  the all-hit block's 256-token replay kernel by kernel
#              (graph_kernels.py over pdflash-bench moe, 1 layer) under auto
#              and wgmma_px: the permuted copy of the input and each GEMM
#   probe      v10 against v14 and v15 per projection at 256 and 64 tokens
#              (mxfp4_cuda/probe.py; v14's gate_up includes the input's
#              permuted copy and writes down's x permuted; v15 reads blocks
#              repacked once beforehand); its nvcc build of every variant
#              takes ~110 s, before its own budgets count
#   OUT=/path bash bench/h200/px_check.sh
# Everything lands in ONE file, $OUT/px_check.tgz.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=scratch_pack.sh
source "$HERE/scratch_pack.sh" px_check.tgz
KARGS="moe --json --arch gpt-oss-20b --synthetic-format mxfp4 --tokens 16 --repeats 1 --cache-fraction 1.0 --compressed-gemm fused --resident-graphs on --layers 1 --all-hit-tokens 256 --all-hit-iters 20 --all-hit-rounds 3"
kernel_steps=()
for arm in auto wgmma_px; do
  kernel_steps+=("kernels_$arm=timeout -k 5 60 env PDFLASH_MXFP4_CUDA_BM64=$arm python3 -P $HERE/graph_kernels.py --top 2 --out $OUT/kernels256_$arm.json -- $KARGS > $OUT/kernels256_$arm.txt 2>&1; rc=\$?; head -12 $OUT/kernels256_$arm.txt; exit \$rc")
done
PROBE="env MXC_VARIANTS=v10,v14,v15 MXC_TOKENS=256,64 MXC_CORR_BUDGET_S=20 MXC_BUDGET_S=120 OUT=$OUT/probe python3 -P $HERE/mxfp4_cuda/probe.py"
GPUTESTS="tests/models/test_mxfp4_cuda_gemm_gpu.py -k 'repacked or chunk_permuted'"
exec bash "$HERE/run.sh" \
  "gputests=timeout -k 5 120 python3 -P -m pytest -q -rs -p no:cacheprovider $GPUTESTS > $OUT/gputests.txt 2>&1; rc=\$?; tail -6 $OUT/gputests.txt; exit \$rc" \
  "${kernel_steps[@]}" \
  "probe=timeout -k 5 330 $PROBE > $OUT/probe.txt 2>&1; rc=\$?; tail -30 $OUT/probe.txt; exit \$rc"
