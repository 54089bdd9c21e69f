#!/usr/bin/env bash
# Issue 13: the CUDA MXFP4 GEMM's variant 14 (variant 10's wgmma kernel with x
# read by cp.async from a chunk-permuted copy, PDFLASH_MXFP4_CUDA_BM64=wgmma_px)
# on one lent GPU, in one call (about 8-9 minutes with the build), each step
# under a hard timeout:
#   gputests   the CUDA GEMM's GPU tests (every variant, 14 included, against
#              the fp32 reference and Triton; 14 against 10 bit for bit), the
#              gpt-oss MLP under wgmma_px against the policy's bits, and the
#              resident-graph tests alone (session 59's full GPU run failed
#              one of them)
#   probe      v10 against v14 (mxfp4_cuda/probe.py; v14's MLP time includes
#              the permuted copy of x; gate_up writes down's x permuted)
#   allhit_*   pdflash-bench moe all-hit at 64 and 256 tokens (2 layers,
#              replayed from a CUDA graph), auto then wgmma_px, twice in turn
#   ab         B3's MXFP4 verify (gpt-oss-20b, 8 layers, c=16, forced
#              acceptance), PDFLASH_MXFP4_CUDA_BM64 auto (variant 10) against
#              wgmma_px (14), one process per arm per round
#              (mxfp4dot_engine_ab.sh; AB_BUDGET_S, default 150)
#   OUT=/path bash bench/h200/px_check.sh
# Everything lands in ONE file, $OUT/px_check.tgz.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=scratch_pack.sh
source "$HERE/scratch_pack.sh" px_check.tgz
PROBE="env MXC_VARIANTS=v10,v14 MXC_TOKENS=64,256 MXC_CORR_BUDGET_S=40 MXC_BUDGET_S=110 OUT=$OUT/probe python3 -P $HERE/mxfp4_cuda/probe.py"
AB="BUDGET_S=${AB_BUDGET_S:-150} POINTS='B3:1.0' MAX_NEW=128 REPEATS=3 ARMS='v10=PDFLASH_MXFP4_CUDA_BM64=auto v14=PDFLASH_MXFP4_CUDA_BM64=wgmma_px' OUT=$OUT/ab bash $HERE/mxfp4dot_engine_ab.sh"
MOE="pdflash-bench moe --json --arch gpt-oss-20b --synthetic-format mxfp4 --tokens 16 --repeats 1 --cache-fraction 1.0 --compressed-gemm fused --resident-graphs on --layers 2 --all-hit-tokens 64,256 --all-hit-iters 20 --all-hit-rounds 5"
allhit_steps=()
for round in 1 2; do
  for arm in auto wgmma_px; do
    allhit_steps+=("allhit_${arm}_$round=timeout -k 5 60 env PDFLASH_MXFP4_CUDA_BM64=$arm $MOE")
  done
done
exec bash "$HERE/run.sh" \
  "gputests=timeout -k 5 150 python3 -P -m pytest -q -rs -p no:cacheprovider tests/models/test_mxfp4_cuda_gemm_gpu.py tests/models/test_resident_graphs_gpu.py tests/models/test_fused_moe_gemm_gpu.py::test_gptoss_mxfp4_cuda_chunk_permuted_handoff_equals_the_policys_bits > $OUT/gputests.txt 2>&1; rc=\$?; tail -15 $OUT/gputests.txt; exit \$rc" \
  "probe=timeout -k 5 160 $PROBE > $OUT/probe.txt 2>&1; rc=\$?; tail -30 $OUT/probe.txt; exit \$rc" \
  "${allhit_steps[@]}" \
  "ab=$AB > $OUT/ab.txt 2>&1; rc=\$?; python3 $HERE/arm_dirs_pairs.py $OUT/ab v14 v10 >> $OUT/ab.txt 2>&1; tail -12 $OUT/ab.txt; exit \$rc"
