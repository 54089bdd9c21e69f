#!/usr/bin/env bash
# One H200 call (<= ~4 minutes with the ~25 s build) for issue 13's verify
# target: B3 (every expert resident) at c=16, 8 layers, gpt-oss-20b and
# Qwen3-30B-A3B shapes, CUDA graphs off and auto interleaved in one process
# per arch, 3 repeats, with the verify breakdown and the HBM roofline of each
# verify forward (pdflash.engine.roofline: non-expert parameters, gathered
# embedding rows, distinct routed experts x stored bytes, KV read; divided by
# a device-to-device copy probe's bandwidth). Each step runs under a hard
# timeout (rows are written as runs finish, so a cut step keeps what it ran).
#   OUT=/path bash bench/h200/roofline_check.sh
# Steps (through bench/h200/run.sh):
#   b3_gptoss / b3_qwen3  rows with verify_breakdown_ms, verify_roofline (bytes
#            per forward by part, verify_ms, the probe's method), hbm_gbps,
#            hbm_roofline_ms, verify_over_roofline, cuda_graphs,
#            compressed_gemm(_reason)
#   summary  roofline_summary.json (bench/h200/graphs_summary.py: per arch,
#            baseline and graphs setting the means, and every run); prints one
#            line per run: verify_ms, hbm_roofline_ms, verify_over_roofline
# Everything (rows, log.txt, results.jsonl, the summary) is packed into ONE
# file, $OUT/roofline_check.tgz, after every step; nothing else is left
# under $OUT (the work happens in $WORK, default /tmp/roofline_check).
# MXFP4=1 adds b3_gptoss_mxfp4 (<= 75 s more): gpt-oss-20b with MXFP4 experts
# as stored (--synthetic-format mxfp4; the fused dequantize-GEMM by default,
# rows' compressed_gemm/_reason say which ran), graphs auto, 2 repeats.
# SMOKE=1: the same steps on the tiny CPU shapes, c=4, 1 repeat (a local
# check of the script; the roofline's times are then null with the reason).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$PWD/out}
WORK=${WORK:-/tmp/roofline_check}
rm -rf "$WORK"
mkdir -p "$WORK" "$OUT"
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
TAR="$OUT/roofline_check.tgz"
gpt=gpt-oss-20b qwen=qwen3-30b-a3b layers=8 conc=16 repeats=3 t1=115 t2=95 t3=75
if [ "${SMOKE:-0}" = 1 ]; then
  gpt=tiny-gpt_oss qwen=tiny-qwen3_moe layers=2 conc=4 repeats=1 t1=300 t2=300 t3=300
fi
ENG="pdflash-bench engine --json --layers $layers --max-new-tokens 32 --prompt-len 32 --baselines B3 --concurrency $conc --breakdown --cuda-graphs off,auto --repeats $repeats"
steps=(
  "b3_gptoss=timeout -k 5 $t1 $ENG --arch $gpt --out $WORK/b3_gptoss"
  "b3_qwen3=timeout -k 5 $t2 $ENG --arch $qwen --out $WORK/b3_qwen3"
)
dirs="$WORK/b3_gptoss $WORK/b3_qwen3"
if [ "${MXFP4:-0}" = 1 ]; then
  MX="${ENG/--cuda-graphs off,auto --repeats $repeats/--cuda-graphs auto --repeats 2} --synthetic-format mxfp4"
  steps+=("b3_gptoss_mxfp4=timeout -k 5 $t3 $MX --arch $gpt --out $WORK/b3_gptoss_mxfp4")
  dirs="$dirs $WORK/b3_gptoss_mxfp4"
fi
steps+=(
  "summary=python3 $HERE/graphs_summary.py $dirs --out $WORK/roofline_summary.json"
)
# run.sh writes its log and results.jsonl under its own OUT: the work folder
PACK=$TAR OUT=$WORK exec bash "$HERE/run.sh" "${steps[@]}"
