#!/usr/bin/env bash
# The CUDA MXFP4 GEMM as a library path (pdflash_native._mxfp4gemm,
# PDFLASH_FUSED_MXFP4_DOT=cuda) on one lent GPU, after
#   bash bench/h200/build_tree.sh .
# then
#   OUT=/path bash bench/h200/mxfp4_cuda_check.sh
# (about 4 minutes on an H100, under 6 with every hard timeout: run.sh
# skips the build when this machine built this tree, SKIP_BUILD=1). Steps,
# each under a hard timeout (bench/h200/run.sh: $OUT/log.txt, one JSON line
# per step in $OUT/results.jsonl, everything packed into
# $OUT/mxfp4_cuda_check.tgz after every step):
#   gputests  tests/models/test_mxfp4_cuda_gemm_gpu.py (the kernel vs the torch
#             fp32 reference and Triton's scaled dot: epilogues, block_m,
#             variants, dead tiles, extreme scales, CUDA-graph capture) and the
#             MXFP4 cases of tests/models/test_fused_moe_gemm_gpu.py
#             (FusedSlabMLP with mxfp4_dot cuda / scaled / registers vs the
#             dequant path), <= 100 s ($OUT/gputests.txt)
#   probe     bench/h200/mxfp4_cuda/run.sh (the library's .cu built alone with
#             the variants the policy picks, v4, v8 and v10: the correctness
#             checks, each variant timed vs Triton at 16/64/256 tokens),
#             <= 150 s ($OUT/probe/mxfp4_cuda.{json,log})
#   moe       pdflash-bench moe, gpt-oss-20b MXFP4 (synthetic), 2 layers, all
#             experts resident, all-hit block at 16/64/256 tokens with
#             --compressed-gemm both: dequant, fused (Triton registers),
#             fused_dot_scaled (Triton tl.dot_scaled) and fused_cuda (the CUDA
#             kernel) timed interleaved (all_hit[*].by_compressed_gemm; a mode
#             that cannot run: by_compressed_gemm_not_measured), <= 90 s
#   summary   $OUT/mxfp4_cuda_summary.json: per layer and token count, each
#             mode's µs and the roofline (from the moe rows)
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export OUT
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
export SKIP_BUILD=${SKIP_BUILD:-1}
export PACK="$OUT/mxfp4_cuda_check.tgz"
MOE="pdflash-bench moe --json --arch gpt-oss-20b --synthetic-format mxfp4 --layers 2 --tokens 16 --repeats 1 --cache-fraction 1.0 --all-hit-tokens 16,64,256 --all-hit-iters 20 --all-hit-rounds 5 --compressed-gemm both"
exec bash "$HERE/run.sh" \
  "gputests=PDFLASH_FUSED_AUTOTUNE=0 timeout -k 5 100 python3 -P -m pytest -q -rs -p no:cacheprovider tests/models/test_mxfp4_cuda_gemm_gpu.py tests/models/test_fused_moe_gemm_gpu.py -k 'test_mxfp4_cuda_gemm_gpu or gptoss_mxfp4' > $OUT/gputests.txt 2>&1; rc=\$?; tail -5 $OUT/gputests.txt; exit \$rc" \
  "probe=PROBE_TIMEOUT_S=150 MXC_VARIANTS=v4,v8,v10 MXC_CORR_BUDGET_S=70 MXC_BUDGET_S=140 OUT=$OUT/probe bash bench/h200/mxfp4_cuda/run.sh > /dev/null; rc=\$?; tail -12 $OUT/probe/mxfp4_cuda.log; exit \$rc" \
  "moe=timeout -k 5 90 $MOE" \
  "summary=python3 $HERE/mxfp4_cuda_summary.py $OUT/results.jsonl --out $OUT/mxfp4_cuda_summary.json"
