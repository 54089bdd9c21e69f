#!/usr/bin/env bash
# Issue 13: the CUDA MXFP4 GEMM's wgmma path at block_m 64 (the library's
# default there on sm_90a) against its mma.sync path
# (PDFLASH_MXFP4_CUDA_BM64=mma) and Triton's tl.dot_scaled, on one lent GPU:
#   OUT=/path bash bench/h200/mxfp4_wgmma_check.sh
# Steps (bench/h200/run.sh: build unless SKIP_BUILD=1 and this machine built
# this tree; $OUT/log.txt, $OUT/results.jsonl, all packed into
# $OUT/mxfp4_wgmma_check.tgz after every step), each under a hard timeout:
#   gputests  tests/models/test_mxfp4_cuda_gemm_gpu.py and the MXFP4 cases of
#             tests/models/test_fused_moe_gemm_gpu.py, <= 200 s
#   moe       pdflash-bench moe, gpt-oss-20b MXFP4 (synthetic), 2 layers, all
#             experts resident, the fused CUDA kernel's all-hit block at
#             16/64/256 tokens, eager and replayed from a CUDA graph
#             (--resident-graphs both), <= 100 s
#   moe_mma   the same with PDFLASH_MXFP4_CUDA_BM64=mma, <= 100 s
#   summary   both moe rows: µs and x roofline a point ($OUT/moe_summary.json)
#   ab        bench/h200/mxfp4dot_engine_ab.sh (B3 at cache 1.0, c=16: the
#             arms cuda / cudamma / scaled, one process each a repeat) for
#             AB_S seconds (default 200; 0 skips it)
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export OUT
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
export PACK="$OUT/mxfp4_wgmma_check.tgz"
ab_s=${AB_S:-200}
MOE="pdflash-bench moe --json --arch gpt-oss-20b --synthetic-format mxfp4 --layers 2 --tokens 16 --repeats 1 --cache-fraction 1.0 --all-hit-tokens 16,64,256 --all-hit-iters 20 --all-hit-rounds 5 --compressed-gemm fused --resident-graphs both"
steps=(
  "gputests=PDFLASH_FUSED_AUTOTUNE=0 timeout -k 5 200 python3 -P -m pytest -q -rs -p no:cacheprovider tests/models/test_mxfp4_cuda_gemm_gpu.py tests/models/test_fused_moe_gemm_gpu.py -k 'test_mxfp4_cuda_gemm_gpu or gptoss_mxfp4' > $OUT/gputests.txt 2>&1; rc=\$?; tail -8 $OUT/gputests.txt; exit \$rc"
  "moe=timeout -k 5 100 $MOE"
  "moe_mma=PDFLASH_MXFP4_CUDA_BM64=mma timeout -k 5 100 $MOE"
  "summary=python3 $HERE/mxfp4_cuda_summary.py $OUT/results.jsonl --out $OUT/moe_summary.json"
)
if [ "$ab_s" -gt 0 ]; then
  steps+=("ab=BUDGET_S=$ab_s POINTS='B3:1.0' OUT=$OUT/ab bash $HERE/mxfp4dot_engine_ab.sh > $OUT/ab.txt 2>&1; rc=\$?; tail -30 $OUT/ab.txt; exit \$rc")
fi
exec bash "$HERE/run.sh" "${steps[@]}"
