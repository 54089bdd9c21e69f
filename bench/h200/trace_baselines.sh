#!/usr/bin/env bash
# PD against the best of B1/B2 (issue 14's "PD never slower than the best
# baseline") on the proxy's learned routing and acceptance, replayed: the
# proxy's T=1 trace (bench/results/h200/proxy-balanced-2026-12-01/
# trace_gpu_t1.npz, tau ~1.2-1.7) on a published shape with synthetic bf16
# weights (routing_source and acceptance_source say "trace" in every row).
# `pdflash-bench matrix` runs every label at every width in WIDTHS, the
# labels interleaved round-robin within each repeat, so each baseline is
# read at its best width (session 7: B2 at fixed:1 beat B2 at full) in the
# same process as PD. The matrix plans point-major (per concurrency, then
# per repeat): give each call the points its budget can finish.
# Read the table bench/h200/trace_baselines_summary.py prints (also
# trace_baselines_summary.json in the tar): tokens/s per (label, width, c);
# PD at its default width against the best (label, width) of B1/B2 per repeat.
# Defaults: gpt-oss-20b, 8 MoE layers, cache 0.2, c=1,4, labels PD,B1,B2,
# widths adaptive,fixed:1, 32 new tokens, 4 repeats, BUDGET_S 400 (no new
# run after it; killed at BUDGET_S + MARGIN_S, default 80 s). About 8 s per run on the H200
# at c=1 and c=4. Tar: $OUT/$NAME.tgz (NAME default trace_baselines).
#   OUT=/path bash bench/h200/trace_baselines.sh
#   CONC=16 REPEATS=3 OUT=/path bash bench/h200/trace_baselines.sh
# ARCH / CACHE / CONC / LABELS / WIDTHS / REPEATS / MAX_NEW / BUDGET_S /
# MARGIN_S / NAME override; EXTRA adds matrix options to every label (e.g.
# EXTRA='--cuda-graphs piecewise --controller-warmup first_round') (bench/h200/widthmodel_ab.sh STEP=trace is this
# with PD alone at three widths); SKIP_BUILD=1 as bench/h200/run.sh takes it.
# CLOSED=N: a closed loop instead of the burst, CONC clients (one value)
# each sending its next request when its last finished, N x CONC requests
# in all: tokens/s then reads throughput with the slots refilled. In the
# burst every run lasts as long as its slowest request (on this trace 27
# verify steps at every width and concurrency, sessions 16-17), so drafts a
# wider verify accepts for the other requests shorten nothing.
set -uo pipefail
case "${CLOSED:-}/${CONC:-1,4}" in
  ?*/*,*) echo "CLOSED needs one CONC value (the clients), got ${CONC:-1,4}" >&2; exit 2 ;;
esac
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
OUT=${OUT:-$PWD/out}
name=${NAME:-trace_baselines}
WORK=$(mktemp -d)
mkdir -p "$OUT"
budget=${BUDGET_S:-400}
. "$(dirname "$0")/trace_args.sh"
ARGS=$(trace_matrix_args "${ARCH:-gpt-oss-20b}" "${CONC:-1,4}" "${CACHE:-0.2}" \
  "${MAX_NEW:-32}" "${REPEATS:-4}" "$budget")
ARGS="$ARGS --baselines ${LABELS:-PD,B1,B2} --verify-width ${WIDTHS:-adaptive,fixed:1} ${EXTRA:-}"
[ -z "${CLOSED:-}" ] || ARGS="$ARGS --arrivals closed --users $CONC --num-requests $((CLOSED * CONC))"
PACK="$OUT/$name.tgz" OUT=$WORK bash "$(dirname "$0")/run.sh" \
  "trace=timeout -k 5 $((${budget%.*} + ${MARGIN_S:-80})) pdflash-bench matrix $ARGS --out $WORK/trace"
rc=$?
# the per-point table (PD at its width against the best B1/B2 configuration)
python3 "$(dirname "$0")/trace_baselines_summary.py" "$WORK" || true
tar czf "$OUT/$name.tgz" -C "$WORK" .
rm -rf "$WORK"
exit $rc
