#!/usr/bin/env bash
# Issue 13: where B3's verify goes on the lent GPU, and why the MXFP4 GEMM
# sits at ~2x its roofline at 256 tokens. After a build of this tree
# (bash bench/h200/build_tree.sh . or another script's run.sh):
#   b3kernels  graph_kernels.py over pdflash-bench engine B3 (gpt-oss-20b, 8
#              layers, synthetic MXFP4, forced acceptance, c=16): the verify
#              graph's kernels, median duration and gap each
#   ncu        Nsight Compute's counters (speed of light, memory, warp stalls,
#              occupancy) for the CUDA MXFP4 GEMM's two projections at 256
#              tokens (mxfp4_cuda/ncu_gemm.py), where ncu exists and may read
#              the counters (else its message is the result)
#   OUT=/path bash bench/h200/verify_kernels.sh
# Everything lands in ONE file, $OUT/verify_kernels.tgz.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
FINAL=${OUT:-$PWD/out}
mkdir -p "$FINAL"
OUT=$(mktemp -d)
export OUT
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
export PACK="$FINAL/verify_kernels.tgz"
export SKIP_BUILD=${SKIP_BUILD:-1}
ENGINE="engine --json --arch gpt-oss-20b --layers 8 --synthetic-format mxfp4 --baselines B3 --cache-fraction 1.0 --concurrency 16 --num-requests 48 --max-new-tokens 64 --prompt-len 32 --cuda-graphs auto --repeats 1 --seed 0"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || echo ncu)
SECTIONS="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats"
exec bash "$HERE/run.sh" \
  "b3kernels=timeout -k 5 ${B3_S:-200} python3 -P $HERE/graph_kernels.py --top 2 --out $OUT/b3_kernels.json -- $ENGINE > $OUT/b3_kernels.txt 2>&1; rc=\$?; head -5 $OUT/b3_kernels.txt; exit \$rc" \
  "ncu=timeout -k 5 ${NCU_S:-150} $NCU --nvtx --nvtx-include 'ncu/' $SECTIONS python3 -P $HERE/mxfp4_cuda/ncu_gemm.py --tokens 256 > $OUT/ncu256.txt 2>&1; rc=\$?; grep -E 'ERR|Duration|DRAM Throughput|Memory Throughput' $OUT/ncu256.txt | head -12; exit \$rc"
