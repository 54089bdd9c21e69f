#!/usr/bin/env bash
# Issue 16's host share on the H200: PD+host splitting the stream's own
# copies (--host-ahead-from stream) A/B'd against PD+host as it is and PD, in
# ONE process (one model load, one host-weight preparation for every arm):
# bench/h200/issue16.py --arms
#   PD        the PD baseline
#   host      PD+host as it is (the pre-verify plan splits the route-ahead
#             prediction only; the stream's own copies, from its most
#             precise source and its gate lookahead, are never split)
#   split     PD+host --host-ahead-from stream (pdflash.hybrid.service,
#             "Splitting the stream's copies": the pre-verify plan's
#             candidates include the stream's fetch set, and during the
#             forward the gate lookahead's set for the next layer is split
#             again; the stream copies only the COPY part)
#   hostopen  host with the pre-verify plan's gate open
#             (--host-ahead-min-exposed 0: the plan runs before every
#             verify, not only where forwards waited on misses >= 0.2 of
#             the time)
#   splitopen split with the gate open (the split runs only where the
#             pre-verify plan runs, so this is the split everywhere)
# every arm at PD's verify width (adaptive, its preset; session 15 ran this
# script while PD's preset was full). gpt-oss-20b shape, 8 MoE layers,
# synthetic bf16 weights, forced acceptance, 24 new tokens, 14 host
# threads, 1 worker, host format auto, points cache 0.2 c=1, c=4 and c=16
# (session 14 measured hostfull/PDfull 1.13x, 1.16x and 1.16x there); every
# repeat runs each arm once per point, the order rotated each repeat and
# point, until BUDGET_S.
# Read: the table printed last (also in log.txt) (and engine/summary.json
# points[].comparisons, keyed ARM/OTHER: per-repeat ratios, their median,
# the verdict from the 95% intervals; by_arm: the mechanism, by_arm.*.
# ahead_gate: the gate's setting and the verifies it opened/closed):
#   split/host  the split under the gate. Expected where the pre-verify
#               plan runs (c=4 and c=16: link-bound, the gate open in most
#               verifies): by_arm.split "lookahead-split" layers > 0 on
#               every run, more host-served experts, fewer MB/tok, a lower
#               link busy and a higher host busy than host's, and the ahead
#               outcome's routed/seen higher (0.6 -> 0.9 on CPU); not slower
#               beyond noise anywhere. At c=1 the gate closes the pre-verify
#               plan after the first verifies (session 13: one ahead plan a
#               run; the table's "gate >=0.2 OPEN/CLOSED" shows it), and
#               with it the split: expect split ~ host there.
#   hostopen/host  the gate's own effect: "gate >=0 N/0" (never closed),
#               more planned-ahead and host-served experts and fewer MB/tok
#               than host's (CPU, c=4: copies -23%). Faster: the gate costs
#               PD+host tokens; slower at c=1 (compute-bound there, a HOST
#               expert on the critical path): the gate earns its default.
#   splitopen/hostopen  the split with nothing gating it, at every point
#               c=1 included: lookahead-split layers on every verify
#               forward the host part is on, fewer MB/tok than hostopen
#               (CPU, c=4, both with the gate open: copies -8%).
#   splitopen/host, split/PD, splitopen/PD  the issue's targets: >= 1.5x at
#               cache 0.2 c=1 and c=4; whichever arm is fastest names the
#               defaults to propose (host_ahead_from, host_ahead_min_exposed).
#   per arm, "plan [...] from [...] gate [...] lookahead-split {...}": the
#               settings each run recorded, the gate's open/closed verifies,
#               the lookahead layers split and the planned HOST experts
#               (summed over runs), and the planner's decisions.
# If an open-gate arm hosts more but is not faster: the host CPU or the
# forward's thread binds instead (by_arm.*.busy_fraction, host_wait_s); if
# split does not host more: its lookahead-split layers are few (the gate,
# or the PD controller's host-off steps: pd_parts.on_fraction.host_experts).
# Everything is packed into ONE file, $OUT/aheadsplit_ab.tgz (after the
# build and after the step: a call cut by its limit still returns what
# finished). Expected: build ~30 s; the step's first run loads the model
# and prepares the host weights (~40-55 s), then 15 runs (5 arms x 3
# points) per repeat, ~3-5 s each at c=1/4 and ~10 s at c=16, until
# BUDGET_S (default 450: about 5 repeats); the step is killed at BUDGET_S +
# 50 s: under 9 minutes in all.
#   OUT=/path bash bench/h200/aheadsplit_ab.sh
# BUDGET_S / REPEATS (default 8) / MAX_NEW / POINTS / ARMS / EXTRA (more
# issue16.py options) override; SMOKE=1: the tiny CPU shape (a local check
# of the script). The run itself is bench/h200/switches_ab.sh's.
split=host_ahead_from=stream open=host_ahead_min_exposed=0
export ARMS=${ARMS:-PD,host=PD+host,split=PD+host:$split,hostopen=PD+host:$open,splitopen=PD+host:$split:$open}
export NAME=aheadsplit_ab BUDGET_S=${BUDGET_S:-450}
[ "${SMOKE:-0}" = 1 ] || export POINTS=${POINTS:-0.2:1,0.2:4,0.2:16}
exec bash "$(dirname "$0")/switches_ab.sh"
