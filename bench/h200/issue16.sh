#!/usr/bin/env bash
# Issue 16 on the H200: PD+host (hybrid miss service) vs PD, gpt-oss-20b and
# Qwen3-30B-A3B shapes truncated to 8 MoE layers (synthetic bf16 weights),
# cache 0.2 and 0.5, c = 1, 4, 16, 3 interleaved repeats; at most ~4.5 minutes
# (the runs stop starting after --budget-s; the summary says how many
# repeats each point got). Built and run through bench/h200/run.sh; results
# under $OUT: results.jsonl (the step's summary), log.txt, issue16/rows.jsonl
# and issue16/summary.json. Usage (repository root):
#   OUT=/path/to/out bash bench/h200/issue16.sh [extra issue16.py options]
set -uo pipefail
OUT=${OUT:-$PWD/out}
export OUT
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
here=$(cd "$(dirname "$0")" && pwd)
extra=""
[ $# -gt 0 ] && extra=$(printf ' %q' "$@")
# 16 cores: the host expert pool gets 14 torch intra-op threads (one core for
# the engine's Python thread, one for the H2D issuer's thread), one worker
exec bash "$here/run.sh" \
  "issue16=python3 bench/h200/issue16.py --out \"$OUT/issue16\" --host-threads 14 --host-workers 1 --budget-s 250${extra}"
