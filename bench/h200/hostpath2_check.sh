#!/usr/bin/env bash
# The hostpath2 branch on the H200: the eager offloaded verify step's host
# parts (--detail: books._phase_rows, books.device_slot_table,
# books.release, books.unpin_layer, ...) with the old per-layer host path
# patched in (bench/results/cpu/hostpath2-2026-12-02/hostpath2_old_path.py:
# a fresh page-locked tensor per slot-table upload, the [2, experts] phase
# table gathered on the device, a new CUDA event per release/unpin) and
# with the branch's (ring-staged uploads, phase rows chosen on the host,
# pooled slot events), on the issue-14/16 shape (bench/h200/run.sh style):
#   old_miss / new_miss   eager_host --stream, gpt-oss-20b preset, 4 layers,
#       16 experts top-4, cache 0.2, c=1 x 2 tokens: layers with misses
#   old_hit / new_hit     the same with cache 1.0 (pin_layer/unpin_layer)
#   count_*               hostpath2_count.py (2 steps): torch dispatches,
#       page-locked allocations and CUDA events (made / recorded / waited)
#       per MoE layer in each changed method, old (--old) and new
#   tests                 tests/models/test_hostpath_gpu.py (slowed-stream
#       staging checks, phase rows and the old/new differential on CUDA)
#       and the CPU ring/pool tests
# Compare parts_us.books and detail_us_mean["books.*"] (us per 4-layer
# step) old vs new; forward_us too; misses/copies per step must match.
# Every result and the log are packed into ONE file,
# $OUT/hostpath2_check.tar.gz. Expected: build ~30-60 s, each timed step
# ~10 s, each count ~8 s, tests ~20 s: about 2 minutes.
#   OUT=/path bash bench/h200/hostpath2_check.sh
set -uo pipefail
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
WORK=$(mktemp -d)
DIR=bench/results/cpu/hostpath2-2026-12-02
ARGS="--device cuda --arch gpt_oss --requests 1 --tokens 2 --preset gpt-oss-20b --layers 4 --experts 16 --top-k 4 --count-steps 1 --detail --stream"
OLD="import sys; sys.path.insert(0, '$DIR'); import hostpath2_old_path as o; o.install(); o.main()"
PACK="$OUT/hostpath2_check.tar.gz" OUT=$WORK bash "$(dirname "$0")/run.sh" \
  "old_miss=timeout 40 python3 -P -c \"$OLD\" $ARGS --steps 10 --cache-fraction 0.2" \
  "new_miss=timeout 40 python3 -P -m pdflash.bench.eager_host $ARGS --steps 10 --cache-fraction 0.2" \
  "old_hit=timeout 40 python3 -P -c \"$OLD\" $ARGS --steps 10 --cache-fraction 1.0" \
  "new_hit=timeout 40 python3 -P -m pdflash.bench.eager_host $ARGS --steps 10 --cache-fraction 1.0" \
  "count_miss_old=timeout 30 python3 -P $DIR/hostpath2_count.py --old $ARGS --steps 2 --cache-fraction 0.2" \
  "count_miss_new=timeout 30 python3 -P $DIR/hostpath2_count.py $ARGS --steps 2 --cache-fraction 0.2" \
  "count_hit_old=timeout 30 python3 -P $DIR/hostpath2_count.py --old $ARGS --steps 2 --cache-fraction 1.0" \
  "count_hit_new=timeout 30 python3 -P $DIR/hostpath2_count.py $ARGS --steps 2 --cache-fraction 1.0" \
  "tests=timeout 60 python3 -P -m pytest -q -p no:cacheprovider tests/models/test_hostpath_gpu.py tests/cache/test_staging.py tests/cache/test_slot_events.py"
rc=$?
ls -la "$OUT"
exit $rc
