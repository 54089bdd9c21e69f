#!/usr/bin/env bash
# Issue 13: is the MXFP4 GEMM at 256 tokens held back by HBM (how its
# scattered 64-byte row segments stream) or by its own pipeline? The same
# grid with every slot aliased to one expert (weights L2-resident) against
# distinct experts, and Nsight Compute's speed-of-light and memory tables for
# both. One call (~5 minutes with the build), each step under a hard timeout:
#   gemm_distinct / gemm_aliased  both projections of gpt-oss's MLP,
#             variants 8, 10-13, 15 interleaved, 256 / 64 tokens
#   ncu_distinct / ncu_aliased    variant 10 at 256 tokens: SpeedOfLight,
#             MemoryWorkloadAnalysis (tables), ComputeWorkloadAnalysis
#   readpat   HBM's rate for the same weight bytes read in the kernel's order
#             (64 bytes of each of a tile's 128 rows a chunk) against linear
#             8 KB pieces, no GEMM (mxfp4_cuda/read_pattern.py)
#   allhit    the all-hit gpt-oss MXFP4 block, default policy, 16 / 64 / 256
#             tokens, 2 layers, 5 interleaved rounds (the issue's target row)
#   OUT=/path bash bench/h200/l2_check.sh
# Everything lands in ONE file, $OUT/l2_check.tgz.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=scratch_pack.sh
source "$HERE/scratch_pack.sh" l2_check.tgz
GEMM="python3 -P $HERE/mxfp4_cuda/ncu_gemm.py --tokens 256,64 --variants 8,10,11,12,13,15 --rounds 5 --iters 20"
NCU="ncu --nvtx --nvtx-include ncu/ --section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section ComputeWorkloadAnalysis"
NCUGEMM="python3 -P $HERE/mxfp4_cuda/ncu_gemm.py --tokens 256 --variants 10 --rounds 1 --iters 2"
ALLHIT="pdflash-bench moe --json --arch gpt-oss-20b --synthetic-format mxfp4 --tokens 16 --repeats 1 --cache-fraction 1.0 --compressed-gemm fused --resident-graphs on --layers 2 --all-hit-tokens 16,64,256 --all-hit-iters 20 --all-hit-rounds 5"
KEEP="grep -E 'mxfp4_moe_kernel|Throughput|Hit Rate|Bandwidth|Busy|Executed Ipc|Issue Slots|Duration|Elapsed Cycles|SM Frequency|DRAM Frequency|Mem Pipes|Max Bandwidth' "
exec bash "$HERE/run.sh" \
  "allhit=timeout -k 5 100 $ALLHIT" \
  "gemm_distinct=timeout -k 5 90 $GEMM --weights distinct" \
  "gemm_aliased=timeout -k 5 90 $GEMM --weights aliased" \
  "readpat=timeout -k 5 90 python3 -P $HERE/mxfp4_cuda/read_pattern.py --stages 3,4,6 --rounds 7" \
  "ncu_distinct=timeout -k 5 120 $NCU $NCUGEMM --weights distinct > $OUT/ncu_distinct.txt 2>&1; rc=\$?; $KEEP $OUT/ncu_distinct.txt | head -90; exit \$rc" \
  "ncu_aliased=timeout -k 5 120 $NCU $NCUGEMM --weights aliased > $OUT/ncu_aliased.txt 2>&1; rc=\$?; $KEEP $OUT/ncu_aliased.txt | head -90; exit \$rc"
