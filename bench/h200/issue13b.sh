#!/usr/bin/env bash
# Issue 13's verify-speed follow-up on the lent H200, in run.sh's step style
# (one JSON result per step in $OUT/results.jsonl, the log in $OUT/log.txt).
# Budgeted for <= 5 minutes: build ~20 s, then steps with hard timeouts
# summing to 275 s, most important first; engine steps append each finished
# run to $OUT/<step>/rows.jsonl, so a step cut by its timeout keeps its rows.
#   bash bench/h200/issue13b.sh
# Steps:
#  gputest_attn  the fused paged attention on CUDA vs the fp32 reference (bf16
#             tolerance) and no host sync in a layer's attention
#  b3_gptoss_c16 / b3_qwen3_c16  B3 (every expert resident) at c=16, 8 layers:
#             verify_breakdown_ms (attention / router / experts / other + host
#             gaps / drafter per verify) after the per-layer attention overhead cut
#  profile_b3  torch.profiler op tables (by self CUDA / CPU time, by count) of one
#             B3 run, gpt-oss-20b 2 layers c=16 ($OUT/profile.json)
#  link       gpt-oss-20b 8 layers from an MXFP4 checkpoint at cache 0.2, c=4 and
#             16, PD: experts moved as MXFP4 vs dequantized to bf16, up to 3
#             repeats interleaved while the step's budget allows; tok/s and
#             bytes/token side by side ($OUT/link/rows.jsonl)
# The shapes and sizes can be overridden for a local dry run on the CPU, e.g.
#   GPTOSS=tiny-gpt_oss QWEN=tiny-qwen3_moe LAYERS=2 DEVICE=cpu bash bench/h200/issue13b.sh
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
GPTOSS=${GPTOSS:-gpt-oss-20b}
QWEN=${QWEN:-qwen3-30b-a3b}
LAYERS=${LAYERS:-8}
PROFILE_LAYERS=${PROFILE_LAYERS:-2}
DEVICE=${DEVICE:-auto}
ENG="pdflash-bench engine --json --layers $LAYERS --max-new-tokens 32 --prompt-len 32 --device $DEVICE"
OUT=${OUT:-$PWD/out}
export OUT
exec bash "$HERE/run.sh" \
  "gputest_attn=timeout 25 python3 -P -m pytest -q -p no:cacheprovider tests/engine/test_attention_gpu.py" \
  "b3_gptoss_c16=timeout 55 $ENG --arch $GPTOSS --baselines B3 --concurrency 16 --breakdown --out $OUT/b3_gptoss_c16" \
  "b3_qwen3_c16=timeout 50 $ENG --arch $QWEN --baselines B3 --concurrency 16 --breakdown --out $OUT/b3_qwen3_c16" \
  "profile_b3=timeout 35 python3 $HERE/profile_verify.py --out $OUT/profile.json --run arch=$GPTOSS,baseline=B3,concurrency=16,layers=$PROFILE_LAYERS,device=$DEVICE,breakdown=1" \
  "link=timeout 110 python3 $HERE/issue13b_link.py --out $OUT/link --budget-s 80 --arch $GPTOSS --layers $LAYERS --device $DEVICE"
