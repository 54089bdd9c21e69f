#!/usr/bin/env bash
# The PD controller on the H200 (about 3 minutes with the build): PD (its
# parts switched online by pdflash.engine.pd_controller) against PD-all-on
# (every part forced on) and B1/B2 where issue 14 found PD's own work costing
# more than the copies it saved (small experts, the link not the bottleneck).
# Two steps, one point each, c=16 with 64 requests of 128 new tokens (about
# 110 steps per run: the controller needs a few dozen to decide), 3
# interleaved repeats, 12 runs per step:
#   tiny   the tiny synthetic model (6 KB experts), cache 0.5: PD's host work
#          against nearly free copies
#   qwen   the Qwen3-30B-A3B shape (9.4 MB experts) truncated to 2 layers,
#          cache 0.8
# Rows, report.md (intervals, "within noise" verdicts, the "what each part
# buys" table with PD-all-on as the controller's row, "The PD controller's
# decisions") and each PD row's `pd_parts` (fraction of steps each part ran,
# switches and why) go to $OUT/pays-<step>/; run.sh's log to $OUT/log.txt.
# No new run starts after --budget-s (rows are resumable: rerun with the same
# OUT to finish); a hard timeout stands behind each step.
#   OUT=/path bash bench/h200/pays.sh
set -uo pipefail
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
OUT=${OUT:-$PWD/out}
export OUT
COMMON="--weights synthetic --draft synthetic --block-sizes 16 --concurrency 16 --num-requests 64 --max-new-tokens 128 --baselines B1,B2,PD,PD-all-on --repeats 3 --device cuda --no-progress --json"
exec bash "$(dirname "$0")/run.sh" \
  "tiny=timeout 60 pdflash-bench matrix --arch tiny --cache-fraction 0.5 --budget-s 45 $COMMON --out $OUT/pays-tiny" \
  "qwen=timeout 110 pdflash-bench matrix --arch qwen3-30b-a3b --layers 2 --cache-fraction 0.8 --budget-s 80 $COMMON --out $OUT/pays-qwen"
