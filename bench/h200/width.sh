#!/usr/bin/env bash
# The verify width on the H200 (pdflash.engine.verify_width): does verifying
# a prefix of the drafts pay where the padded run is link-bound? The
# gpt-oss-20b shape (32 experts top-4, 49.8 MB bf16 experts) truncated to 8
# layers (the proxy trace's depth: layers map 1:1), routing and acceptance
# replayed from the trained proxy's temperature-1 trace (τ 1.5; its 128
# experts map 4:1 onto 32), cache 0.2, c = 1, 4, 16, 3 interleaved repeats,
# 32 new tokens per request. Two steps, each resumable (rerun with the same
# WORK; no new run starts after --budget-s):
#   pd     B2, PD (adaptive width, its preset) and PD-full-width (PD
#          verifying every draft) -> $WORK/width-pd/       (27 runs)
#   fixed  B2 and PD at fixed:$FIXED_K (the best fixed width a baseline can
#          use on the CPU replay) -> $WORK/width-fixed/   (18 runs)
#   all    B2 at full and fixed:$FIXED_K, PD at adaptive (its preset, auto),
#          fixed:$FIXED_K and full, all interleaved in one process (so each
#          baseline at its best width is compared within one call: the pd
#          and fixed steps ran in different calls in
#          bench/results/h200/session6-2026-12-01, whose drift was as large
#          as the differences) -> $WORK/width-all/ (45 runs: 398 s in one
#          call of BUDGET_S=430 on the H200, session 7)
# Expected: about 15-20 s per run with the model's setup at c=1..16 on the
# H200 (the proxy's padded runs took 6-14 s each, bench/results/h200/
# proxy-balanced-2026-12-01), so each step needs one call of its budget and
# possibly a second (resume) call: 2-4 calls, about 15-25 device-minutes.
#   OUT=/path STEP=pd bash bench/h200/width.sh      (then STEP=fixed)
# The runs write under $WORK (default /tmp/width-work, kept on the machine
# between back-to-back calls, so a resume reuses it); $OUT receives ONE file,
# $OUT/width.tgz (all of $WORK), since the device tool returns only a few
# files per call.
set -uo pipefail
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
OUT=${OUT:-$PWD/out}
WORK=${WORK:-/tmp/width-work}
mkdir -p "$OUT" "$WORK"
FIXED_K=${FIXED_K:-1}
BUDGET_S=${BUDGET_S:-480}
. "$(dirname "$0")/trace_args.sh"
COMMON=$(trace_matrix_args gpt-oss-20b 1,4,16 0.2 32 3 "$BUDGET_S")
case "${STEP:-pd}" in
  pd) SPEC="pd=timeout $((BUDGET_S + 120)) pdflash-bench matrix $COMMON --baselines B2,PD,PD-full-width --out $WORK/width-pd" ;;
  fixed) SPEC="fixed=timeout $((BUDGET_S + 120)) pdflash-bench matrix $COMMON --baselines B2,PD --verify-width fixed:$FIXED_K --out $WORK/width-fixed" ;;
  all) SPEC="all=timeout $((BUDGET_S + 120)) pdflash-bench matrix $COMMON --baselines B2,PD --verify-width auto,fixed:$FIXED_K,full --out $WORK/width-all" ;;
  *) echo "STEP must be pd, fixed or all" >&2; exit 2 ;;
esac
OUT=$WORK bash "$(dirname "$0")/run.sh" "$SPEC"
rc=$?
tar czf "$OUT/width.tgz" -C "$WORK" .
exit $rc
