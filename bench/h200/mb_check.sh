#!/usr/bin/env bash
# Issue 13: variants 16 / 17 (variants 10 / 15 handing each chunk's x to the
# wgmmas by one mbarrier per x buffer instead of a CTA-wide barrier; session
# 61's Nsight read that barrier as the top stall of v10 and v15 at 256
# tokens). One lent GPU, one call (~5 minutes with the build), each step under
# a hard timeout:
#   gputests  16 / 17 against 10 bit for bit (NaN words included), and the
#             gpt-oss MLP under PDFLASH_MXFP4_CUDA_BM64=wgmma_mb
#   gemm      v10 / v15 / v16 / v17 per projection at 256 and 64 tokens
#             (mxfp4_cuda/ncu_gemm.py without ncu: 7 interleaved rounds)
#   allhit_*  the all-hit gpt-oss MXFP4 block at 64 / 256 tokens, 2 layers,
#             under auto (v10) and wgmma_mb (v16), one process each, in turn
#   ncu       warp-stall reasons of v16 and v17 at 256 tokens
#   OUT=/path bash bench/h200/mb_check.sh
# Everything lands in ONE file, $OUT/mb_check.tgz.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=scratch_pack.sh
source "$HERE/scratch_pack.sh" mb_check.tgz
GPUTESTS="tests/models/test_mxfp4_cuda_gemm_gpu.py tests/models/test_fused_moe_gemm_gpu.py -k 'repacked or chunk_permuted'"
ALLHIT="pdflash-bench moe --json --arch gpt-oss-20b --synthetic-format mxfp4 --tokens 16 --repeats 1 --cache-fraction 1.0 --compressed-gemm fused --resident-graphs on --layers 2 --all-hit-tokens 64,256 --all-hit-iters 20 --all-hit-rounds 5"
STALLS='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'
NCU="ncu --nvtx --nvtx-include ncu/ --section WarpStateStats --section SchedulerStats --metrics $STALLS"
allhit_steps=()
for i in 1 2; do
  for arm in auto wgmma_mb; do
    allhit_steps+=("allhit_${arm}_$i=timeout -k 5 70 env PDFLASH_MXFP4_CUDA_BM64=$arm $ALLHIT")
  done
done
exec bash "$HERE/run.sh" \
  "gputests=timeout -k 5 90 python3 -P -m pytest -q -rs -p no:cacheprovider $GPUTESTS > $OUT/gputests.txt 2>&1; rc=\$?; tail -8 $OUT/gputests.txt; exit \$rc" \
  "gemm=timeout -k 5 90 python3 -P $HERE/mxfp4_cuda/ncu_gemm.py --tokens 256,64 --variants 10,15,16,17 --rounds 7 --iters 20 > $OUT/gemm.txt 2>&1; rc=\$?; cat $OUT/gemm.txt | cut -c1-400; exit \$rc" \
  "${allhit_steps[@]}" \
  "ncu=timeout -k 5 90 $NCU python3 -P $HERE/mxfp4_cuda/ncu_gemm.py --tokens 256 --variants 16,17 --rounds 1 --iters 2 > $OUT/ncu256.txt 2>&1; rc=\$?; grep -E 'mxfp4_moe_kernel|Issued Warp|stalled_(barrier|wait|long_sc|math)' $OUT/ncu256.txt | head -40; exit \$rc"
