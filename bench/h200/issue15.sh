#!/usr/bin/env bash
# Issue 15's GPU matrix on the lent H200 (run.sh's step style: one JSON result
# per step in $OUT/results.jsonl, the log in $OUT/log.txt, rows under
# $OUT/<step>/). A step fits a 10-minute call (build ~30 s, the synthetic
# weights generated in seconds, then runs that stop starting after
# --budget-s, hard `timeout` behind it). Every step is RESUMABLE across
# calls and sessions: before running, the step copies $ROWS_IN/<step>.jsonl
# (rows returned by its earlier calls; save $OUT/<step>/rows.jsonl there) into
# its folder, and the runner skips every run already recorded. Call a step
# again until its summary says "not_started_budget": 0.
#
#   OUT=/path/to/out bash bench/h200/issue15.sh STEP
#
# Cost per call: build ~30 s, start ~15 s, the synthetic drafter ~10 s and
# the target's weights, which are GENERATED straight into the pinned host
# store (RunSpec.synthetic_weights="generated": no checkpoint write and
# read-back; bit-identical values; rows still say weights_source synthetic):
# ~3 s gpt-oss 24L MXFP4, ~8 s Qwen 32L, instead of ~30 s / ~90 s written
# and read back. Each run warms up with --warmup auto = shared on CUDA: the
# workload warm-up once per process for every run that differs only in
# repeat and request rate (on a throwaway cache; every run then starts from a
# fresh cache after a short warm-up), instead of once per run. Every row says
# warmup.shared.ran_now and process_runs_before; the step's summary line
# carries first_use (first repeat's verify ms / the later repeats' median per
# point, flagged above 1.25): check it before trusting a point.
#
# Device-time estimate (python3 bench/h200/issue15_estimate.py, which states
# its assumptions: the 8-layer H200 rows' tokens/s scaled by layers, MXFP4
# x1.16, serving runs of 24 requests x ~160 tokens at 4 blocks per verify;
# "before" = per-run workload warm-up and written checkpoints, "after" = this
# script; a call is at most HARD_S of runs, a fresh process each):
#   step                   runs  s/run | before min calls | after min calls
#   gptoss24-ablation        42    217 |      341.8    42 |     329.4    42
#   gptoss24-serve           24    178 |      149.9    18 |     142.8    18
#   gptoss24-servefull       60    201 |      442.3    54 |     424.4    54
#   gptoss24-burst           60     28 |       72.1     8 |      50.7     6
#   gptoss24-b0               9     34 |       13.6     2 |       8.3     1
#   qwen-ablation            42    250 |      422.8    42 |     375.8    42
#   qwen-serve               24    217 |      207.8    24 |     177.9    24
#   qwen-servefull           60    237 |      569.5    60 |     499.0    60
#   qwen-burst               60     38 |      109.7    13 |      70.8     8
#   qwen-b0                   9     38 |       16.8     2 |       9.3     1
#   gptoss8-burst            78     12 |       41.7     5 |      32.4     4
#   qwen8-burst              78     11 |       40.3     5 |      30.3     4
# (servefull = the serve step below: B1, B2, B3 and all ablation labels in one
# interleaved matrix, so PD runs once for both tables; ablation + serve
# separately would run PD twice.) The serving steps dominate: one serving
# run at full depth and cache 0.2 is link-bound at ~18 tokens/s (gpt-oss) and
# lasts ~3-4 minutes, so a call holds one or two of them and the shared
# warm-up cannot be reused across calls. A smaller but still valid serving
# design (outputs >= 128 tokens, max_running > token budget / block, M from
# the verify step, >= 2 rates, 3 repeats), e.g. SERVE_REQUESTS=12
# TOKEN_BUDGET=128 MAX_RUNNING=12, gives ~150 min / 18 calls (gpt-oss) and
# ~200 min / 27 calls (Qwen 32L) for the serve step (issue15_estimate.py
# --serve-requests 12 --serve-blocks 8 --serve-max-running 12).
# Order: disk first (seconds), then the burst matrices (cheapest per row),
# then the serving steps, then the 8-layer truncations.
#
# Memory instead of disk: generated weights need no checkpoint on disk, only
# host RAM for the pinned store (gpt-oss 24L MXFP4 14.3 GB; Qwen3-30B-A3B bf16
# 1.25 GB/layer + 1.5 GB: 48 layers 61 GB, 32 layers 41 GB). The `disk` step
# prints the free disk and RAM and the deepest Qwen depth that fits in RAM
# (available - 16 GB margin); a deeper Qwen costs proportionally more per run.
# QWEN_LAYERS (default 32) must stay the same across a step's calls (each
# depth gets its own folder). With --synthetic-weights files in COMMON the
# old written checkpoints come back (then Qwen steps delete the gpt-oss
# checkpoints first and gpt-oss steps the Qwen ones: both do not fit the disk).
#
# Steps (runs; device minutes for ALL of a step's calls from the estimate):
#   disk             df, free RAM, the Qwen depth that fits                   ~1 min
#   gptoss24-burst   B1, B2, B3, PD; cache 0.2/0.5/0.8; c = 4, 16; 128 new
#                    tokens; 3 repeats interleaved (60 runs)                  ~51 min, 6 calls
#   gptoss24-b0      B0 (autoregressive) at c = 4 only, same points (9 runs)  ~8 min, 1 call
#   qwen-burst       as gptoss24-burst at QWEN_LAYERS                         ~71 min, 8 calls
#   qwen-b0          as gptoss24-b0                                           ~9 min, 1 call
#   gptoss24-serve   B1, B2, B3, PD, PD-all-on, PD-no-route-ahead, PD-one-band,
#                    PD-token-sched, PD-no-stream, PD-full-width, PD+host on one serving
#                    workload: Poisson at $RATES req/s, $SERVE_REQUESTS requests
#                    with prompts 64-256 and outputs 128-192 tokens,
#                    max_running $MAX_RUNNING over a $TOKEN_BUDGET-token budget,
#                    M = link x verify compute; cache 0.2; 3 repeats
#                    interleaved (60 runs)                                   ~424 min, 54 calls
#   qwen-serve       as gptoss24-serve at QWEN_LAYERS                        ~499 min, 60 calls
#   gptoss8-burst    all five baselines, 8-layer truncation (78 runs)        ~32 min, 4 calls
#   qwen8-burst      likewise for Qwen                                       ~30 min, 4 calls
# Then, on any machine (CPU), the reports (copy each step's rows.jsonl into a
# folder of its own first; `report` reads every rows*.jsonl of a folder):
#   pdflash-bench report $ROWS_IN/gptoss24-burst --baselines B1,B2,B3,PD   (B0 shown where run)
#   pdflash-bench report $ROWS_IN/gptoss24-serve --baselines B1,B2,B3,PD
#   the ablation table: rerun the ablation over the same folder; every run is
#   already recorded, so it runs nothing and writes ablation.md/json + report:
#   pdflash-bench ablation --with-host --host-threads 14 --host-workers 1 \
#     --arch gpt-oss-20b --synthetic-format mxfp4 <the SERVE options below> \
#     --repeats 3 --out $ROWS_IN/gptoss24-serve
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$PWD/out}
export OUT
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
ROWS_IN=${ROWS_IN:-bench/results/issue15-h200}
QWEN_LAYERS=${QWEN_LAYERS:-32}
RATES=${RATES:-0.5,2}
SERVE_REQUESTS=${SERVE_REQUESTS:-24}
TOKEN_BUDGET=${TOKEN_BUDGET:-64}
MAX_RUNNING=${MAX_RUNNING:-16}
HARD_S=${HARD_S:-540}
# start no run after BUDGET_S: the longest run (with its shared warm-up) must
# still end before HARD_S; serving runs last minutes, burst runs ~30-60 s
case "${1:-}" in
  *-serve) BUDGET_S=${BUDGET_S:-240} ;;
  *) BUDGET_S=${BUDGET_S:-420} ;;
