#!/usr/bin/env bash
# Issue 16's planner rules A/B'd on the H200 in ONE process (one model load,
# one host-weight preparation for every arm): bench/h200/issue16.py --arms
#   PD      the PD baseline
#   host    PD+host with the makespan planner (the default: each layer's own
#           copies against its HOST part, the link otherwise idle)
#   queue   PD+host --host-plan queue (pdflash.hybrid.planner, "The link's
#           queue": the link's measured backlog, the forward's measured
#           per-layer work and the host pool's queue)
# gpt-oss-20b shape, 8 MoE layers, synthetic bf16 weights, forced
# acceptance, 24 new tokens, 14 host threads, 1 worker, host format auto,
# points cache 0.2 c=4 (link-bound: queue should host more than host and
# beat it) and cache 0.5 c=1 (compute-bound: queue should host almost
# nothing and be no slower than PD); every repeat runs each arm once per
# point, the order rotated each repeat and point, until BUDGET_S.
# Read: the table printed last (also in log.txt) (and engine/summary.json
# points[].comparisons, keyed ARM/OTHER: per-repeat ratios, their median,
# the verdict from the 95% intervals; by_arm: the mechanism):
#   queue/host  the new rule against the old one
#   queue/PD    the issue's targets: >= 1.5x at cache 0.2 c=4; at cache
#               0.5 c=1 never slower than PD beyond noise
#   per arm, "plan [...]": the planner's decisions summed over the arm's
#               runs, per layer plan (split = hosted, copy_hidden = the
#               copies land within the forward's own work, copy_ineligible
#               = no miss within the caps, copy_margin = the best split
#               saves too little, probes) and per ahead-plan layer; with
#               "host N" (host-served experts), "link"/"host" busy
#               fractions and MB/tok on the line above. Expected: at 0.5
#               c=1 queue mostly copy_hidden and a host share near 0; at
#               0.2 c=4 more split and a higher host busy than host's.
#               by_arm.*.busy_fraction says which resource binds.
# Everything is packed into ONE file, $OUT/hostguard_ab.tgz (after the build
# and after the step: a call cut by its limit still returns what finished).
# Expected: build ~30 s; the step's first run loads the model and prepares
# the host weights (~40-55 s), then ~6 runs (3 arms x 2 points) per repeat
# at ~3-5 s each until BUDGET_S (default 250: about 8 repeats); the step is
# killed at BUDGET_S + 50 s: under 6 minutes in all.
#   OUT=/path bash bench/h200/hostguard_ab.sh
# BUDGET_S / REPEATS (default 8) / MAX_NEW / POINTS / ARMS / EXTRA (more
# issue16.py options) override (e.g. POINTS=0.2:1,0.2:4,0.5:1 for the c=1
# target too, with BUDGET_S no higher); SMOKE=1: the tiny CPU shape (a local
# check of the script). The run itself is bench/h200/switches_ab.sh's.
export ARMS=${ARMS:-PD,host=PD+host,queue=PD+host:host_plan=queue} NAME=hostguard_ab
[ "${SMOKE:-0}" = 1 ] || export POINTS=${POINTS:-0.2:4,0.5:1}
exec bash "$(dirname "$0")/switches_ab.sh"
