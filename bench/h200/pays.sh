#!/usr/bin/env bash
# The PD controller on the H200 (about 3 minutes with the build): PD (its
# parts switched online by pdflash.engine.pd_controller) against PD-all-on
# (every part forced on) and B1/B2, where issue 14 found PD's own work
# costing more than the copies it saved: small experts (Qwen3-30B-A3B shape,
# 2 layers) and a cache of 0.8, so the link is not the bottleneck; c = 4 and
# 16, 128 new tokens, 3 interleaved repeats. Rows, report.md (intervals and
# "within noise" verdicts, the "what each part buys" table with PD-all-on as
# the controller's row) and each PD row's `pd_parts` (fraction of steps each
# part ran, switches and why) go to $OUT/pays/; run.sh's log to $OUT/log.txt.
# No new run starts after 100 s (the rows are resumable: rerun with the same
# --out to finish), the hard timeout is 150 s.
#   OUT=/path bash bench/h200/pays.sh
set -uo pipefail
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
OUT=${OUT:-$PWD/out}
export OUT
exec bash "$(dirname "$0")/run.sh" \
  "pays=timeout 150 pdflash-bench matrix --arch qwen3-30b-a3b --layers 2 --weights synthetic --draft synthetic --block-sizes 16 --concurrency 4,16 --cache-fraction 0.8 --baselines B1,B2,PD,PD-all-on --repeats 3 --max-new-tokens 128 --device cuda --budget-s 100 --out $OUT/pays --no-progress --json"
