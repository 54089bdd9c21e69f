#!/usr/bin/env bash
# Issue 16 on the H200 in ONE device call (<= ~7.5 minutes including the
# ~30 s build): the host executor's diagnostic on the real 16-core host, then
# PD+host (hybrid miss service) vs PD, 8 MoE layers, synthetic weights, cache
# 0.2, 3 interleaved repeats, most important first, each step under a hard
# timeout (its runs stop starting at --budget-s; rows are written as they
# finish, so a step cut by its timeout keeps what it ran):
#   1. gpt_oss_bf16 (<= 270 s, ~180 s expected): the executor diagnostic on
#      gpt-oss-20b's own experts (1.6 GB walked cold; per expert at 1/4/16
#      tokens: the memory-bound read floor, the bare MLP, each kernel
#      (out_in, onednn, and pdflash's native C++ kernel: AMX / AVX-512 BF16),
#      the executor before (per-expert loop) and after (one call per job),
#      with a busy caller, and under a concurrent H2D copy; summary "diag"),
#      then gpt-oss-20b with bf16 experts over the link, c = 1, 4, 16, 3
#      interleaved repeats (PD+host's --host-format auto times native among
#      the candidates; the rows record the pick and the ISA that ran);
#   2. qwen3 (<= 150 s; the diagnostic alone ~75 s): the same diagnostic on Qwen3-30B-A3B's experts, then
#      c = 1, 4, as many repeats as fit.
# STEPS=all adds 3. gpt_oss_mxfp4 (<= 90 s; the host dequantizes every expert
# once): gpt-oss-20b with MXFP4 experts as stored, c = 1, 4 (the whole call
# then takes up to ~9 minutes, near the 10-minute limit of one call).
# Built and run through bench/h200/run.sh; under $OUT: results.jsonl (one
# summary per step), log.txt, and <step>/rows.jsonl + <step>/summary.json.
# Usage (repository root): OUT=/path/to/out bash bench/h200/issue16.sh
# SMOKE=1 runs the same steps on the tiny CPU shapes (a local typo check).
# HOST_MAX_RATIO / HOST_MAX_TOKENS / HOST_FORMAT override PD+host's
# max_host_ratio and max_host_tokens (default: the planner's, 1.5 and 16; 0
# tokens: no cap) and host weight format (default auto: timed at start).
set -uo pipefail
OUT=${OUT:-$PWD/out}
export OUT
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
here=$(cd "$(dirname "$0")" && pwd)
# 16 cores: 14 torch intra-op threads for the host pool (one core for the
# engine's Python thread, one for the H2D issuer's thread), one worker
extra="--host-max-ratio ${HOST_MAX_RATIO:-1.5} --host-max-tokens ${HOST_MAX_TOKENS:-16}"
extra="$extra --host-format ${HOST_FORMAT:-auto}"
common="--cache 0.2 --repeats 3 --host-threads ${HOST_THREADS:-14} --host-workers 1 $extra"
gpt=gpt-oss-20b qwen=qwen3-30b-a3b layers=8 t1=270 t2=150 t3=90 b1=220 b2=120 b3=75
diag="--diag --diag-bytes 1.6e9"
if [ "${SMOKE:-0}" = 1 ]; then
  gpt=tiny-gpt_oss qwen=tiny-qwen3_moe layers=0 t1=300 t2=300 t3=300 b1=60 b2=30 b3=30
  common="--cache 0.5 --repeats 1 --host-threads ${HOST_THREADS:-2} --host-workers 1 $extra"
  diag="--diag --diag-bytes 1e6"
fi
py="python3 bench/h200/issue16.py $common --layers $layers"
steps=(
  "gpt_oss_bf16=timeout -k 5 $t1 $py --archs $gpt --concurrency 1,4,16 $diag --budget-s $b1 --out \"$OUT/gpt_oss_bf16\""
  "qwen3=timeout -k 5 $t2 $py --archs $qwen --concurrency 1,4 $diag --budget-s $b2 --out \"$OUT/qwen3\""
)
if [ "${STEPS:-}" = all ]; then
  steps+=("gpt_oss_mxfp4=timeout -k 5 $t3 $py --archs $gpt --concurrency 1,4 --synthetic-format mxfp4 --budget-s $b3 --out \"$OUT/gpt_oss_mxfp4\"")
fi
exec bash "$here/run.sh" "${steps[@]}"
