#!/usr/bin/env bash
# The native host kernel on MXFP4 experts' own bytes (host format
# native_mxfp4; issues 16 and 13) on the H200's host: its first run on a CPU
# with AMX. Steps (bench/h200/run.sh style):
#   tests   tests/hybrid/test_native_mxfp4.py and test_native_mlp.py: the
#           MXFP4 kernel bit for bit against the bf16 kernel on the
#           dequantized experts, for every ISA this CPU runs (AMX included
#           here; the 2-core dev box has none), and the native kernel's own
#           tests
#   paths   bench/h200/diag_host_experts.py --sections paths on one
#           gpt-oss-20b-shaped MXFP4 layer (synthetic), 14 threads: per
#           expert at 1/4/16 tokens, cold, read floors of the bf16 copy and
#           of the MXFP4 bytes, kernel and executor times of native and
#           native_mxfp4 (the summary line is the step's result)
# Decides: whether native_mxfp4 runs correctly with AMX, and how far below
# native's ~580 us per expert (session 7) it gets against a ~250 us copy of
# the 13.2 MB MXFP4 expert over the link (bench/results/cpu/hostmxfp4-2026-12-04/
# has the 2-core box's relative figures).
# Everything is packed into ONE file, $OUT/hostmxfp4_check.tgz. Expected:
# build ~30 s, tests ~20 s, paths ~2 minutes (capped at 240 s).
#   OUT=/path bash bench/h200/hostmxfp4_check.sh
# SMOKE=1: the tiny gpt-oss shape on 2 threads (a local check of the script).
set -uo pipefail
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
WORK=$(mktemp -d)
DIAG="python3 -P bench/h200/diag_host_experts.py --synthetic-format mxfp4 --dtype bfloat16"
DIAG="$DIAG --sections paths --tokens 1,4,16"
if [ "${SMOKE:-0}" = 1 ]; then
  DIAG="$DIAG --arch tiny-gpt_oss --layers 0 --threads 2 --experts 4 --repeats 1"
else
  DIAG="$DIAG --arch gpt-oss-20b --layers 1 --threads 14 --experts 16 --repeats 3"
fi
steps=(
  "tests=timeout 120 python3 -P -m pytest -q -p no:cacheprovider -rs tests/hybrid/test_native_mxfp4.py tests/hybrid/test_native_mlp.py"
  "paths=timeout 240 $DIAG"
)
PACK="$OUT/hostmxfp4_check.tgz" OUT=$WORK bash "$(dirname "$0")/run.sh" "${steps[@]}"
rc=$?
rm -rf "$WORK"
ls -la "$OUT"
exit "$rc"
