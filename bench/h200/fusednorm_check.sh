#!/usr/bin/env bash
# Issue 13: the one-launch RMSNorm (PDFLASH_FUSED_NORM=on) against the torch
# norms (off) on one lent GPU, in one call (about 7 minutes with the build; a
# cut call still returns the steps done), each step under a hard timeout:
#   gputests   tests/models/test_rmsnorm_triton.py with the norm switched on
#              (its CUDA test compares the adapters' norms with transformers')
#   sass       the wgmma GEMM kernel at block_m 64 (variant 10) as
#              SASS (cuobjdump over the built pdflash_native._mxfp4gemm), for
#              counting its main loop's instructions off the machine
#   ab         B3's verify (gpt-oss-20b, 8 layers, synthetic MXFP4, forced
#              acceptance, c=16), norm off vs on, one process per arm per
#              round (mxfp4dot_engine_ab.sh; AB_BUDGET_S, default 240)
#   b3kernels  the same B3 verify graph kernel by kernel with the norm on
#              (graph_kernels.py), to set beside session 58's profile
#   OUT=/path bash bench/h200/fusednorm_check.sh
# Everything lands in ONE file, $OUT/fusednorm_check.tgz.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=scratch_pack.sh
source "$HERE/scratch_pack.sh" fusednorm_check.tgz
ENGINE="engine --json --arch gpt-oss-20b --layers 8 --synthetic-format mxfp4 --baselines B3 --cache-fraction 1.0 --concurrency 16 --num-requests 48 --max-new-tokens 64 --prompt-len 32 --cuda-graphs auto --repeats 1 --seed 0"
AB="BUDGET_S=${AB_BUDGET_S:-240} POINTS='B3:1.0' MAX_NEW=128 REPEATS=3 ARMS='off=PDFLASH_FUSED_NORM=off on=PDFLASH_FUSED_NORM=on' OUT=$OUT/ab bash $HERE/mxfp4dot_engine_ab.sh"
SASS="python3 -P $HERE/mxfp4_cuda/sass_dump.py --match ILi8ELi1ELi8ELi4ELi2ELi256ELi1E --out $OUT/sass_wgmma_bm64.txt"
exec bash "$HERE/run.sh" \
  "gputests=PDFLASH_FUSED_NORM=on timeout -k 5 120 python3 -P -m pytest -q -rs -p no:cacheprovider tests/models/test_rmsnorm_triton.py > $OUT/gputests.txt 2>&1; rc=\$?; tail -8 $OUT/gputests.txt; exit \$rc" \
  "sass=timeout -k 5 60 $SASS" \
  "ab=$AB > $OUT/ab.txt 2>&1; rc=\$?; python3 $HERE/arm_dirs_pairs.py $OUT/ab on off >> $OUT/ab.txt 2>&1; tail -30 $OUT/ab.txt; exit \$rc" \
  "b3kernels=PDFLASH_FUSED_NORM=on timeout -k 5 150 python3 -P $HERE/graph_kernels.py --top 2 --out $OUT/b3_kernels_norm_on.json -- $ENGINE > $OUT/b3_kernels.txt 2>&1; rc=\$?; head -30 $OUT/b3_kernels.txt; exit \$rc"
