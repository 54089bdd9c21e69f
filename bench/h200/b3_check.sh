#!/usr/bin/env bash
# One H200 call (~2.5-3 minutes wall: build ~30 s, GPU tests ~30 s, the two
# engine steps ~40-50 s each) for issue 13's B3 verify target after the
# all-resident layer's one-call grouped path (offload.sort_rows, the resident
# window): B3 (every expert resident) at c=16, 8 layers, gpt-oss-20b and
# Qwen3-30B-A3B shapes, CUDA graphs auto (pre-captured), --breakdown,
# 3 repeats; each row has verify_ms, graphed_ms, other_and_host_gaps_ms,
# hbm_roofline_ms and verify_over_roofline (pdflash.engine.roofline, as in
# roofline_check.sh, whose engine command this is with --cuda-graphs auto).
#   OUT=/path bash bench/h200/b3_check.sh
# Steps (through bench/h200/run.sh), each under a hard timeout:
#   gputests  the GPU equality tests of the touched code (grouped block vs
#             the resident HF block without a host sync, graphs replay vs
#             eager, sort_rows on CUDA vs a stable sort, the joint q/k norm on
#             CUDA vs the two HF norms), <= 90 s
#   b3_gptoss / b3_qwen3  the engine rows, <= 100 s each
#   summary   b3_summary.json (bench/h200/graphs_summary.py); prints per run
#             and per arch: verify_ms, hbm_roofline_ms, verify_over_roofline
# Everything (rows, log.txt, results.jsonl, the summary) is packed into ONE
# file, $OUT/b3_check.tgz, after every step; nothing else is left under $OUT
# (the work happens in $WORK, default /tmp/b3_check).
# SMOKE=1: the same steps on the tiny CPU shapes, c=4, 1 repeat, no GPU
# tests (a local check of the script; the roofline's times are then null
# with the reason).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$PWD/out}
WORK=${WORK:-/tmp/b3_check}
rm -rf "$WORK"
mkdir -p "$WORK" "$OUT"
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
TAR="$OUT/b3_check.tgz"
gpt=gpt-oss-20b qwen=qwen3-30b-a3b layers=8 conc=16 repeats=3 t=100
GPUTESTS="timeout -k 5 90 python3 -P -m pytest -q -m gpu -p no:cacheprovider tests/models/test_row_sort.py tests/models/test_fewer_kernel_norms.py tests/models/test_models_gpu.py tests/engine/test_graphs_gpu.py > $WORK/gputests.txt 2>&1"
if [ "${SMOKE:-0}" = 1 ]; then
  gpt=tiny-gpt_oss qwen=tiny-qwen3_moe layers=2 conc=4 repeats=1 t=300
  GPUTESTS="true"
fi
ENG="pdflash-bench engine --json --layers $layers --max-new-tokens 32 --prompt-len 32 --baselines B3 --concurrency $conc --breakdown --cuda-graphs auto --repeats $repeats"
steps=(
  "gputests=$GPUTESTS; rc=\$?; tail -3 $WORK/gputests.txt 2>/dev/null; exit \$rc"
  "b3_gptoss=timeout -k 5 $t $ENG --arch $gpt --out $WORK/b3_gptoss"
  "b3_qwen3=timeout -k 5 $t $ENG --arch $qwen --out $WORK/b3_qwen3"
  "summary=python3 $HERE/graphs_summary.py $WORK/b3_gptoss $WORK/b3_qwen3 --out $WORK/b3_summary.json"
)
# run.sh writes its log and results.jsonl under its own OUT: the work folder
PACK=$TAR OUT=$WORK exec bash "$HERE/run.sh" "${steps[@]}"
