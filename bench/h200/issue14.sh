#!/usr/bin/env bash
# Issue 14 on the lent H200, in two calls on the same machine (the weights stay
# in $PROXY_DIR on that machine; over 64 MiB cannot come back):
#   bash bench/h200/issue14.sh target   # build + train the gpu-preset target (~6 min)
#   bash bench/h200/issue14.sh draft    # drafter + eval + traces from that target (~4-5 min)
# Each phase runs bench/h200/run.sh steps (log.txt, results.jsonl under $OUT) and
# copies the small artefacts (training logs, routing stats, provenance, tokenizer,
# eval JSON, traces) to $OUT/proxy/. PROXY_PRESET=cpu-tiny, TARGET_BUDGET_S and
# DRAFT_BUDGET_S shrink a rehearsal; TRACES=0 skips the draft phase's two trace
# exports (the committed traces stand; the benchmarks do not need them), TRACES=t1
# exports only the temperature-1 one; EVAL=0 skips the eval. Both phases in one
# call (the weights never leave the machine, so a lost machine between two
# calls loses the target):
#   TARGET_BUDGET_S=120 bash bench/h200/issue14.sh target && SKIP_BUILD=1 \
#     DRAFT_BUDGET_S=90 EVAL=0 TRACES=t1 bash bench/h200/issue14.sh draft
# Then, on
# the same machine, the benchmarks on the trained pair: bench/h200/issue14_bench.sh routeahead|gptoss|gptoss_mxfp4|qwen3|replay.
set -uo pipefail
PHASE=${1:?usage: issue14.sh target|draft}
OUT=${OUT:-$PWD/out}
export OUT
P=${PROXY_DIR:-/tmp/pdflash-proxy}
mkdir -p "$OUT/proxy"
HERE=$(cd "$(dirname "$0")" && pwd)
case "$PHASE" in
  target)
    bash "$HERE/run.sh" \
      "proxy_train=pdflash-bench proxy --json train --preset ${PROXY_PRESET:-gpu} --out $P/target --work $P/work --time-budget-s ${TARGET_BUDGET_S:-180}" \
      "collect_target=cp $P/target/config.json $P/target/train_log.jsonl $P/target/routing_stats.json $P/target/provenance.json $P/target/tokenizer.json $P/target/tokenizer_config.json $OUT/proxy/ && python3 -c 'import json;print(json.dumps({\"copied\": 6}))'"
    ;;
  draft)
    test -f "$P/target/config.json" || { echo "no target in $P/target: run the target phase first" >&2; exit 2; }
    steps=(
      "proxy_draft=pdflash-bench proxy --json draft --preset ${PROXY_PRESET:-gpu} --target $P/target --out $P/drafter --time-budget-s ${DRAFT_BUDGET_S:-140}"
    )
    if [ "${EVAL:-1}" = 1 ]; then
      steps+=("proxy_eval=pdflash-bench proxy --json eval --target $P/target --drafter $P/drafter --num-prompts 8 --prompt-len 128 --max-new-tokens 160 --out $OUT/proxy/eval.json")
    fi
    greedy="proxy_trace_greedy=pdflash-bench proxy --json trace --target $P/target --drafter $P/drafter --num-prompts 12 --prompt-len 128 --max-new-tokens 192 --out $OUT/proxy/trace_gpu_greedy.npz"
    t1="proxy_trace_t1=pdflash-bench proxy --json trace --target $P/target --drafter $P/drafter --num-prompts 12 --prompt-len 128 --max-new-tokens 192 --temperature 1.0 --out $OUT/proxy/trace_gpu_t1.npz"
    case "${TRACES:-1}" in
      1) steps+=("$greedy" "$t1") ;;
      t1) steps+=("$t1") ;;
    esac
    steps+=("collect_draft=cp $P/drafter/config.json $OUT/proxy/drafter_config.json && cp $P/drafter/provenance.json $OUT/proxy/drafter_provenance.json && cp $P/drafter/draft_log.jsonl $OUT/proxy/ && python3 -c 'import json;print(json.dumps({\"copied\": 3}))'")
    bash "$HERE/run.sh" "${steps[@]}"
    ;;
  *)
    echo "usage: issue14.sh target|draft" >&2
    exit 2
    ;;
esac
