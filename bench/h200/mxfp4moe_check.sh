#!/usr/bin/env bash
# One H200 call (~1.5-2 minutes wall: build ~5-30 s, then hard timeouts of
# 60 s (prep), 60 s (row) and 40 s (row_warm); typically ~20 + ~35 + ~20 s)
# for issue 13's MXFP4 `pdflash-bench moe` row, the step of allhit_check.sh
# that never finished (cut at 30 s and 45 s): the same command, with every
# phase's wall time in the row (setup_s, phases_s, each all-hit point's
# setup_s) and noted on stderr as it runs, so a cut step still says where it
# was.
#   OUT=/path bash bench/h200/mxfp4moe_check.sh
# Steps (through bench/h200/run.sh), each under a hard timeout:
#   prep      the synthetic checkpoint (gpt-oss-20b, 1 layer, MXFP4) written
#             once under $PDFLASH_CACHE (--checkpoint-only): its write is not
#             part of the timed row
#   row       the MXFP4 moe row (allhit_check.sh's command) reusing it, with
#             a cold Triton cache: each compile/autotune shows in the phase
#             that first needs it (mxfp4_kernel_probes, measure_warmup_repeat,
#             the 256-token point's first_call), and TRITON_PRINT_AUTOTUNING
#             puts each tuned key's seconds in the log
#   row_warm  the same row again with Triton's compiled kernels and autotune
#             results on disk (TRITON_CACHE_AUTOTUNING=1): row - row_warm per
#             phase = the compile and autotune cost
#   summary   mxfp4moe_summary.json (bench/h200/mxfp4moe_summary.py): per
#             step rc, wall, phases, autotuned keys and seconds, and for a cut
#             step its last phase line
# Everything (log.txt, results.jsonl, the summary) is packed into ONE file,
# $OUT/mxfp4moe_check.tgz, after every step; nothing else is left under $OUT
# (the work happens in $WORK, default /tmp/mxfp4moe_check; Triton's cache in
# $WORK.triton, emptied first).
# SMOKE=1: the same steps on the tiny CPU shape (a local check of the script).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$PWD/out}
WORK=${WORK:-/tmp/mxfp4moe_check}
rm -rf "$WORK" "$WORK.triton"
mkdir -p "$WORK" "$OUT"
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
export TRITON_CACHE_DIR="$WORK.triton" TRITON_CACHE_AUTOTUNING=1 TRITON_PRINT_AUTOTUNING=1
TAR="$OUT/mxfp4moe_check.tgz"
PACK="tar czf /tmp/mxfp4moe_check.tgz -C $WORK . && mv /tmp/mxfp4moe_check.tgz $TAR"
arch=gpt-oss-20b dev="" tp=60 tr=60 tw=40
if [ "${SMOKE:-0}" = 1 ]; then
  arch=gpt_oss dev="--device cpu" tp=120 tr=120 tw=120
fi
# allhit_check.sh's MXFP4 step (its later --layers / --cache-fraction win)
MOE="pdflash-bench moe --json --layers 2 --tokens 16 --repeats 1 --cache-fraction 0.5 --all-hit-tokens 16,64,256 --all-hit-iters 20 --all-hit-rounds 5 --row-sort both $dev --arch $arch --synthetic-format mxfp4 --layers 1 --cache-fraction 1.0"
steps=(
  "prep=timeout -k 5 $tp $MOE --checkpoint-only; rc=\$?; $PACK; exit \$rc"
  "row=timeout -k 5 $tr $MOE; rc=\$?; $PACK; exit \$rc"
  "row_warm=timeout -k 5 $tw $MOE; rc=\$?; $PACK; exit \$rc"
  "summary=python3 $HERE/mxfp4moe_summary.py $WORK/results.jsonl $WORK/log.txt --out $WORK/mxfp4moe_summary.json; rc=\$?; $PACK; exit \$rc"
  "pack=$PACK"
)
# run.sh writes its log and results.jsonl under its own OUT: the work folder
OUT=$WORK exec bash "$HERE/run.sh" "${steps[@]}"
