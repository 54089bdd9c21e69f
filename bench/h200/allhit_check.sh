#!/usr/bin/env bash
# One H200 call (~2-2.5 minutes wall: build ~30 s, then hard timeouts of
# 20 s (GPU tests), 35 s (Qwen3), 40 s (gpt-oss bf16), so at most ~2.2
# minutes; MXFP4=1 adds a gpt-oss MXFP4 step, 1 layer, of up to 60 s: the
# 30 s it had never sufficed on the H200, where the same command alone took
# 39 s of wall in session 38; bench/h200/mxfp4moe_check.sh times that row
# by phase with its checkpoint written first) for issue 13's
# per-layer all-hit target: the
# offloaded MoE block with every routed expert resident (offloaded_all_hit_us)
# <= 1.25x plain grouped_mm on the same active experts (grouped_mm_active_us)
# and <= 2x hbm_roofline_us, at 16/64/256 tokens, gpt-oss-20b and
# Qwen3-30B-A3B shapes (2 layers each, cache 0.5) (and with MXFP4=1
# gpt-oss with MXFP4 experts, 1 layer, cache 1.0). Both sides are timed alike in 5 interleaved rounds of 20 calls:
# back-to-back CUDA events (*_us), the host's issue time per call (*_host_us)
# and the device-only time with the calls queued behind a spin kernel
# (*_device_us); offloaded_host_bound says whether the block's host is the
# limit (see the row's all_hit_timing). --row-sort both: the block with
# torch.sort row ordering (5 torch calls instead of the counting sort's 12)
# is timed in the same rounds (by_row_sort), to show whether fewer host
# dispatches beat the counting sort's smaller device time in eager calls.
#   OUT=/path bash bench/h200/allhit_check.sh
# Steps (through bench/h200/run.sh), each under a hard timeout:
#   gputests     the all-resident grouped layer without a host sync vs the HF
#                block, sort_rows on CUDA vs a stable sort, the timing's
#                host/device split, the all-hit fast path (CPU), <= 20 s
#   moe_qwen3 / moe_gptoss / moe_gptoss_mxfp4   pdflash-bench moe rows
#   summary      allhit_summary.json (bench/h200/allhit_summary.py): per arch,
#                layer and token count, both sides' µs and the ratios
# Everything (log.txt, results.jsonl, gputests.txt, the summary) is packed
# into ONE file, $OUT/allhit_check.tgz, after every step; nothing else is
# left under $OUT (the work happens in $WORK, default /tmp/allhit_check).
# SMOKE=1: the same steps on the tiny CPU shapes, no GPU tests (a local
# check of the script; device times and the roofline are then null with the
# reason).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# what bench/h200/allgraph_check.sh (this script with other tests, side and
# summary) overrides: the name, the GPU tests, the moe side flag, the
# summary script and the timeouts
NAME=${NAME:-allhit_check}
TESTS=${TESTS:-tests/bench/test_bench_moe_timing_gpu.py tests/models/test_allhit_fast_path.py tests/models/test_row_sort.py::test_sort_rows_on_cuda_equals_a_stable_sort_without_a_host_sync tests/models/test_models_gpu.py::test_all_resident_layer_runs_grouped_without_a_host_sync}
SIDE=${SIDE:---row-sort both}
SUMMARY=${SUMMARY:-allhit_summary.py}
OUT=${OUT:-$PWD/out}
WORK=${WORK:-/tmp/$NAME}
rm -rf "$WORK"
mkdir -p "$WORK" "$OUT"
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
TAR="$OUT/$NAME.tgz"
PACK="tar czf /tmp/$NAME.tgz -C $WORK . && mv /tmp/$NAME.tgz $TAR"
gpt=gpt-oss-20b qwen=qwen3-30b-a3b dev="" tt=${TT:-20} tq=${TQ:-35} tg=${TG:-40} tm=${TM:-60}
GPUTESTS="timeout -k 5 $tt python3 -P -m pytest -q -p no:cacheprovider -rs $TESTS > $WORK/gputests.txt 2>&1"
if [ "${SMOKE:-0}" = 1 ]; then
  gpt=gpt_oss qwen=qwen3_moe dev="--device cpu" tq=120 tg=120 tm=120
  GPUTESTS="true"
fi
MOE="pdflash-bench moe --json --layers 2 --tokens 16 --repeats 1 --cache-fraction 0.5 --all-hit-tokens 16,64,256 --all-hit-iters 20 --all-hit-rounds 5 $SIDE $dev"
steps=(
  "gputests=$GPUTESTS; rc=\$?; tail -3 $WORK/gputests.txt 2>/dev/null; $PACK; exit \$rc"
  "moe_qwen3=timeout -k 5 $tq $MOE --arch $qwen; rc=\$?; $PACK; exit \$rc"
  "moe_gptoss=timeout -k 5 $tg $MOE --arch $gpt; rc=\$?; $PACK; exit \$rc"
)
if [ "${MXFP4:-0}" = 1 ]; then
  steps+=("moe_gptoss_mxfp4=timeout -k 5 $tm $MOE --arch $gpt --synthetic-format mxfp4 --layers 1 --cache-fraction 1.0; rc=\$?; $PACK; exit \$rc")
fi
steps+=(
  "summary=python3 $HERE/$SUMMARY $WORK/results.jsonl --out $WORK/${SUMMARY%.py}.json; rc=\$?; $PACK; exit \$rc"
  "pack=$PACK"
)
# run.sh writes its log and results.jsonl under its own OUT: the work folder
OUT=$WORK exec bash "$HERE/run.sh" "${steps[@]}"
