#!/usr/bin/env bash
# --host-ahead certain vs weighted on the H200 (issue 16: at cache 0.2, c=4
# PD+host read 1.25-1.33x of PD against 1.5x, link-bound; the pre-verify
# plan's HOST experts were routed only 69-78% of the time, so the plan
# copies ahead experts it could host). One step, bench/h200/hostahead_ab.py:
# gpt-oss-20b shape, 8 MoE layers, synthetic bf16 weights, forced
# acceptance, 24 new tokens, 14 host threads, 1 worker, host format auto,
# points cache 0.2 c=4 then c=1, three arms interleaved in ONE process
# (PD, PD+host --host-ahead certain, PD+host --host-ahead weighted; the
# order rotates), until --budget-s.
# Read: the table at the end of log.txt (and engine/summary.json):
# weighted/certain's per-repeat ratio median and verdict (95% intervals) at
# c=4 decides whether weighted becomes the default: it earns it if it is
# faster (or within noise and not slower at c=1) AND its rows show what the
# rule predicts: more host served experts and planned-ahead experts, fewer
# link bytes per token and link busy lower than certain's, p_end (the
# routed fraction the planner ended with) near the ahead outcome's
# routed/seen. weighted/PD and certain/PD are the issue's 1.5x question.
# Everything under the work folder is packed into ONE file,
# $OUT/hostahead_ab.tgz (after the build and after the step: a call cut by
# its limit still returns what finished).
# Expected: build ~30 s, engine step <= BUDGET_S (default 130) + the run in
# flight (its first run loads and prepares the host weights, ~40-55 s), the
# step killed at BUDGET_S + 45 s: about 3.5 minutes in all.
#   OUT=/path bash bench/h200/hostahead_ab.sh
# REPEATS (default 8) / BUDGET_S / MAX_NEW / POINTS override;
# SMOKE=1: the tiny CPU shape (a local check of the script).
set -uo pipefail
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
WORK=$(mktemp -d)
budget=${BUDGET_S:-130}
hard=$((${budget%.*} + 45))
arch=gpt-oss-20b layers=8 threads=${HOST_THREADS:-14} points=${POINTS:-0.2:4,0.2:1}
if [ "${SMOKE:-0}" = 1 ]; then
  arch=tiny-gpt_oss layers=0 threads=${HOST_THREADS:-2} points=${POINTS:-0.5:4}
fi
ENGINE="python3 bench/h200/hostahead_ab.py --arch $arch --layers $layers --points $points"
ENGINE="$ENGINE --repeats ${REPEATS:-8} --max-new-tokens ${MAX_NEW:-24} --host-threads $threads"
ENGINE="$ENGINE --host-workers 1 --budget-s $budget --out \"\$OUT/engine\""
PACK="$OUT/hostahead_ab.tgz" OUT=$WORK bash "$(dirname "$0")/run.sh" "engine=timeout -k 5 $hard $ENGINE"
rc=$?
tail -n 20 "$WORK/log.txt"
rm -rf "$WORK"
ls -la "$OUT"
exit $rc
