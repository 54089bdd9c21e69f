#!/usr/bin/env bash
# The fused grouped dequantize-GEMM (PDFLASH_COMPRESSED_GEMM=fused) on the lent
# H200, in run.sh's step style (one JSON result per step in $OUT/results.jsonl,
# the log in $OUT/log.txt). Budget: build ~30 s + steps with hard timeouts
# summing to 345 s (the moe steps' first calls autotune 4 configs per
# projection shape and BLOCK_M, which the warm-up of each timed point absorbs;
# the GPU tests run one config, PDFLASH_FUSED_AUTOTUNE=0).
#   bash bench/h200/mxfp4_fused.sh
# Steps:
#  gputests   the fused kernel vs the dequant path at both published shapes
#             (tests/models/test_fused_moe_gemm_gpu.py; the interpreter tests run in CI)
#  moe_*      pdflash-bench moe --compressed-gemm both: per layer (1 layer) and
#             16/64/256 tokens, the all-hit block with dequant and fused timed
#             interleaved (all_hit[*].by_compressed_gemm: µs, over grouped_mm,
#             over roofline, max error vs dequant), beside plain bf16 grouped_mm
#             (grouped_mm_active_us) and hbm_roofline_us, same run; MXFP4 rows
#             time the fused kernel both ways (fused: values built in registers
#             + tl.dot; fused_dot_scaled: tl.dot_scaled, or the reason it cannot
#             run in by_compressed_gemm_not_measured)
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
MOE="pdflash-bench moe --json --layers 1 --tokens 16 --repeats 1 --cache-fraction 1.0 --all-hit-tokens 16,64,256 --all-hit-iters 20 --compressed-gemm both"
OUT=${OUT:-$PWD/out}
export OUT
exec bash "$HERE/run.sh" \
  "gputests=PDFLASH_FUSED_AUTOTUNE=0 timeout 75 python3 -P -m pytest -q -rs -p no:cacheprovider tests/models/test_fused_moe_gemm_gpu.py" \
  "moe_gptoss_mxfp4=timeout 110 $MOE --arch gpt-oss-20b --synthetic-format mxfp4" \
  "moe_gptoss_fp8=timeout 80 $MOE --arch gpt-oss-20b --expert-dtype fp8" \
  "moe_qwen3_fp8=timeout 80 $MOE --arch qwen3-30b-a3b --expert-dtype fp8"
