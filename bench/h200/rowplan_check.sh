#!/usr/bin/env bash
# Issue 13: the all-resident MXFP4 block's row plans (one launch ordering and
# tiling the routed rows, one combining them; PDFLASH_ROW_SORT=plan_atomic,
# the default, and plan) against the counting sort they replace, on the lent
# GPU:
#   gputests  the plan and combine against their references at the published
#             shapes, the fused MXFP4 block, the resident recordings
#   moe       pdflash-bench moe all-hit at 16/64/256 tokens, replayed from a
#             CUDA graph, --row-sort all (plan_atomic in the main fields,
#             counting and plan in by_row_sort, same rounds)
#   kernels_* each mode's 256-token graph replay kernel by kernel
#             (graph_kernels.py)
#   summary   allhit_summary.py over the moe rows
#   sweep     row_plan_sweep.py: the ordered and atomic plans alone, by rows,
#             keys, warps and cells
#   ab        (AB_S > 0) B3's verify in the engine, plan vs counting, one
#             process per arm a round (mxfp4dot_engine_ab.sh)
#   OUT=/path bash bench/h200/rowplan_check.sh    (AB_S default 150)
# Everything lands in ONE file, $OUT/rowplan_check.tgz (the steps write to a
# scratch folder: the device tool returns only a few files a call).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=scratch_pack.sh
source "$HERE/scratch_pack.sh" rowplan_check.tgz
ab_s=${AB_S:-150}
SHAPE="--arch gpt-oss-20b --synthetic-format mxfp4 --tokens 16 --repeats 1 --cache-fraction 1.0 --compressed-gemm fused --resident-graphs on"
MOE="pdflash-bench moe --json $SHAPE --layers 2 --all-hit-tokens 16,64,256 --all-hit-iters 20 --all-hit-rounds 5 --row-sort all"
KERNELS="python3 -P $HERE/graph_kernels.py --top 2 --out"
KARGS="moe --json $SHAPE --layers 1 --all-hit-tokens 256 --all-hit-iters 20 --all-hit-rounds 3"
steps=(
  "gputests=PDFLASH_FUSED_AUTOTUNE=0 timeout -k 5 200 python3 -P -m pytest -q -rs -p no:cacheprovider tests/models/test_fused_moe_gemm_gpu.py tests/models/test_resident_graphs_gpu.py tests/models/test_allhit_fast_path.py -k 'row_plan or gptoss_mxfp4 or resident or allhit' > $OUT/gputests.txt 2>&1; rc=\$?; tail -8 $OUT/gputests.txt; exit \$rc"
  "moe=timeout -k 5 120 $MOE"
  "kernels_plan=timeout -k 5 100 $KERNELS $OUT/kernels256_plan.json -- $KARGS --row-sort plan > $OUT/kernels256_plan.txt 2>&1; rc=\$?; head -40 $OUT/kernels256_plan.txt; exit \$rc"
  "kernels_atomic=timeout -k 5 100 $KERNELS $OUT/kernels256_atomic.json -- $KARGS --row-sort plan_atomic > $OUT/kernels256_atomic.txt 2>&1; rc=\$?; head -40 $OUT/kernels256_atomic.txt; exit \$rc"
  "kernels_counting=timeout -k 5 100 $KERNELS $OUT/kernels256_counting.json -- $KARGS --row-sort counting > $OUT/kernels256_counting.txt 2>&1; rc=\$?; head -40 $OUT/kernels256_counting.txt; exit \$rc"
  "summary=python3 $HERE/allhit_summary.py $OUT/results.jsonl --out $OUT/moe_summary.json"
  "sweep=timeout -k 5 150 python3 -P $HERE/row_plan_sweep.py --out $OUT/row_plan_sweep.json --rows 64,256,1024,4096,16384 --warps 4,8 --cells 8192,16384 > $OUT/row_plan_sweep.txt 2>&1; rc=\$?; tail -2 $OUT/row_plan_sweep.txt; exit \$rc"
)
if [ "$ab_s" -gt 0 ]; then
  steps+=("ab=BUDGET_S=$ab_s POINTS='B3:1.0' ARMS='plan=PDFLASH_ROW_SORT=plan counting=PDFLASH_ROW_SORT=counting' OUT=$OUT/ab bash $HERE/mxfp4dot_engine_ab.sh > $OUT/ab.txt 2>&1; rc=\$?; tail -30 $OUT/ab.txt; exit \$rc")
fi
exec bash "$HERE/run.sh" "${steps[@]}"
