#!/usr/bin/env bash
# A cache with a slot for every expert (EngineConfig.full_cache) on the H200,
# every arm in ONE process (one model load): bench/h200/issue16.py --arms
#   PD      PD at full_cache=auto (default): at cache 1.0 the engine fills
#           the cache before the clock, as B3's, and runs no predictor /
#           router pass, stream, lookahead, background copies, PD
#           controller, nor the bench's shadow token-only scheduler, and
#           its adaptive verify width verifies every draft
#   PDoff   PD with full_cache=off: as before the change (cache filled on
#           demand from what the short warm-up left, every part on, the
#           adaptive verify width, PD's preset, included): the
#           gap session 13 measured (call3-enginegraphs: PD 189 vs B3 414
#           tok/s at cache 1.0 c=4)
#   B1, B2  the offloaded baselines, full_cache=auto (at cache 1.0: filled,
#           gate lookahead off; B1 is then B3's configuration)
#   B3      every expert resident (cache fraction 1.0 whatever the point's)
# gpt-oss-20b shape, 8 MoE layers, synthetic bf16 weights, forced
# acceptance, MAX_NEW (default 64) new tokens, points cache 1.0 c=4 and
# cache 0.75 c=4 (every arm at both: at 0.75 full_cache changes nothing, so
# PD and PDoff there are one configuration twice, an A/A noise check); every
# repeat runs each arm once per point, the order rotated each repeat and
# point, until BUDGET_S.
# Read: the table printed last (also in the tar's fullcache_summary.json):
#   per arm and point: tokens/s median, the rows' full_cache state and what
#   it switched off, medians of initial_resident_experts, h2d_bytes,
#   prefill_s, verify ms per step, draft_s, router_pass_s,
#   scheduler_us_per_step, exposed_fetch_s, acceptance per round
#   ARM/B3   tokens/s ratio of medians per point (B3 rows record cache
#            1.0 at either point: they pool under 1.0 and every point's
#            ratio reads them)
# Expected at cache 1.0: PD, B1, B2 start with 256 of 256 experts resident,
#   h2d_bytes 0, router_pass_s 0, prefill_s near B3's (~0.025 s); B1/B3 and
#   B2/B3 within noise of 1; PD/B3 within noise of 1 (at a full cache PD
#   verifies every draft, its rows' full_cache.switched_off naming
#   verify_width and verify_width.ran "full", and chooses its batch as
#   B3's, FCFS: its scheduler_us_per_step near B3's; session 14's rows,
#   before both, read PD 157 vs B3 17 us and PD/B3 0.81; session 15's, PD
#   verifying every draft by its preset then, B3/PD 0.99); PDoff reproduces the
#   ~0.45 of session 13 (115-124 of 256 resident at the start, ~7 GB copied,
#   router_pass_s ~0.07). At 0.75: PD's full_cache state "off" (why_off:
#   the slots), PD/PDoff within noise of 1 (unchanged), PD/B3 the offload
#   cost at that fraction.
# Everything is packed into ONE file, $OUT/fullcache_ab.tgz (after the
# build, after the step, then again with the summary added).
# Expected: build ~30 s; the step's first run loads the model (~40-55 s),
# then 10 runs (5 arms x 2 points) per repeat at ~2-5 s each until BUDGET_S
# (default 300: about 5-8 repeats); the step is killed at BUDGET_S + 50 s:
# under 7 minutes in all.
#   OUT=/path bash bench/h200/fullcache_ab.sh
# BUDGET_S / REPEATS (default 12) / MAX_NEW / POINTS / ARMS / EXTRA (more
# issue16.py options; default --reference B3) override; SMOKE=1: the tiny
# CPU shape (a local check of the script). The run itself is
# bench/h200/switches_ab.sh's.
set -uo pipefail
export ARMS=${ARMS:-PD,PDoff=PD:full_cache=off,B1,B2,B3}
export NAME=fullcache_ab MAX_NEW=${MAX_NEW:-64} REPEATS=${REPEATS:-12} BUDGET_S=${BUDGET_S:-300}
export EXTRA=${EXTRA:---reference B3}
if [ "${SMOKE:-0}" = 1 ]; then
  export POINTS=${POINTS:-1.0:2,0.75:2}
else
  export POINTS=${POINTS:-1.0:4,0.75:4}
fi
export OUT=${OUT:-$PWD/out}
export SUMMARY="$(dirname "$0")/fullcache_summary.py"
exec bash "$(dirname "$0")/switches_ab.sh"