esac

step=${1:?usage: OUT=... bash bench/h200/issue15.sh STEP (see the header)}

# the serving workload: more live requests than a step takes, M from the step
SERVE="--arrivals poisson --rate $RATES --num-requests $SERVE_REQUESTS --prompt-len 64 --prompt-len-max 256"
SERVE+=" --max-new-tokens 128 --max-new-tokens-max 192 --max-running $MAX_RUNNING --token-budget $TOKEN_BUDGET"
SERVE+=" --byte-budget-from verify --concurrency 16 --cache-fraction 0.2 --slo 30"
BURST="--cache-fraction 0.2,0.5,0.8 --prompt-len 64 --max-new-tokens 128 --slo 30"
COMMON="--repeats 3 --no-progress --json --budget-s $BUDGET_S --no-report"
HOST="--host-threads 14 --host-workers 1"
GPTOSS24="--arch gpt-oss-20b --synthetic-format mxfp4"
GPTOSS8="--arch gpt-oss-20b --synthetic-format mxfp4 --layers 8"
QWEN="--arch qwen3-30b-a3b --layers $QWEN_LAYERS"
QWEN8="--arch qwen3-30b-a3b --layers 8"
MATRIX="pdflash-bench matrix"
# the serving step's labels: the baselines and every ablation label, one matrix
SERVE_LABELS="B1,B2,B3,PD,PD-all-on,PD-no-route-ahead,PD-one-band,PD-token-sched,PD-no-stream,PD-full-width,PD+host"

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
ram = [int(l.split()[1]) * 1024 / 1e9 for l in open("/proc/meminfo") if l.startswith("MemAvailable")][0]
per_layer, fixed = 1.246, 1.52
def fit(space, margin):
    return max(0, min(48, int((space - fixed - margin) // per_layer)))
print(json.dumps({"free_disk_gb": round(free, 1), "available_ram_gb": round(ram, 1),
                  "qwen_layers_that_fit_ram": fit(ram, 16.0),
                  "qwen_layers_that_fit_disk_as_files": fit(free, 4.0)}))' \
      | tee "$OUT/results.jsonl"
    df -h "$PDFLASH_CACHE" /tmp "$PWD" | tee "$OUT/log.txt"
    exit 0
    ;;
  gptoss24-serve) drop qwen3_moe; args="$MATRIX $GPTOSS24 $SERVE $HOST --baselines $SERVE_LABELS" ;;
  qwen-serve) drop gpt_oss; args="$MATRIX $QWEN $SERVE $HOST --baselines $SERVE_LABELS" ;;
  gptoss24-ablation|qwen-ablation)
    echo "$step is part of the ${step%-ablation}-serve step now (PD runs once for both tables)" >&2
    exit 2
    ;;
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
