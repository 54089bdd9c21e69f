#!/usr/bin/env bash
# The eager offloaded verify step's host time on the H200 after the
# eagerbooks changes (trace replay pre-indexed with one copy and no per-layer
# read, cache books' fast paths, one row-phase upload per group): the same
# two eager_host commands as the session-8 call 4 profile (its raw rows:
# bench/results/h200/session8-2026-12-02/call4-profile-densefused/profile/
# results.jsonl, steps host_c1 and host_c16), plus the CUDA sync-count tests
# of the routing reads and the trace replay. Steps (bench/h200/run.sh style):
#   gputests   the routed read-back / lookahead / trace-replay sync counts
#   host_c1    8 layers, cache 0.2, c=1 x 2 tokens, routing replayed, --detail
#   host_c16   the same at c=16 x 16 tokens
# Compare parts_us (trace_begin, trace_route, books, lookahead_router,
# lookahead), forward_us and syncs.torch_syncs_per_step with the session-8
# rows (c1: forward 35.1 ms, 28 syncs per step).
# Every result and the log are packed into ONE file, $OUT/eager_check.tar.gz.
# Expected: build ~30-60 s, gputests ~15 s, each host step ~20 s: about
# 1.5 minutes.
#   OUT=/path bash bench/h200/eager_check.sh
set -uo pipefail
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
# the steps write under WORK; run.sh packs it into ONE file in $OUT after each step
WORK=$(mktemp -d)
. "$(dirname "$0")/trace_args.sh"
HOST="python3 -P -m pdflash.bench.eager_host --device cuda --layers 8 --cache-fraction 0.2 --steps 30 --trace $TRACE --arch gpt_oss"
PACK="$OUT/eager_check.tar.gz" OUT=$WORK bash "$(dirname "$0")/run.sh" \
  "gputests=timeout 120 python3 -P -m pytest -q -p no:cacheprovider tests/models/test_routed_readback_gpu.py tests/engine/test_replay_vectorised.py" \
  "host_c1=timeout 90 $HOST --requests 1 --tokens 2 --detail" \
  "host_c16=timeout 90 $HOST --requests 16 --tokens 16"
rc=$?
ls -la "$OUT"
exit $rc
