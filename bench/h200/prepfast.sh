#!/usr/bin/env bash
# Host weight preparation on the H200 (the device path: each expert copied
# to the GPU, packed there, copied back): prepare_all with 1 thread vs 8
# (PREPARE_MAX_THREADS) for the native format, alternating, and auto once;
# gpt-oss-20b shape, 1 MoE layer x 32 experts (1.6 GB of host weights),
# synthetic bf16, one fresh process per step (bench/h200/prep_time.py).
# Read: each step's JSON line in log.txt / results.jsonl: prepare_s (t1 vs
# t8), the digests (every prepared tensor's sha256) must be equal across
# all native steps and auto's (if it chose native), select_s and
# sample_reused for auto.
# Everything is packed into ONE file, $OUT/prepfast.tgz.
# Expected: build ~30 s, then 5 steps of ~10-20 s each: under 2 minutes.
#   OUT=/path bash bench/h200/prepfast.sh      (SMOKE=1: tiny shape on the CPU)
set -uo pipefail
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
WORK=$(mktemp -d)
args="--preset gpt-oss-20b --layers 1 --experts 32 --device cuda"
[ "${SMOKE:-0}" = 1 ] && args="--preset tiny --layers 2 --experts 8 --device cpu"
P="timeout -k 5 60 python3 -P bench/h200/prep_time.py --dir $PDFLASH_CACHE/prepfast $args --digest"
PACK="$OUT/prepfast.tgz" OUT=$WORK bash "$(dirname "$0")/run.sh" \
  "t1=$P --fmt native --prepare-threads 1" \
  "t8=$P --fmt native --prepare-threads 8" \
  "t1b=$P --fmt native --prepare-threads 1" \
  "t8b=$P --fmt native --prepare-threads 8" \
  "auto=$P --fmt auto"
grep '^{' "$WORK/log.txt"
rm -rf "$WORK"
ls -la "$OUT"
