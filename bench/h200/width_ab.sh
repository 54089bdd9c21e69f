#!/usr/bin/env bash
# The adaptive verify width (pdflash.engine.verify_width) against every
# draft, on the H200 in ONE process (one model load for every arm):
# bench/h200/issue16.py --arms
#   PD      the PD baseline, verify_width adaptive (its preset)
#   PDfull  PD with verify_width=full: every draft verified (the
#           PD-full-width configuration, under PD's label)
#   B3      every expert resident (cache fraction 1.0 whatever the point's),
#           every draft verified (its preset)
# (While PD's preset was full, after session 14's rows, this script's arms
# were PD (full) and PDadaptive=PD:verify_width=adaptive; width_summary.py
# reads both.) At cache 1.0 PD's cache holds every expert, so its adaptive
# width verifies every draft (full_cache.switched_off.verify_width): PD and
# PDfull run one configuration there, an A/A noise check.
# gpt-oss-20b shape, 8 MoE layers, synthetic bf16 weights, forced
# acceptance (truncated geometric, mean tau 4.68, block 16), MAX_NEW
# (default 64) new tokens, points cache 1.0 c=4 (nothing can miss: PD
# verifies every draft, as PDfull does) and cache 0.2
# c=4 (link-bound: the width should still cut the block); every repeat runs
# each arm once per point, the order rotated each repeat and point, until
# BUDGET_S.
# Read: the table printed last (also in the tar's width_summary.json), per
# point and arm, medians over the repeats:
#   tok/s            output tokens/s (PD vs PDfull vs B3)
#   tau              committed tokens per verify round (acceptance_length_mean:
#                    accepted drafts + the bonus); at cache 1.0 PD's should
#                    be within noise of PDfull's and B3's
#   steps            verify steps for the 256 tokens (B3/PDfull: 18)
#   width/avail      PD's mean verified drafts of the mean available
#                    (cache 1.0: no policy ran, every draft verified;
#                    cache 0.2: under 1 where narrowing pays)
#   explore          PD's exploration decisions (every 17th verifies past its width)
#   t_row / t_row_fit  PD's charged per-row compute (the lower confidence
#                    bound) and the recent steps' slope it is the bound of
#   S(1..8)          PD's survival estimate (the forced draws' realized
#                    survival, not alpha^j: the seeded draws of 4 requests
#                    are a small sample)
# and the PD/PDfull tokens/s ratio per repeat (issue16's
# engine/summary.json points[].comparisons, reference arm PD): at cache 1.0
# within noise of 1 (one configuration); at cache 0.2 within noise of 1 or
# above it (session 14, before the fitted union saturation: below; session
# 15's widthmodel_ab.sh: 0.82-0.98, within noise, at forced acceptance).
# Everything is packed into ONE file, $OUT/width_ab.tgz (after the build,
# after the step, then again with the summary added).
# Expected: build ~30 s; the step's first run loads the model (~40-55 s),
# then 6 runs (3 arms x 2 points) per repeat at ~2-10 s each until BUDGET_S
# (default 250: about 5-8 repeats); the step is killed at BUDGET_S + 50 s:
# under 6 minutes in all.
#   OUT=/path bash bench/h200/width_ab.sh
# BUDGET_S / REPEATS (default 8) / MAX_NEW / POINTS / ARMS / EXTRA (more
# issue16.py options; default --reference PD) override; SMOKE=1: the tiny
# CPU shape (a local check of the script). The run itself is
# bench/h200/switches_ab.sh's.
set -uo pipefail
export ARMS=${ARMS:-PD,PDfull=PD:verify_width=full,B3}
export NAME=width_ab MAX_NEW=${MAX_NEW:-64}
export EXTRA=${EXTRA:---reference PD}
[ "${SMOKE:-0}" = 1 ] || export POINTS=${POINTS:-1.0:4,0.2:4}
export OUT=${OUT:-$PWD/out}
export SUMMARY="$(dirname "$0")/width_summary.py"
exec bash "$(dirname "$0")/switches_ab.sh"
