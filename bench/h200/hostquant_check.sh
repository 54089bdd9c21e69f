#!/usr/bin/env bash
# The native host kernel on quantized experts' own bytes (host formats
# native_mxfp4 and native_fp8; issues 16 and 13) on the H200's host: their
# first run on a CPU with AMX (session 33: bench/results/h200/session33-2026-12-05/).
# Steps (bench/h200/run.sh style):
#   tests      tests/hybrid/test_native_mxfp4.py, test_native_fp8.py and
#              test_native_mlp.py: the MXFP4 kernel bit for bit against the
#              bf16 kernel on the dequantized experts, FP8's every code
#              decoded exactly and its kernel against the reference, for
#              every ISA this CPU runs (AMX included here; the 2-core dev box
#              has none), and the native kernel's own tests
#   paths_mxfp4  bench/h200/diag_host_experts.py --sections paths on one
#              gpt-oss-20b-shaped MXFP4 layer (synthetic), 14 threads: per
#              expert at 1/4/16 tokens, cold, the read floors of the bf16
#              copy and of the stored bytes, kernel and executor times of
#              native and native_mxfp4 (the summary line is the step's result)
#   paths_fp8  the same on one Qwen3-30B-A3B-shaped layer stored as FP8
#              (--expert-dtype fp8): native against native_fp8
# Decides: whether the quantized kernels run correctly with AMX, and how far
# below native's time per expert (session 7: ~580 us gpt-oss-20b, ~140 us
# Qwen3-30B-A3B) they get against the link's copy of the stored bytes (~250
# us for the 13.2 MB MXFP4 expert, ~90 us for the 4.7 MB FP8 one);
# bench/results/cpu/hostquant-2026-12-04/ has the 2-core box's relative figures.
# Everything is packed into ONE file, $OUT/hostquant_check.tgz. Expected:
# build ~30 s, tests ~30 s, each paths step ~2 minutes (capped at 200 s).
#   OUT=/path bash bench/h200/hostquant_check.sh
# SMOKE=1: the tiny shapes on 2 threads (a local check of the script).
set -uo pipefail
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
WORK=$(mktemp -d)
DIAG="python3 -P bench/h200/diag_host_experts.py --dtype bfloat16 --sections paths --tokens 1,4,16"
if [ "${SMOKE:-0}" = 1 ]; then
  MX="--arch tiny-gpt_oss" F8="--arch tiny-qwen3_moe"
  DIAG="$DIAG --layers 0 --threads 2 --experts 4 --repeats 1"
else
  MX="--arch gpt-oss-20b --experts 16" F8="--arch qwen3-30b-a3b --experts 32"
  DIAG="$DIAG --layers 1 --threads 14 --repeats 3"
fi
steps=(
  "tests=timeout 120 python3 -P -m pytest -q -p no:cacheprovider -rs tests/hybrid/test_native_mxfp4.py tests/hybrid/test_native_fp8.py tests/hybrid/test_native_mlp.py"
  "paths_mxfp4=timeout 200 $DIAG $MX --synthetic-format mxfp4"
  "paths_fp8=timeout 200 $DIAG $F8 --expert-dtype fp8"
)
PACK="$OUT/hostquant_check.tgz" OUT=$WORK bash "$(dirname "$0")/run.sh" "${steps[@]}"
rc=$?
rm -rf "$WORK"
ls -la "$OUT"
exit "$rc"
