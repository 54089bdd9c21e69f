#!/usr/bin/env bash
# The HOST part's cost on the eager offloaded forward's thread on the H200
# (issue 16): the per-piece thread time of a hosting layer and the other
# parts' times with every miss HOST vs every miss copied, forced planner
# (pdflash.bench.eager_host --host-every; rows say "forced": true). Steps
# (bench/h200/run.sh style):
#   cpuinfo    the host's CPU topology (are the cores hyperthread siblings?)
#   gputests   a hosting layer syncs the host once (the routing read); the
#              forced-host forward equals the all-copy one on CUDA
#   tiny_copy  tiny gpt_oss, 8 layers, cache 0.2, c=1 x 2 tokens, every miss
#              copied through the host hook (--host-every 0), --detail
#   tiny_host  the same, every miss HOST (--host-every 1)
#   big_copy   gpt-oss-20b-shaped layers (4, generated bf16 weights, 16
#              experts top-4 so the load stays short), every miss copied
#   big_host   the same, every miss HOST on the native kernel, all cores
#              but two (14 threads on the 16-core host)
#   big_host4  the same on 4 host threads: if the other parts' slow-down
#              with the host computing shrinks with fewer host threads, it is
#              the host's cores competing with the forward's thread
# Read: host.pieces_us_per_hosting_layer and host.own_us_per_hosting_layer
# (the HOST part's own thread time), and parts_us of *_copy vs *_host
# (attention, router, books, gemm, moe_rest, lookahead, glue_us): a part
# slower with the host computing at once is the interference of the host's
# compute with the forward's thread (big_*: expert-sized weights streamed by
# the host's cores). Every result and the log are packed into ONE file,
# $OUT/hostpath_check.tar.gz. Expected: build ~30-60 s, gputests ~20 s,
# tiny steps ~10 s each, big steps ~20-30 s each (mostly generating and
# packing 3.2 GB of experts): about 2 minutes (each step is capped).
#   OUT=/path bash bench/h200/hostpath_check.sh
set -uo pipefail
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
# the steps write under WORK; run.sh packs it into ONE file in $OUT after each step
WORK=$(mktemp -d)
HOST="python3 -P -m pdflash.bench.eager_host --device cuda --cache-fraction 0.2 --arch gpt_oss --requests 1 --tokens 2"
TINY="$HOST --layers 8 --steps 20 --detail"
BIG="$HOST --preset gpt-oss-20b --layers 4 --experts 16 --top-k 4 --steps 10 --host-format native"
PACK="$OUT/hostpath_check.tar.gz" OUT=$WORK bash "$(dirname "$0")/run.sh" \
  "cpuinfo=lscpu; grep -H . /sys/devices/system/cpu/cpu*/topology/thread_siblings_list | head -32" \
  "gputests=timeout 60 python3 -P -m pytest -q -p no:cacheprovider tests/hybrid/test_hybrid_gpu.py -k 'syncs_the_host_once or forward_with_host_misses'" \
  "tiny_copy=timeout 45 $TINY --host-every 0" \
  "tiny_host=timeout 45 $TINY --host-every 1" \
  "big_copy=timeout 50 $BIG --host-every 0" \
  "big_host=timeout 50 $BIG --host-every 1" \
  "big_host4=timeout 50 $BIG --host-every 1 --host-threads 4"
rc=$?
ls -la "$OUT"
exit $rc
