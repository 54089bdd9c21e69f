#!/usr/bin/env bash
# Issue 14's benchmarks on the trained proxy, on the lent H200 that trained it
# (bench/h200/issue14.sh target + draft leave it in $PROXY_DIR, default
# /tmp/pdflash-proxy). One phase per call, each under 8 minutes, in
# bench/h200/run.sh's step style ($OUT/log.txt, $OUT/results.jsonl):
#   bash bench/h200/issue14_bench.sh routeahead  # predictors on learned routing, cold and
#                                                # after PRIOR_WARMUP (512) warm-up texts (~3-5 min)
#   bash bench/h200/issue14_bench.sh gptoss      # B1/B2/PD/B3, experts padded to gpt-oss-20b (bf16)
#   bash bench/h200/issue14_bench.sh gptoss_mxfp4  # the same, padded to gpt-oss-20b's MXFP4 experts
#   bash bench/h200/issue14_bench.sh qwen3       # the same, padded to qwen3-30b-a3b
#   bash bench/h200/issue14_bench.sh replay      # routing + acceptance replayed from a proxy
#                                                # trace on the synthetic published shapes
# The engine phases run `pdflash-bench matrix` (cache CACHE, default 0.2,0.5; c = CONC, default 1,4,16;
# $REPEATS interleaved repeats, prompts from the proxy's held-out text (or PROMPTS), model
# acceptance from the trained drafter, greedy unless TEMPERATURE is set) with a
# time budget; their rows live in $PROXY_DIR/bench/<phase> on the machine, so
# calling a phase again on the same machine resumes where the budget stopped it
# (the step's result says not_started_budget). Every call copies the rows to
# $OUT/<phase>/. Knobs: REPEATS (3), CONC, CACHE, WIDTHS (adaptive,fixed:1), CLOSED, BUDGET_S (400), MAX_NEW (32), PROMPT_LEN (64),
# TEMPERATURE (0), PROMPTS (heldout; or a text file), ROUTE_AHEAD_SOURCE (union; or
# token_prior or previous_round), BASELINES (B1,B2,PD,B3; e.g. B1,B2,PD with ROUTE_AHEAD_SOURCE), PRIOR_WARMUP (512), NAME (the rows' folder of an engine phase; default the phase), TRACE (replay: a trace .npz; default: exported once into
# $PROXY_DIR/trace_replay.npz from the trained pair), CUDA_GRAPHS (off; auto or
# piecewise: matrix --cuda-graphs for every label, part of each run's key),
# BREAKDOWN (0; 1: matrix --breakdown, each verify's attention / router /
# experts timed, part of each run's key).
set -uo pipefail
PHASE=${1:?usage: issue14_bench.sh routeahead|gptoss|gptoss_mxfp4|qwen3|replay}
OUT=${OUT:-$PWD/out}
export OUT
P=${PROXY_DIR:-/tmp/pdflash-proxy}
HERE=$(cd "$(dirname "$0")" && pwd)
test -f "$P/target/config.json" || { echo "no proxy target in $P/target: run bench/h200/issue14.sh target" >&2; exit 2; }
REPEATS=${REPEATS:-3}
BUDGET_S=${BUDGET_S:-400}
MAX_NEW=${MAX_NEW:-32}
PROMPT_LEN=${PROMPT_LEN:-64}
TEMPERATURE=${TEMPERATURE:-0}
PROMPTS=${PROMPTS:-heldout}
PRIOR_WARMUP=${PRIOR_WARMUP:-512}
BASELINES=${BASELINES:-B1,B2,PD,B3}
CONC=${CONC:-1,4,16}
# every label at each width, so each baseline is read at its best width (a
# baseline at its default full width verifies every draft and moves the
# experts of rows that are rarely accepted); WIDTHS=default: each label's own
WIDTHS=${WIDTHS:-adaptive,fixed:1}
[ "$WIDTHS" = default ] && WIDTH_ARG="" || WIDTH_ARG="--verify-width $WIDTHS"
CACHE=${CACHE:-0.2,0.5}
CUDA_GRAPHS=${CUDA_GRAPHS:-off}
MATRIX="pdflash-bench matrix --json --no-progress --no-report --concurrency $CONC --cache-fraction $CACHE --repeats $REPEATS --budget-s $BUDGET_S --max-new-tokens $MAX_NEW --prompt-len $PROMPT_LEN --temperature $TEMPERATURE --cuda-graphs $CUDA_GRAPHS $WIDTH_ARG"
[ "${BREAKDOWN:-0}" = 1 ] && MATRIX="$MATRIX --breakdown"
# CLOSED=N: a closed loop of CONC clients (one value) and N x CONC requests
# instead of the burst, where every run lasts as long as its slowest request
# and a label's accepted drafts for the others shorten nothing
if [ -n "${CLOSED:-}" ]; then
  case "$CONC" in *,*) echo "CLOSED needs one CONC value (the clients), got $CONC" >&2; exit 2 ;; esac
  MATRIX="$MATRIX --arrivals closed --users $CONC --num-requests $((CLOSED * CONC))"
