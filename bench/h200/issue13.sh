#!/usr/bin/env bash
# Issue 13's GPU benchmarks on the lent H200, in run.sh's step style (one
# JSON result per step in $OUT/results.jsonl, the log in $OUT/log.txt).
# Budgeted for <= 6 minutes: build ~30 s, then steps with hard timeouts summing to
# 330 s, most important first; engine steps also append each finished run to
# $OUT/<step>/rows.jsonl, so a step cut by its timeout keeps its finished rows.
#   bash bench/h200/issue13.sh
# Steps:
#  moe_*      per-layer all-hit comparison (offloaded block with every expert of
#             the layer resident vs plain grouped_mm on the same active experts vs
#             the HBM roofline of their stored bytes, D2D bandwidth measured in
#             the same run) at 16/64/256 tokens; 2 layers of each published shape;
#             targets (<= 1.25x grouped_mm, <= 2x roofline) in all_hit_targets;
#             the MXFP4 step records mxfp4_dequantizer (triton/torch) and
#             mxfp4_dequant_speed (each dequantizer alone, GB/s vs hbm_gbps)
#  moe_qwen3_fp8  experts stored as FP8 e4m3 (per-output-channel scales): fp8_error
#             (logit error, teacher-forced greedy agreement over 256 tokens vs bf16)
#  b3_*       B3 (every expert resident) at c=16, 8 layers: verify_breakdown_ms
#             (attention / router / experts / other + host gaps / drafter per verify)
#  link_*     gpt-oss-20b 8 layers from an MXFP4 checkpoint at cache 0.2, c=4 and 16,
#             PD: experts moved as MXFP4 (as stored) vs dequantized to bf16 at pack
#             time; rows carry expert_format, expert_nbytes, bytes_per_token, tok/s
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
MOE="pdflash-bench moe --json --layers 2 --tokens 16 --repeats 2 --cache-fraction 0.5 --all-hit-tokens 16,64,256"
ENG="pdflash-bench engine --json --layers 8 --max-new-tokens 32 --prompt-len 32"
OUT=${OUT:-$PWD/out}
export OUT
exec bash "$HERE/run.sh" \
  "moe_qwen3=timeout 35 $MOE --arch qwen3-30b-a3b" \
  "moe_gptoss_bf16=timeout 35 $MOE --arch gpt-oss-20b" \
  "moe_gptoss_mxfp4=timeout 35 $MOE --arch gpt-oss-20b --synthetic-format mxfp4" \
  "moe_qwen3_fp8=timeout 30 $MOE --arch qwen3-30b-a3b --expert-dtype fp8 --all-hit-tokens 64" \
  "b3_gptoss_c16=timeout 60 $ENG --arch gpt-oss-20b --baselines B3 --concurrency 16 --breakdown --out $OUT/b3_gptoss_c16" \
  "b3_qwen3_c16=timeout 45 $ENG --arch qwen3-30b-a3b --baselines B3 --concurrency 16 --breakdown --out $OUT/b3_qwen3_c16" \
  "link_mxfp4=timeout 45 $ENG --arch gpt-oss-20b --synthetic-format mxfp4 --baselines PD --concurrency 4,16 --cache-fraction 0.2 --out $OUT/link_mxfp4" \
  "link_bf16=timeout 45 $ENG --arch gpt-oss-20b --synthetic-format mxfp4 --expert-dtype dense --baselines PD --concurrency 4,16 --cache-fraction 0.2 --out $OUT/link_bf16"
