#!/usr/bin/env bash
# Issue 13: why the policy's wgmma MXFP4 GEMM (variant 10) runs at ~0.5 of
# peak issue at 256 tokens, and why variant 15 (~40% fewer integer dequant
# instructions) buys only ~3% (session 61's probe); and the all-hit block on
# whichever GPU comes (the CUDA kernel had not yet run on an H200). One call
# (~5 minutes with the build), each step under a hard timeout:
#   allhit    the all-hit gpt-oss MXFP4 block, default policy, 16 / 64 / 256
#             tokens, 2 layers, 5 interleaved rounds
#   gputests  variant 15 against variant 10 bit for bit, NaN words included
#   ncu       Nsight Compute's warp-stall reasons (per issued instruction),
#             issue and occupancy of both projections, variants 10, 14 and 15,
#             at 256 tokens (mxfp4_cuda/ncu_gemm.py's NVTX range)
#   OUT=/path bash bench/h200/stall_check.sh
# Everything lands in ONE file, $OUT/stall_check.tgz.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=scratch_pack.sh
source "$HERE/scratch_pack.sh" stall_check.tgz
GPUTESTS="tests/models/test_mxfp4_cuda_gemm_gpu.py -k repacked"
STALLS='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'
ALLHIT="pdflash-bench moe --json --arch gpt-oss-20b --synthetic-format mxfp4 --tokens 16 --repeats 1 --cache-fraction 1.0 --compressed-gemm fused --resident-graphs on --layers 2 --all-hit-tokens 16,64,256 --all-hit-iters 20 --all-hit-rounds 5"
NCU="ncu --nvtx --nvtx-include ncu/ --section WarpStateStats --section SchedulerStats --section Occupancy --metrics $STALLS"
exec bash "$HERE/run.sh" \
  "allhit=timeout -k 5 100 $ALLHIT" \
  "gputests=timeout -k 5 60 python3 -P -m pytest -q -rs -p no:cacheprovider $GPUTESTS > $OUT/gputests.txt 2>&1; rc=\$?; tail -8 $OUT/gputests.txt; exit \$rc" \
  "ncu=timeout -k 5 150 $NCU python3 -P $HERE/mxfp4_cuda/ncu_gemm.py --tokens 256 --variants 10,14,15 --rounds 1 --iters 2 > $OUT/ncu256.txt 2>&1; rc=\$?; grep -E 'mxfp4_moe_kernel|Issued Warp|No Eligible|stalled' $OUT/ncu256.txt | head -80; exit \$rc"