fi
need_drafter() {
  test -f "$P/drafter/config.json" || { echo "no drafter in $P/drafter: run bench/h200/issue14.sh draft" >&2; exit 2; }
}
collect() {  # copy a phase's rows (and its command log) back under $OUT
  echo "mkdir -p $OUT/$1 && cp $P/bench/$1/* $OUT/$1/ && python3 -c 'import json,sys;print(json.dumps({\"rows\": sum(1 for _ in open(sys.argv[1]))}))' $P/bench/$1/rows.jsonl"
}
case "$PHASE" in
  routeahead)
    exec bash "$HERE/run.sh" \
      "routeahead_learned=timeout 420 pdflash-bench routeahead --json --weights $P/target --prompts $PROMPTS --sequences 32 --blocks-per-sequence 8 --native-reps 5 --reference-reps 1 > $OUT/routeahead_learned.json; rc=\$?; cat $OUT/routeahead_learned.json; exit \$rc" \
      "routeahead_warm=timeout 420 pdflash-bench routeahead --json --weights $P/target --prompts $PROMPTS --sequences 32 --blocks-per-sequence 8 --prior-warmup-sequences $PRIOR_WARMUP --native-reps 5 --reference-reps 1 > $OUT/routeahead_warm.json; rc=\$?; cat $OUT/routeahead_warm.json; exit \$rc"
    ;;
  gptoss | gptoss_mxfp4 | qwen3)
    need_drafter
    case "$PHASE" in
      gptoss) size=gpt-oss-20b ;;
      gptoss_mxfp4) size=gpt-oss-20b-mxfp4 ;;
      *) size=qwen3-30b-a3b ;;
    esac
    # ROUTE_AHEAD_SOURCE=token_prior: PD predicts with the token prior; its rows go to their
    # own folder (<phase>_token_prior) so a report never mixes the two sources' PD rows
    RA=${ROUTE_AHEAD_SOURCE:-union}
    name=$PHASE
    [ "$RA" = union ] || name=${PHASE}_$RA
    # NAME: the rows' folder, so a second matrix of the same phase (another
    # CONC or CLOSED) does not resume into the first one's
    name=${NAME:-$name}
    exec bash "$HERE/run.sh" \
      "matrix_$name=timeout 470 $MATRIX --arch proxy --weights $P/target --draft $P/drafter --baselines $BASELINES --acceptance model --prompts $PROMPTS --expert-bytes-as $size --route-ahead-source $RA --out $P/bench/$name" \
      "collect_$name=$(collect "$name")"
    ;;
  replay)
    need_drafter
    TRACE=${TRACE:-$P/trace_replay.npz}
    steps=()
    if [ ! -f "$TRACE" ]; then
      steps+=("trace_export=timeout 120 pdflash-bench proxy --json trace --target $P/target --drafter $P/drafter --num-prompts 16 --prompt-len $PROMPT_LEN --max-new-tokens 96 --temperature $TEMPERATURE --out $TRACE")
    fi
    # learned routing and acceptance on the synthetic published shapes (8 layers)
    # (c = 4, 16 at cache 0.2: the padded proxy phases are the full matrix)
    R="--layers 8 --baselines B1,B2,PD --concurrency 4,16 --cache-fraction 0.2 --routing-source trace --acceptance trace --trace $TRACE --prompts $TRACE"
    steps+=(
      "replay_gptoss=timeout 220 $MATRIX --arch gpt-oss-20b $R --budget-s 180 --out $P/bench/replay_gptoss"
      "replay_qwen3=timeout 220 $MATRIX --arch qwen3-30b-a3b $R --budget-s 180 --out $P/bench/replay_qwen3"
      "collect_replay=$(collect replay_gptoss) && $(collect replay_qwen3) && mkdir -p $OUT/proxy && cp $TRACE $OUT/proxy/"
    )
    exec bash "$HERE/run.sh" "${steps[@]}"
    ;;
  *)
    echo "usage: issue14_bench.sh routeahead|gptoss|gptoss_mxfp4|qwen3|replay" >&2
    exit 2
    ;;
esac
