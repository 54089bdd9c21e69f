#!/usr/bin/env bash
# The HOST part's stream hand-off on the H200 (issue 16, requirement 2:
# "nothing waits on the host in the GPU stream except the final add"):
# --host-handoff thread (the forward's thread blocks in the HOST job's
# result) vs stream (it enqueues a device wait on a host-set flag, the
# upload and the add, and goes on). Steps (bench/h200/run.sh style):
#   gputests     tests/hybrid/test_handoff_gpu.py (the device wait orders the
#                upload after the host's write; a layer's output equals the
#                thread hand-off's exactly; the forward's thread returns
#                before a slow host job; a failed job raises; a lost job
#                times out instead of hanging) and the CPU protocol tests
#   gputests_thread  the two existing hosting-layer GPU tests (thread hand-off)
#   big_thread   eager_host forced hosting (every miss HOST, native kernel,
#                gpt-oss-20b-shaped layers, 14 host threads), thread hand-off
#   big_stream   the same, stream hand-off
#   summary      one JSON line: per step the hand-off that ran (the reason
#                where stream fell back), forward_us (the thread's time),
#                forward_synced_us (to the device's end: the comparison),
#                the thread's wait per hosting layer, attention/router/readback
#   FULL=1 adds big_thread4 / big_stream4 (4 host threads, where the wait
#   was 3.4 ms per hosting layer): about a minute more.
# Decides: whether "stream" is safe on the H200 (gputests pass) and faster
# (verdict.stream_over_thread.forward_synced < 1 beyond the steps' spread),
# i.e. whether host_handoff's default should become "stream".
# Everything is packed into ONE file, $OUT/hostwait_check.tgz. Expected:
# build ~30 s, gputests ~40 s, big steps ~25-30 s each, summary 1 s: about
# 2.5 minutes (each step is capped).
#   OUT=/path bash bench/h200/hostwait_check.sh
set -uo pipefail
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
WORK=$(mktemp -d)
HOST="python3 -P -m pdflash.bench.eager_host --device cuda --cache-fraction 0.2 --arch gpt_oss --requests 1 --tokens 2"
BIG="$HOST --preset gpt-oss-20b --layers 4 --experts 16 --top-k 4 --steps 10 --host-format native --host-every 1"
steps=(
  "gputests=timeout 80 python3 -P -m pytest -q -p no:cacheprovider tests/hybrid/test_handoff_gpu.py tests/hybrid/test_host_signal.py"
  "gputests_thread=timeout 40 python3 -P -m pytest -q -p no:cacheprovider tests/hybrid/test_hybrid_gpu.py -k 'syncs_the_host_once or forward_with_host_misses'"
  "big_thread=timeout 50 $BIG --host-handoff thread"
  "big_stream=timeout 50 $BIG --host-handoff stream"
)
if [ "${FULL:-0}" = 1 ]; then
  steps+=(
    "big_thread4=timeout 50 $BIG --host-handoff thread --host-threads 4"
    "big_stream4=timeout 50 $BIG --host-handoff stream --host-threads 4"
  )
fi
steps+=("summary=python3 bench/h200/hostwait_summary.py \"\$OUT/results.jsonl\"")
PACK="$OUT/hostwait_check.tgz" OUT=$WORK bash "$(dirname "$0")/run.sh" "${steps[@]}"
rc=$?
ls -la "$OUT"
exit $rc
