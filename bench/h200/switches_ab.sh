#!/usr/bin/env bash
# Issue 16's PD+host switches on the H200, each A/B'd against the same
# PD+host in ONE process (one model load, one host-weight preparation for
# all of them): bench/h200/issue16.py --arms
#   PD        the PD baseline
#   host      PD+host as it is by default (the reference arm; its
#             --host-affinity is auto, the default since session 11)
#   stream    PD+host --host-handoff stream (a device-side wait on the
#             host's flag instead of the forward's thread blocking)
#   noaffinity  PD+host --host-affinity off (no thread placement: the
#             default before session 11)
#   weighted  PD+host --host-ahead weighted (the pre-verify plan weights a
#             predicted expert by its measured routed probability)
# gpt-oss-20b shape, 8 MoE layers, synthetic bf16 weights, forced
# acceptance, 24 new tokens, 14 host threads, 1 worker, host format auto,
# points cache 0.2 c=1 and c=4; every repeat runs each arm once per point,
# the order rotated each repeat and point, until BUDGET_S.
# Read: the table printed last (also in log.txt) (and engine/summary.json
# points[].comparisons, keyed ARM/OTHER: per-repeat ratios, their median,
# the verdict from the pairs' 95% interval; by_arm: the mechanism):
#   stream/host    whether the stream hand-off earns the default (faster or
#                  within noise and never slower; by_arm.stream.handoff.ran
#                  must say "stream" for every run: else the fallback
#                  reason says why it did not run)
#   noaffinity/host  whether --host-affinity auto keeps its default
#                  (host's by_arm.host.affinity.applied_runs = runs, i.e.
#                  the placement was applied; noaffinity not faster)
#   weighted/host  whether --host-ahead weighted earns the default; its rows
#                  should show more host served and planned-ahead experts,
#                  fewer bytes per token and lower link busy than host's,
#                  p_end near the ahead outcome's routed/seen
#   host/PD, */PD  the issue's >= 1.5x target at c=1 and c=4, cache 0.2
# (bench/h200/affinity_ab.sh keeps affinity's eager-host steps: the
# forward's own parts with the host pool working, affinity off vs auto.)
# Everything is packed into ONE file, $OUT/switches_ab.tgz (after the build
# and after the step: a call cut by its limit still returns what finished).
# Expected: build ~30 s; the step's first run loads the model and prepares
# the host weights (~40-55 s), then ~10 runs (5 arms x 2 points) per repeat
# at ~3-5 s each until BUDGET_S (default 250: about 5 repeats); the step is
# killed at BUDGET_S + 50 s: under 6 minutes in all.
#   OUT=/path bash bench/h200/switches_ab.sh
# BUDGET_S / REPEATS (default 8) / MAX_NEW / POINTS / ARMS / ARCH (default
# gpt-oss-20b) / EXTRA (more issue16.py options) override; NAME names the
# tar and the table's heading
# (default switches_ab; bench/h200/aheadsplit_ab.sh is this with its own
# arms, points and name); SUMMARY=script.py runs `python3 script.py DIR` on
# the unpacked results (DIR/engine/rows.jsonl) and packs what it writes
# there into the tar too (bench/h200/width_summary.py and its kin); SMOKE=1: the tiny CPU shape (a local check of the
# script).
set -uo pipefail
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
WORK=$(mktemp -d)
budget=${BUDGET_S:-250}
hard=$((${budget%.*} + 50))
arch=${ARCH:-gpt-oss-20b} layers=8 threads=${HOST_THREADS:-14} points=${POINTS:-0.2:1,0.2:4}
if [ "${SMOKE:-0}" = 1 ]; then
  arch=tiny-gpt_oss layers=0 threads=${HOST_THREADS:-2} points=${POINTS:-0.5:1,0.5:4}
fi
arms=${ARMS:-PD,host=PD+host,stream=PD+host:host_handoff=stream,noaffinity=PD+host:host_affinity=off,weighted=PD+host:host_ahead=weighted}
ENGINE="python3 bench/h200/issue16.py --archs $arch --layers $layers --points $points"
ENGINE="$ENGINE --repeats ${REPEATS:-8} --max-new-tokens ${MAX_NEW:-24} --host-threads $threads"
ENGINE="$ENGINE --host-workers 1 --host-format auto --budget-s $budget --arms '$arms' ${EXTRA:-}"
ENGINE="$ENGINE --out \"\$OUT/engine\""
name=${NAME:-switches_ab}
PACK="$OUT/$name.tgz" OUT=$WORK bash "$(dirname "$0")/run.sh" "engine=timeout -k 5 $hard $ENGINE"
rc=$?
# the step's rc (run.sh's own is its log tail's); then the compact table
rc=$(python3 -c 'import json,sys; print(max([json.loads(l)["rc"] for l in open(sys.argv[1])] or [1]))' "$WORK/results.jsonl" 2>/dev/null || echo 1)
echo "== $name: engine rc=$rc"
sed -n '/^issue16 arms:/,/^{/p' "$WORK/log.txt" | grep -v '^{'
if [ -n "${SUMMARY:-}" ]; then
  # the caller's summary of the rows, written beside them, then packed again
  python3 "$SUMMARY" "$WORK"
  tar czf "$OUT/$name.tgz.tmp" -C "$WORK" . && mv "$OUT/$name.tgz.tmp" "$OUT/$name.tgz"
fi
rm -rf "$WORK"
ls -la "$OUT"
exit "$rc"
