#!/usr/bin/env bash
# Issue 16's host share on the H200: PD+host splitting the stream's own
# copies (--host-ahead-from stream) A/B'd against PD+host as it is and PD, in
# ONE process (one model load, one host-weight preparation for every arm):
# bench/h200/issue16.py --arms
#   PD      the PD baseline
#   host    PD+host as it is (the pre-verify plan splits the route-ahead
#           prediction only; the stream's own copies, from its most precise
#           source and its gate lookahead, are never split)
#   split   PD+host --host-ahead-from stream (pdflash.hybrid.service,
#           "Splitting the stream's copies": the pre-verify plan's candidates
#           include the stream's fetch set, and during the forward the gate
#           lookahead's set for the next layer is split again; the stream
#           copies only the COPY part)
# every arm with verify_width=full (PD's default once the `fullwidth` branch
# is merged; drop the overrides then). gpt-oss-20b shape, 8 MoE layers,
# synthetic bf16 weights, forced acceptance, 24 new tokens, 14 host threads,
# 1 worker, host format auto, points cache 0.2 c=1, c=4 and c=16 (session 14
# measured hostfull/PDfull 1.13x, 1.16x and 1.16x there); every repeat runs
# each arm once per point, the order rotated each repeat and point, until
# BUDGET_S.
# Read: the table printed last (also in log.txt) (and engine/summary.json
# points[].comparisons, keyed ARM/OTHER: per-repeat ratios, their median,
# the verdict from the 95% intervals; by_arm: the mechanism):
#   split/host  the change. Expected where the pre-verify plan runs (c=4
#               and c=16: link-bound, the engine's exposed-fetch gate open):
#               by_arm.split "lookahead-split" layers > 0 on every run, more
#               host-served experts, fewer MB/tok, a lower link busy and a
#               higher host busy than host's, and the ahead outcome's
#               routed/seen higher (the lookahead's HOST set is the more
#               precise one; 0.6 -> 0.9 on CPU). split/host > 1 if the host
#               CPU still has room (host busy ~0.18 at c=4 in session 13);
#               not slower beyond noise anywhere. At c=1 the gate closes the
#               pre-verify plan after the first verifies (session 13: one
#               ahead plan a run), and with it the lookahead split: expect
#               split ~ host there, few lookahead-split layers.
#   split/PD    the issue's targets: >= 1.5x at cache 0.2 c=1 and c=4.
#   per arm, "plan [...] from [...] lookahead-split {...}": the setting each
#               run recorded, the lookahead layers split and the planned HOST
#               experts (summed over runs), and the planner's decisions.
# If split hosts more but is not faster: the host CPU or the forward's
# thread binds instead (by_arm.*.busy_fraction, host_wait_s); if it does not
# host more: the lookahead-split layers are few (the gate, or the PD
# controller's host-off steps: pd_parts.on_fraction.host_experts).
# Everything is packed into ONE file, $OUT/aheadsplit_ab.tgz (after the
# build and after the step: a call cut by its limit still returns what
# finished). Expected: build ~30 s; the step's first run loads the model
# and prepares the host weights (~40-55 s), then 9 runs (3 arms x 3 points)
# per repeat, ~3-5 s each at c=1/4 and ~10 s at c=16, until BUDGET_S
# (default 400: about 6 repeats); the step is killed at BUDGET_S + 50 s:
# under 8 minutes in all.
#   OUT=/path bash bench/h200/aheadsplit_ab.sh
# BUDGET_S / REPEATS (default 8) / MAX_NEW / POINTS / ARMS / EXTRA (more
# issue16.py options) override; SMOKE=1: the tiny CPU shape (a local check
# of the script). The run itself is bench/h200/switches_ab.sh's.
full=verify_width=full
export ARMS=${ARMS:-PD=PD:$full,host=PD+host:$full,split=PD+host:$full:host_ahead_from=stream}
export NAME=aheadsplit_ab BUDGET_S=${BUDGET_S:-400}
[ "${SMOKE:-0}" = 1 ] || export POINTS=${POINTS:-0.2:1,0.2:4,0.2:16}
exec bash "$(dirname "$0")/switches_ab.sh"
