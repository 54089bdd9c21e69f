#!/usr/bin/env bash
# Recorded all-resident layer calls (pdflash.models.resident_graphs) in the
# ENGINE, A/B'd on the H200 in ONE process (one model load for every arm):
# bench/h200/issue16.py --arms
#   PD      the PD baseline, every all-resident layer call eager (default)
#   on      PD with the run setting resident_graphs=on: an all-resident
#           layer call replays a CUDA-graph recording of its device work,
#           its token count padded up to a bucket (recorded on a key's 2nd
#           call, checked once against eager bit for bit)
#   B3      every expert resident (cache fraction 1.0, whatever the point's):
#           EVERY layer call is all-resident, eager (CUDA graphs off)
#   B3on    B3 with resident_graphs=on: the switch where it applies to
#           every call (the ceiling of what it can buy in the engine)
# gpt-oss-20b shape, 8 MoE layers, synthetic bf16 weights, forced
# acceptance, MAX_NEW (default 64: the recordings need a few steps per
# layer and bucket to pay back) new tokens, points cache 0.5 c=1 and c=4;
# every repeat runs each arm once per point, the order rotated each repeat
# and point, until BUDGET_S. NOTE: on the CPU shape small-gpt_oss (8
# layers, 64 new tokens, PD) a layer call was all-resident 0 times at cache
# 0.5 c=1 and 5 times in 19 forwards at c=4 (13 and 10 at cache 0.75, 18
# and 131 at 1.0): PD's all-resident calls may be few at 0.5; the PD arm's
# eager "off" count says how many there were (POINTS=0.5:4,1.0:1,1.0:4 for
# points with more).
# Read: the table printed last (also in the tar's enginegraphs_summary.json):
#   on/PD        tokens/s ratio per repeat, its median and 95% interval
#                (issue16's engine/summary.json points[].comparisons: the
#                reference arm is `on`); the switch earns its default if
#                on/PD is above 1 beyond noise at both points and never below
#   B3on/B3      (the summary's on_over_off_median, medians): what the switch
#                buys where every call is all-resident
#   per arm      the recorder's counters summed over its runs (rows'
#                resident_graphs, measured run only): all-resident calls
#                (replays + captures + eager), replays, captures and the host
#                seconds they took (capture_s: inside the clock; compare with
#                wall_s), distinct keys, eager calls by reason (PD: "off"
#                counts every all-resident call; on: "warming" the first use
#                of a key), mismatches (must be 0), capture errors
# Everything is packed into ONE file, $OUT/enginegraphs_ab.tgz (after the
# build, after the step, then again with the summary added).
# Expected: build ~30 s; the step's first run loads the model (~40-55 s),
# then 8 runs (4 arms x 2 points) per repeat at ~3-10 s each until BUDGET_S
# (default 250: about 4-6 repeats); the step is killed at BUDGET_S + 50 s:
# under 6 minutes in all. ARMS=PD,on=PD:resident_graphs=on: PD only, about
# twice the repeats.
#   OUT=/path bash bench/h200/enginegraphs_ab.sh
# BUDGET_S / REPEATS (default 8) / MAX_NEW / POINTS / ARMS / EXTRA (more
# issue16.py options; default --reference on) override; SMOKE=1: the tiny
# CPU shape (a local check of the script; the recorder then runs eagerly,
# reason not_cuda). The run itself is bench/h200/switches_ab.sh's.
set -uo pipefail
export ARMS=${ARMS:-PD,on=PD:resident_graphs=on,B3,B3on=B3:resident_graphs=on}
export NAME=enginegraphs_ab MAX_NEW=${MAX_NEW:-64}
export EXTRA=${EXTRA:---reference on}
[ "${SMOKE:-0}" = 1 ] || export POINTS=${POINTS:-0.5:1,0.5:4}
export OUT=${OUT:-$PWD/out}
export SUMMARY="$(dirname "$0")/enginegraphs_summary.py"
exec bash "$(dirname "$0")/switches_ab.sh"
