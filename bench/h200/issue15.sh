#!/usr/bin/env bash
# Issue 15's GPU matrix on the lent H200 (run.sh's step style: one JSON result
# per step in $OUT/results.jsonl, the log in $OUT/log.txt, rows under
# $OUT/<step>/). ONE step per call: each fits a 10-minute call (build ~30 s,
# synthetic checkpoint write + load up to ~2 min, then runs that stop starting
# after --budget-s, hard `timeout` behind it). Every step is RESUMABLE across
# calls and sessions: before running, the step copies $ROWS_IN/<step>.jsonl
# (rows returned by its earlier calls; save $OUT/<step>/rows.jsonl there) into
# its folder, and the runner skips every run already recorded. Call a step
# again until its summary says "not_started_budget": 0.
#
#   OUT=/path/to/out bash bench/h200/issue15.sh STEP
#
# The whole matrix needs several sessions (30 device-minutes each): about
# 3.5-4 device-hours by the estimates below, which predate the warm-up: every
# run now first runs its own shape once outside the clock (--warmup auto =
# workload on CUDA; single short runs paid per-shape first-use costs that
# tripled their verify time), so expect up to ~2x the run time per run, or
# pass --warmup short in COMMON to compare with the older rows. Order: disk first (seconds), then
# the serving/ablation steps (new), then the burst matrices, then the 8-layer
# truncations.
#
# Synthetic checkpoint sizes (bf16 unless said; experts + attention/router per
# layer, plus embeddings/LM head and the 5-layer synthetic drafter):
#   gpt-oss-20b MXFP4 experts (as released): 0.48 GB/layer + 2.9 GB -> 24 layers 14.3 GB
#   gpt-oss-20b bf16 experts:                1.65 GB/layer + 2.9 GB -> 24 layers 42.4 GB
#   Qwen3-30B-A3B bf16:                      1.25 GB/layer + 1.5 GB -> 48 layers 61.3 GB (does
#       not fit a 64 GiB disk with the OS and torch), 40 layers 51.4 GB, 32 layers 41.4 GB
# The `disk` step prints the free space and the deepest Qwen depth that fits
# (free - 4 GB margin); set QWEN_LAYERS to it for every qwen step (default 32,
# which needs ~46 GB free; 40 needs ~56 GB). A depth must stay the same across
# a step's calls (the rows' key has no depth: each depth gets its own folder).
# Qwen steps delete the gpt-oss checkpoints first and gpt-oss steps the Qwen
# ones (both do not fit together).
#
# Steps (estimates: the 8-layer H200 matrix's per-run times scaled by layers x
# new tokens; device minutes for ALL of a step's calls, ~3 min of build and
# checkpoint load per call included):
#   disk               df and the Qwen depth that fits                               ~1 min
#   gptoss24-ablation  PD, PD-no-route-ahead, PD-one-band, PD-token-sched,
#                      PD-no-stream, PD+host; Poisson at $RATES req/s, 24 requests
#                      with prompts 64-256 and outputs 128-192 tokens, max_running
#                      16 over a 4-block token budget, M = link x verify compute;
#                      cache 0.2; 3 repeats interleaved (36 runs)             ~20 min, 3 calls
#   gptoss24-serve     B1, B2, B3, PD on the same serving workload (24 runs)  ~14 min, 2 calls
#   qwen-ablation      as gptoss24-ablation, Qwen3-30B-A3B at QWEN_LAYERS     ~25 min, 4 calls
#   qwen-serve         as gptoss24-serve, Qwen at QWEN_LAYERS                  ~17 min, 3 calls
#   gptoss24-burst     B1, B2, B3, PD; cache 0.2/0.5/0.8; c = 4, 16; 128 new
#                      tokens; 3 repeats interleaved (60 runs)                ~40 min, 5 calls
#   gptoss24-b0        B0 (autoregressive) at c = 4 only, same points (9 runs) ~8 min, 1 call
#   qwen-burst         as gptoss24-burst at QWEN_LAYERS                        ~45 min, 6 calls
#   qwen-b0            as gptoss24-b0                                           ~9 min, 1 call
#   gptoss8-burst      all five baselines, 8-layer truncation (78 runs)        ~15 min, 2 calls
#   qwen8-burst        likewise for Qwen                                       ~15 min, 2 calls
# Then, on any machine (CPU), the reports:
#   pdflash-bench report $ROWS_IN/gptoss24-burst --baselines B1,B2,B3,PD   (B0 shown where run)
#   pdflash-bench report $ROWS_IN/gptoss24-ablation --baselines PD,PD-no-route-ahead,PD-one-band,PD-token-sched,PD-no-stream
# (copy each step's rows.jsonl into a folder of its own first; `report`
# reads every rows*.jsonl of a folder).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$PWD/out}
export OUT
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
ROWS_IN=${ROWS_IN:-bench/results/issue15-h200}
QWEN_LAYERS=${QWEN_LAYERS:-32}
RATES=${RATES:-0.5,2}
BUDGET_S=${BUDGET_S:-330}
HARD_S=${HARD_S:-540}

