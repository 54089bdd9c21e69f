#!/usr/bin/env bash
# --host-affinity off vs auto on the H200 (issue 16: with the 14-thread host
# pool working, the forward thread's own parts got slower: attention 7.5 vs
# 4.4 ms, router 2.4 vs 1.3 ms per step, session 10 call 2). auto keeps the
# forward and issuer threads on two cores the host pool's threads never use
# (pdflash.hybrid.affinity). Steps (bench/h200/run.sh style):
#   cpuinfo         the CPUs this process may use and their SMT siblings
#   big_host_off    hostpath_check.sh's big_host point (gpt-oss-20b-shaped
#                   layers, 4 layers, 16 experts top-4, every miss HOST on the
#                   native kernel, all cores but two), affinity off
#   big_host_auto   the same, affinity auto
# The engine's tokens/s, off vs auto (PD+host, interleaved with the other
# switches in one process): bench/h200/switches_ab.sh.
# Read: big_host_*: result.parts_us (attention, router, gemm, ...) and
# result.host (wait/own/pieces per hosting layer, affinity: what was placed);
# the reference without host compute is session 10 call 2's big_copy
# (attention 4.4 ms, router 1.3 ms). auto earns the default only if the
# forward's parts come back toward big_copy's here and switches_ab.sh's
# affinity/host is not slower at either point.
# Everything under $OUT is packed into ONE file, $OUT/affinity_ab.tar.gz.
# Expected: build ~5-60 s, big steps ~35 s each: under 2 minutes.
#   OUT=/path bash bench/h200/affinity_ab.sh
set -uo pipefail
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
OUT=${OUT:-$PWD/out}
export OUT
mkdir -p "$OUT"
HOST="python3 -P -m pdflash.bench.eager_host --device cuda --cache-fraction 0.2 --arch gpt_oss --requests 1 --tokens 2"
BIG="$HOST --preset gpt-oss-20b --layers 4 --experts 16 --top-k 4 --steps 10 --host-format native --host-every 1"
bash "$(dirname "$0")/run.sh" \
  "cpuinfo=python3 -c 'import os; print(sorted(os.sched_getaffinity(0)))'; grep -H . /sys/devices/system/cpu/cpu*/topology/thread_siblings_list | head -32" \
  "big_host_off=timeout 50 $BIG --host-affinity off" \
  "big_host_auto=timeout 50 $BIG --host-affinity auto"
rc=$?
# one file back: every result and the log
PACK=$(mktemp -d)/affinity_ab.tar.gz
tar -C "$OUT" -czf "$PACK" . && rm -rf "${OUT:?}"/* && mv "$PACK" "$OUT/"
ls -la "$OUT"
exit $rc
