#!/usr/bin/env bash
# The stream hand-off's renewed ring on the H200 (session 12's flake: the
# device wait after a renew timed out). Steps (bench/h200/run.sh style):
#   gputests   tests/hybrid/test_handoff_gpu.py (with the new tests: a ring
#              dropped while a wait is pending, the old ring dropped by the
#              next layer's worker, 12 renews in a row) and the CPU tests
#   repeat     the session-12 test and the worker-drop test, 10 times each
#   freesync   bench/h200/handoff_free_sync.py: which host-memory calls wait
#              for a pending device wait (cudaFreeHost of a mapped ring is
#              expected to, an unmapped ring's drop not)
# Everything is packed into ONE file, $OUT/handoffrace_check.tgz. Expected:
# build ~30 s, gputests ~50 s, repeat ~60 s, freesync ~5 s: under 3 minutes
# (each step is capped).
#   OUT=/path bash bench/h200/handoffrace_check.sh
set -uo pipefail
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
WORK=$(mktemp -d)
T=tests/hybrid/test_handoff_gpu.py
REPEAT="for i in 1 2 3 4 5 6 7 8 9 10; do python3 -P -m pytest -q -p no:cacheprovider $T -k 'next_layer_is_clean or dropped_by_a_worker' || exit 1; done"
steps=(
  "gputests=timeout 100 python3 -P -m pytest -q -p no:cacheprovider $T tests/hybrid/test_host_signal.py"
  "repeat=timeout 150 bash -c \"$REPEAT\""
  "freesync=timeout 30 python3 -P bench/h200/handoff_free_sync.py"
)
PACK="$OUT/handoffrace_check.tgz" OUT=$WORK bash "$(dirname "$0")/run.sh" "${steps[@]}"
rc=$?
ls -la "$OUT"
exit $rc
