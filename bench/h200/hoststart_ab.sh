#!/usr/bin/env bash
# Issue 16: the gated host part starts off (pdflash/engine/pd_controller.py,
# "The host gate"), A/B'd on the H200 in ONE process (one model load, one
# host-weight preparation for both arms): bench/h200/issue16.py --arms
#   PD      the PD baseline
#   host    PD+host as it is by default: its PD controller starts the host
#           part off and the gate switches it on only once the first two
#           measured steps show the forwards waiting >= 0.2 of the step for
#           expert copies (before: the part started on and the gate needed
#           a host-on probe pair to switch it off)
# gpt-oss-20b shape, 8 MoE layers, synthetic bf16 weights, forced
# acceptance, 24 new tokens, 14 host threads, 1 worker, host format auto,
# points cache 0.2 c=1, 0.2 c=4 (link-bound) and 0.5 c=1, 0.5 c=4
# (compute-bound); every repeat runs each arm once per point, the order
# rotated each repeat and point, until BUDGET_S.
# What it should show (the table printed last, also in log.txt;
# engine/summary.json points[].comparisons["host/PD"]: per-repeat ratios,
# their median and the verdict from the 95% intervals):
#   0.5 c=1, 0.5 c=4: host/PD within noise, median near 1.0 (session 13,
#       tree ed1c1d1, the old start: 0.83x and 0.92x); host_runs[] (and
#       each row's pd_parts) host_part_on_fraction 0 in every run, the
#       host part's first decision "kept off (gated: nothing to save) ...
#       over the first 2 measured steps (a, b)" with both shares listed.
#       A run with a host-on step here means a first step's share reached
#       the gate: read its shares in that decision. A ratio still below 1
#       with the host never on is the cost of the service while off:
#       its torch intra-op count and thread placement, set at build (add
#       the arm noaffinity=PD+host:host_affinity=off to separate them).
#   0.2 c=1, 0.2 c=4: host/PD above 1 as before (session 13: 1.31x and
#       1.22x), its first decision "switched on (gate: the link binds ...)"
#       at step 3-4 (the prefill step, then two measured steps), on from
#       there: host_part_on_fraction about (steps - 3) / steps (0.4 in a
#       5-step c=1 run; 0.8 with the old start, which ran the host in the
#       prefill and warm-up steps): expect host/PD at c=1 a little below
#       session 13's if those first steps were the ones it paid in.
# Everything is packed into ONE file, $OUT/hoststart_ab.tgz (after the build
# and after the step: a call cut by its limit still returns what finished).
# Expected: build ~30 s; the step's first run loads the model and prepares
# the host weights (~40-55 s), then 8 runs (2 arms x 4 points) per repeat
# at ~3-5 s each until BUDGET_S (default 250: about 6-8 repeats); the step
# is killed at BUDGET_S + 50 s: under 6 minutes in all.
#   OUT=/path bash bench/h200/hoststart_ab.sh
# BUDGET_S / REPEATS (default 8) / MAX_NEW / POINTS / ARMS / EXTRA (more
# issue16.py options) override; SMOKE=1: the tiny CPU shape (a local check
# of the script). The run itself is bench/h200/switches_ab.sh's.
export ARMS=${ARMS:-PD,host=PD+host} NAME=hoststart_ab
[ "${SMOKE:-0}" = 1 ] || export POINTS=${POINTS:-0.2:1,0.2:4,0.5:1,0.5:4}
exec bash "$(dirname "$0")/switches_ab.sh"
