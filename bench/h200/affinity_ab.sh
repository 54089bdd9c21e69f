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
#   engine          bench/h200/affinity_ab.py: PD+host, gpt-oss-20b shape,
#                   8 layers, 24 new tokens, points 0.2:1 and 0.2:4 (as
#                   issue16_check.sh POINTS=0.2:1,0.2:4), off and auto
#                   interleaved in one process, 14 host threads
# Read: big_host_*: result.parts_us (attention, router, gemm, ...) and
# result.host (wait/own/pieces per hosting layer, affinity: what was placed);
# the reference without host compute is session 10 call 2's big_copy
# (attention 4.4 ms, router 1.3 ms). engine: summary.json points[].verdict
# ("auto faster" / "auto slower" / "within noise" from 95% intervals),
# pair_ratio_median (auto / off per repeat) and by_setting (host wait, busy
# fractions, the placement each row recorded). auto earns the default only
# if the forward's parts come back toward big_copy's and the engine's
# tokens/s is not slower at either point.
# Everything under $OUT is packed into ONE file, $OUT/affinity_ab.tar.gz.
# Expected: build ~5-60 s, big steps ~35 s each, engine ~90 s (its first run
# loads and prepares the host weights, ~40 s): about 3 minutes.
# BUDGET_S (engine's start-runs budget, default 80) / REPEATS override.
#   OUT=/path bash bench/h200/affinity_ab.sh
set -uo pipefail
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
OUT=${OUT:-$PWD/out}
export OUT
mkdir -p "$OUT"
budget=${BUDGET_S:-80}
hard=$((budget + 40))
HOST="python3 -P -m pdflash.bench.eager_host --device cuda --cache-fraction 0.2 --arch gpt_oss --requests 1 --tokens 2"
BIG="$HOST --preset gpt-oss-20b --layers 4 --experts 16 --top-k 4 --steps 10 --host-format native --host-every 1"
ENGINE="python3 bench/h200/affinity_ab.py --points 0.2:1,0.2:4 --repeats ${REPEATS:-8} --max-new-tokens 24"
ENGINE="$ENGINE --host-threads 14 --host-workers 1 --budget-s $budget --out $OUT/engine"
bash "$(dirname "$0")/run.sh" \
  "cpuinfo=python3 -c 'import os; print(sorted(os.sched_getaffinity(0)))'; grep -H . /sys/devices/system/cpu/cpu*/topology/thread_siblings_list | head -32" \
  "big_host_off=timeout 50 $BIG --host-affinity off" \
  "big_host_auto=timeout 50 $BIG --host-affinity auto" \
  "engine=timeout -k 5 $hard $ENGINE"
rc=$?
# one file back: every result and the log
PACK=$(mktemp -d)/affinity_ab.tar.gz
tar -C "$OUT" -czf "$PACK" . && rm -rf "${OUT:?}"/* && mv "$PACK" "$OUT/"
ls -la "$OUT"
exit $rc