step=${1:?usage: OUT=... bash bench/h200/issue15.sh STEP (see the header)}

# the serving workload: more live requests than a step takes, M from the step
SERVE="--arrivals poisson --rate $RATES --num-requests 24 --prompt-len 64 --prompt-len-max 256"
SERVE+=" --max-new-tokens 128 --max-new-tokens-max 192 --max-running 16 --token-budget 64"
SERVE+=" --byte-budget-from verify --concurrency 16 --cache-fraction 0.2 --slo 30"
BURST="--cache-fraction 0.2,0.5,0.8 --prompt-len 64 --max-new-tokens 128 --slo 30"
COMMON="--repeats 3 --no-progress --json --budget-s $BUDGET_S --no-report"
HOST="--host-threads 14 --host-workers 1"
GPTOSS24="--arch gpt-oss-20b --synthetic-format mxfp4"
GPTOSS8="--arch gpt-oss-20b --synthetic-format mxfp4 --layers 8"
QWEN="--arch qwen3-30b-a3b --layers $QWEN_LAYERS"
QWEN8="--arch qwen3-30b-a3b --layers 8"
ABLATION="pdflash-bench ablation --with-host $HOST"
MATRIX="pdflash-bench matrix"

drop() { # delete the other model's synthetic checkpoints (both do not fit the disk)
  rm -rf "$PDFLASH_CACHE"/synthetic/"$1"-* "$PDFLASH_CACHE"/synthetic-drafters 2>/dev/null
  true
}

case "$step" in
  disk)
    mkdir -p "$PDFLASH_CACHE" "$OUT"
    df -B1 --output=avail "$PDFLASH_CACHE" | tail -1 | python3 -c '
import json, sys
free = int(sys.stdin.read()) / 1e9
per_layer, fixed, margin = 1.246, 1.52, 4.0
depth = max(0, min(48, int((free - fixed - margin) // per_layer)))
print(json.dumps({"free_gb": round(free, 1), "qwen_layers_that_fit": depth,
                  "qwen_checkpoint_gb": round(depth * per_layer + fixed, 1)}))' \
      | tee "$OUT/results.jsonl"
    df -h "$PDFLASH_CACHE" /tmp "$PWD" | tee "$OUT/log.txt"
    exit 0
    ;;
  gptoss24-ablation) drop qwen3_moe; args="$ABLATION $GPTOSS24 $SERVE" ;;
  gptoss24-serve) drop qwen3_moe; args="$MATRIX $GPTOSS24 $SERVE --baselines B1,B2,B3,PD" ;;
  qwen-ablation) drop gpt_oss; args="$ABLATION $QWEN $SERVE" ;;
  qwen-serve) drop gpt_oss; args="$MATRIX $QWEN $SERVE --baselines B1,B2,B3,PD" ;;
  gptoss24-burst) drop qwen3_moe; args="$MATRIX $GPTOSS24 $BURST --concurrency 4,16 --baselines B1,B2,B3,PD" ;;
  gptoss24-b0) drop qwen3_moe; args="$MATRIX $GPTOSS24 $BURST --concurrency 4 --baselines B0" ;;
  qwen-burst) drop gpt_oss; args="$MATRIX $QWEN $BURST --concurrency 4,16 --baselines B1,B2,B3,PD" ;;
  qwen-b0) drop gpt_oss; args="$MATRIX $QWEN $BURST --concurrency 4 --baselines B0" ;;
  gptoss8-burst) drop qwen3_moe; args="$MATRIX $GPTOSS8 $BURST --concurrency 4,16 --baselines B0,B1,B2,B3,PD" ;;
  qwen8-burst) drop gpt_oss; args="$MATRIX $QWEN8 $BURST --concurrency 4,16 --baselines B0,B1,B2,B3,PD" ;;
  *) echo "unknown step $step (see the header of $0)" >&2; exit 2 ;;
esac

folder="$step"
case "$step" in qwen-*) folder="qwen${QWEN_LAYERS}-${step#qwen-}" ;; esac
mkdir -p "$OUT/$folder"
if [ -f "$ROWS_IN/$folder.jsonl" ]; then
  cp "$ROWS_IN/$folder.jsonl" "$OUT/$folder/rows.jsonl"
fi
exec bash "$HERE/run.sh" \
  "$folder=timeout $HARD_S $args $COMMON --out $OUT/$folder"
