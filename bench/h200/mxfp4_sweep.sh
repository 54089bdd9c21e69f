#!/usr/bin/env bash
# The fused MXFP4 expert MLP's variant x tile grid on the H200
# (bench/h200/mxfp4_sweep.py): which orientation (SWAP_AB), bytes-ahead
# depth (PREFETCH) and tiles read gpt-oss-20b's MXFP4 experts fastest, at
# 16/64/256 tokens, each point checked against a dequantized fp32 reference.
# Compiles in SHARDS parallel processes first (Triton's cache, then shared),
# then times every point in one process. Tar: $OUT/mxfp4_sweep.tgz (sweep.json,
# the timing run's log with a table sorted per token count, compile logs).
#   OUT=/path bash bench/h200/mxfp4_sweep.sh
# SKIP_BUILD=1 as bench/h200/run.sh (bench/h200/build_tree.sh); SHARDS (14), COMPILE_S (150), TIME_S (150);
# ARGS: more mxfp4_sweep.py options for both runs (e.g. --variants scaled --configs 64:128:4:3).
set -uo pipefail
OUT=${OUT:-$PWD/out}
WORK=$(mktemp -d)
mkdir -p "$OUT"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/mxfp4_sweep.triton}
bash "$(dirname "$0")/build_tree.sh" "$PWD" >"$WORK/build.txt" 2>&1
shards=${SHARDS:-14}
t0=$(date +%s)
for i in $(seq 0 $((shards - 1))); do
  timeout -k 5 "${COMPILE_S:-150}" python3 -P bench/h200/mxfp4_sweep.py --compile-only \
    --shard "$i/$shards" ${ARGS:-} --json >"$WORK/compile_$i.json" 2>"$WORK/compile_$i.log" &
done
wait
echo "compile: $(( $(date +%s) - t0 )) s" | tee "$WORK/timing.txt"
t0=$(date +%s)
timeout -k 5 "${TIME_S:-150}" python3 -P bench/h200/mxfp4_sweep.py ${ARGS:-} --json \
  --budget-s $(( ${TIME_S:-150} - 30 )) >"$WORK/sweep.json" 2>"$WORK/sweep.log"
rc=$?
echo "timing: rc=$rc $(( $(date +%s) - t0 )) s" | tee -a "$WORK/timing.txt"
grep " tok " "$WORK/sweep.log" | head -400
tar czf "$OUT/mxfp4_sweep.tgz" -C "$WORK" .
rm -rf "$WORK"
exit $rc
