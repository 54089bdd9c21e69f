#!/usr/bin/env bash
# Every draft (PD-full-width's verify width) against the adaptive width (PD's
# default) with the fitted-saturation union model
# (pdflash.engine.verify_width.UnionGrowth),
# on the H200, in two calls (one tar each):
#
# STEP=forced (default): bench/h200/issue16.py --arms through switches_ab.sh
# in ONE process (one model load for every arm):
#   PDfull    PD with verify_width=full: every draft verified
#   PD        PD at its preset, verify_width=adaptive
# (session 15 ran this with PD's preset full: arms PD=PD:verify_width=full
# and adaptive=PD:verify_width=adaptive, reference PD)
# gpt-oss-20b shape, 8 MoE layers, synthetic bf16 weights, forced acceptance
# (truncated geometric, mean tau 4.68, block 16), MAX_NEW (default 64) new
# tokens, points cache 0.2 c=4, 0.5 c=1, 0.5 c=4 (where the old union model
# lost: 1.16x, 1.48x, 1.28x for every draft); arms interleaved, the order
# rotated each repeat and point, until BUDGET_S (default 280).
# Read: issue16's engine/summary.json points[].comparisons (reference arm
# PDfull): PD/PDfull tokens/s should be within noise of 1 at every point
# (0.68-0.86 before the fitted saturation; 0.82-0.98 in session 15); and
# each PD row's verify_width: mean_width_drafts
# near mean_available_drafts at cache 0.2 c=4 (was 4.5-6.1 of 13.1-13.8),
# estimates.union_saturation below 32 (the realized unions levelled off at
# ~22-26 experts per layer) with row_link_s well under the old 6-13 ms, and
# acceptance_length_mean near PDfull's 4.34 (was 3.2-3.7).
# Expected: build ~30 s, model load ~40-55 s, then 6 runs (2 arms x 3
# points) per repeat at ~2-8 s each; killed at BUDGET_S + 50 s: under 6
# minutes in all. Tar: $OUT/widthmodel_ab.tgz.
#
# STEP=trace: pdflash-bench matrix, the proxy's T=1 trace replayed (routing
# and acceptance, tau ~1.5; bench/results/h200/proxy-balanced-2026-12-01/
# trace_gpu_t1.npz), PD at --verify-width full,adaptive,fixed:1, cache 0.2,
# c=1,4,16, 32 new tokens, 3 repeats (issue16.py cannot replay a trace: the
# trace is not one of its run settings). Read the matrix rows (tokens/s per
# width; PD adaptive's verify_width.mean_width_drafts): the adaptive width
# should still narrow here (width ~1 at c=1 and c=4, as in the sixth
# session's 1.0 and 1.2-1.7) and read within noise of fixed:1 and above
# full (1.5-1.8x full at c=1 then). Killed at BUDGET_S (default 420) + 120 s:
# under 10 minutes. Tar: $OUT/widthmodel_trace.tgz (bench/h200/trace_baselines.sh's
# run, which also writes its summary table).
#
#   OUT=/path bash bench/h200/widthmodel_ab.sh
#   STEP=trace OUT=/path bash bench/h200/widthmodel_ab.sh
# BUDGET_S / REPEATS / MAX_NEW / POINTS / ARMS / EXTRA override (STEP=forced,
# as switches_ab.sh takes them); SMOKE=1: the tiny CPU shape (forced only).
set -uo pipefail
export OUT=${OUT:-$PWD/out}
case "${STEP:-forced}" in
  forced)
    export ARMS=${ARMS:-PDfull=PD:verify_width=full,PD}
    export NAME=widthmodel_ab MAX_NEW=${MAX_NEW:-64} BUDGET_S=${BUDGET_S:-280}
    export EXTRA=${EXTRA:---reference PDfull}
    [ "${SMOKE:-0}" = 1 ] || export POINTS=${POINTS:-0.2:4,0.5:1,0.5:4}
    exec bash "$(dirname "$0")/switches_ab.sh"
    ;;
  trace)
    # the PD-vs-baselines trace script with PD alone at three widths
    export LABELS=PD WIDTHS=full,adaptive,fixed:1 CONC=1,4,16 REPEATS=3
    export BUDGET_S=${BUDGET_S:-420} MARGIN_S=120 NAME=widthmodel_trace
    exec bash "$(dirname "$0")/trace_baselines.sh"
    ;;
  *) echo "STEP must be forced or trace" >&2; exit 2 ;;
esac
