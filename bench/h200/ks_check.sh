#!/usr/bin/env bash
# Issue 13: variants 16 / 17 (kinds KIND_WGMMA_KS / KIND_WGMMA_RC_KS: one
# wgmma group per 16-k step, each step's dequant overlapping the previous
# steps' wgmmas) against the policy's variant 10, variant 15 and variant 8.
# One call (~6-7 minutes with the build), each step under a hard timeout:
#   gputests  16 / 17 against 10 bit for bit (GEMM cases, the MLP handoff)
#   gemm      both projections of gpt-oss's MLP, variants 8, 10, 15, 16, 17
#             interleaved, 256 / 64 / 16 tokens (mxfp4_cuda/ncu_gemm.py)
#   allhit_*  the all-hit gpt-oss MXFP4 block at 64 / 256 tokens, 2 layers,
#             default policy and PDFLASH_MXFP4_CUDA_BM64=wgmma_ks, twice each,
#             alternating
#   OUT=/path bash bench/h200/ks_check.sh
# Everything lands in ONE file, $OUT/ks_check.tgz.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=scratch_pack.sh
source "$HERE/scratch_pack.sh" ks_check.tgz
GPUTESTS="tests/models/test_mxfp4_cuda_gemm_gpu.py::test_repacked_codes_and_kstep_groups_give_the_wgmma_variants_bits tests/models/test_fused_moe_gemm_gpu.py::test_gptoss_mxfp4_cuda_chunk_permuted_handoff_equals_the_policys_bits tests/models/test_mxfp4_cuda_gemm.py"
ALLHIT="pdflash-bench moe --json --arch gpt-oss-20b --synthetic-format mxfp4 --tokens 16 --repeats 1 --cache-fraction 1.0 --compressed-gemm fused --resident-graphs on --layers 2 --all-hit-tokens 64,256 --all-hit-iters 20 --all-hit-rounds 5"
exec bash "$HERE/run.sh" \
  "gputests=timeout -k 5 90 python3 -P -m pytest -q -rs -p no:cacheprovider $GPUTESTS > $OUT/gputests.txt 2>&1; rc=\$?; tail -8 $OUT/gputests.txt; exit \$rc" \
  "gemm=timeout -k 5 120 python3 -P $HERE/mxfp4_cuda/ncu_gemm.py --tokens 256,64,16 --variants 8,10,15,16,17 --rounds 7 --iters 20" \
  "allhit_default_1=timeout -k 5 90 env PDFLASH_MXFP4_CUDA_BM64=auto $ALLHIT" \
  "allhit_ks_1=timeout -k 5 90 env PDFLASH_MXFP4_CUDA_BM64=wgmma_ks $ALLHIT" \
  "allhit_default_2=timeout -k 5 90 env PDFLASH_MXFP4_CUDA_BM64=auto $ALLHIT" \
  "allhit_ks_2=timeout -k 5 90 env PDFLASH_MXFP4_CUDA_BM64=wgmma_ks $ALLHIT"
