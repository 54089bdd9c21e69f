#!/usr/bin/env bash
# Issue 13 at 256 tokens on one lent GPU, in one call (about 7-9 minutes with
# the build), steps in order of need, each under a hard timeout:
#   gputests   the row plans (ordered and atomic) and combine, the fused MXFP4
#              block, the resident recordings, and the CUDA MXFP4 GEMM's own
#              tests over every variant it has
#   moe        pdflash-bench moe all-hit at 16/64/256 tokens, replayed from a
#              CUDA graph, --row-sort all (plan_atomic; counting and plan in
#              by_row_sort, same rounds)
#   variants   the CUDA GEMM's wgmma variants (VARIANTS, default 10..13) per
#              projection at 64 and 256 tokens (mxfp4_cuda/ncu_gemm.py)
#   b3kernels  B3's verify graph kernel by kernel (graph_kernels.py over
#              pdflash-bench engine: gpt-oss-20b, 8 layers, synthetic MXFP4,
#              forced acceptance, c=16)
#   ncu        Nsight Compute's counters for the policy's GEMM at 256 tokens,
#              where ncu exists and may read them (else its message)
#   kernels_*  the block's 256-token replay kernel by kernel, plan and
#              plan_atomic
#   OUT=/path bash bench/h200/allhit256_check.sh
# Everything lands in ONE file, $OUT/allhit256_check.tgz.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=scratch_pack.sh
source "$HERE/scratch_pack.sh" allhit256_check.tgz
variants=${VARIANTS:-10,11,12,13}
SHAPE="--arch gpt-oss-20b --synthetic-format mxfp4 --tokens 16 --repeats 1 --cache-fraction 1.0 --compressed-gemm fused --resident-graphs on"
MOE="pdflash-bench moe --json $SHAPE --layers 2 --all-hit-tokens 16,64,256 --all-hit-iters 20 --all-hit-rounds 5 --row-sort all"
KERNELS="python3 -P $HERE/graph_kernels.py --top 2 --out"
KARGS="moe --json $SHAPE --layers 1 --all-hit-tokens 256 --all-hit-iters 20 --all-hit-rounds 3"
ENGINE="engine --json --arch gpt-oss-20b --layers 8 --synthetic-format mxfp4 --baselines B3 --cache-fraction 1.0 --concurrency 16 --num-requests 48 --max-new-tokens 64 --prompt-len 32 --cuda-graphs auto --repeats 1 --seed 0"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || echo ncu)
SECTIONS="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats"
GPUTESTS="tests/models/test_fused_moe_gemm_gpu.py tests/models/test_resident_graphs_gpu.py tests/models/test_allhit_fast_path.py tests/models/test_mxfp4_cuda_gemm_gpu.py"
exec bash "$HERE/run.sh" \
  "gputests=PDFLASH_FUSED_AUTOTUNE=0 timeout -k 5 200 python3 -P -m pytest -q -rs -p no:cacheprovider $GPUTESTS -k 'row_plan or gptoss_mxfp4 or resident or allhit or test_mxfp4_cuda_gemm_gpu' > $OUT/gputests.txt 2>&1; rc=\$?; tail -8 $OUT/gputests.txt; exit \$rc" \
  "moe=timeout -k 5 120 $MOE" \
  "variants=timeout -k 5 90 python3 -P $HERE/mxfp4_cuda/ncu_gemm.py --tokens 64,256 --variants $variants > $OUT/variants.jsonl 2> $OUT/variants.err; rc=\$?; cat $OUT/variants.jsonl | cut -c1-400; exit \$rc" \
  "b3kernels=timeout -k 5 180 $KERNELS $OUT/b3_kernels.json -- $ENGINE > $OUT/b3_kernels.txt 2>&1; rc=\$?; head -5 $OUT/b3_kernels.txt; exit \$rc" \
  "ncu=timeout -k 5 90 $NCU --nvtx --nvtx-include 'ncu/' $SECTIONS python3 -P $HERE/mxfp4_cuda/ncu_gemm.py --tokens 256 --rounds 1 --iters 2 > $OUT/ncu256.txt 2>&1; rc=\$?; grep -E 'ERR|Duration|DRAM Throughput|Memory Throughput' $OUT/ncu256.txt | head -12; exit \$rc" \
  "kernels_plan=timeout -k 5 60 $KERNELS $OUT/kernels256_plan.json -- $KARGS --row-sort plan > $OUT/kernels256_plan.txt 2>&1; rc=\$?; head -12 $OUT/kernels256_plan.txt; exit \$rc" \
  "kernels_atomic=timeout -k 5 60 $KERNELS $OUT/kernels256_atomic.json -- $KARGS --row-sort plan_atomic > $OUT/kernels256_atomic.txt 2>&1; rc=\$?; head -12 $OUT/kernels256_atomic.txt; exit \$rc"
