#!/usr/bin/env bash
# Issue 16 on the H200 in ONE device call (<= ~5 minutes including the build):
# PD+host (hybrid miss service) vs PD, 8 MoE layers, synthetic weights,
# cache 0.2, 3 interleaved repeats, most important first, each step under a
# hard timeout (its runs stop starting at --budget-s; rows are written as
# they finish, so a step cut by its timeout keeps what it ran):
#   1. gpt_oss_bf16 (140 s): the executor diagnostic (executor vs bare MLP per
#      expert, both layouts, every host format; summary "diag"), then
#      gpt-oss-20b with bf16 experts over the link, c = 1, 4, 16;
#   2. gpt_oss_mxfp4 (90 s; the host dequantizes every expert once): gpt-oss-20b with MXFP4 experts as stored (host
#      memory, link and slab), c = 1, 4;
#   3. qwen3 (45 s): Qwen3-30B-A3B, c = 1, 4, as many repeats as fit.
# Built and run through bench/h200/run.sh; under $OUT: results.jsonl (one
# summary per step), log.txt, and <step>/rows.jsonl + <step>/summary.json.
# Usage (repository root): OUT=/path/to/out bash bench/h200/issue16.sh
# SMOKE=1 runs the same steps on the tiny CPU shapes (a local typo check).
# HOST_MAX_RATIO (default 1.0, the planner's default) sets PD+host's
# max_host_ratio: HOST_MAX_RATIO=1.3 lets the host take experts up to 1.3x
# slower than a copy (see pdflash/hybrid/planner.py; c=16 stays COPY when
# the host's cost is near the bare MLP's).
set -uo pipefail
OUT=${OUT:-$PWD/out}
export OUT
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
here=$(cd "$(dirname "$0")" && pwd)
# 16 cores: 14 torch intra-op threads for the host pool (one core for the
# engine's Python thread, one for the H2D issuer's thread), one worker
ratio="--host-max-ratio ${HOST_MAX_RATIO:-1.0}"
common="--cache 0.2 --repeats 3 --host-threads ${HOST_THREADS:-14} --host-workers 1 $ratio"
gpt=gpt-oss-20b qwen=qwen3-30b-a3b layers=8 t1=140 t2=90 t3=45 b1=110 b2=75 b3=35
if [ "${SMOKE:-0}" = 1 ]; then
  gpt=tiny-gpt_oss qwen=tiny-qwen3_moe layers=0 t1=300 t2=300 t3=300 b1=60 b2=30 b3=30
  common="--cache 0.5 --repeats 1 --host-threads ${HOST_THREADS:-2} --host-workers 1 $ratio"
fi
py="python3 bench/h200/issue16.py $common --layers $layers"
exec bash "$here/run.sh" \
  "gpt_oss_bf16=timeout -k 5 $t1 $py --archs $gpt --concurrency 1,4,16 --diag --budget-s $b1 --out \"$OUT/gpt_oss_bf16\"" \
  "gpt_oss_mxfp4=timeout -k 5 $t2 $py --archs $gpt --concurrency 1,4 --synthetic-format mxfp4 --budget-s $b2 --out \"$OUT/gpt_oss_mxfp4\"" \
  "qwen3=timeout -k 5 $t3 $py --archs $qwen --concurrency 1,4 --budget-s $b3 --out \"$OUT/qwen3\""
