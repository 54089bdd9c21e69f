#!/usr/bin/env bash
# Issue 13's open question on the H200, in one call (<= ~5 minutes with the
# build): how much of a short run's verify and drafter time is first-use
# setup, and whether it is cuDNN's per-shape attention setup. B3 at c=16,
# 8 layers, verify_breakdown_ms per run, for each of
#   warm-up short / workload   x   PDFLASH_SDPA_BACKENDS auto / efficient,flash,math
# interleaved over REPEATS (default 1) rounds (each invocation loads the model: ~20-40 s on the H200), gpt-oss-20b then Qwen3-30B-A3B.
# Rows (with `warmup` and `sdpa_backends`) go to $OUT/<arch>/rows.jsonl; the
# log to $OUT/log.txt (bench/h200/run.sh's step style).
#   OUT=/path bash bench/h200/warmup_ab.sh
# ARCHS, LAYERS, REPEATS and DEVICE override for a local dry run, e.g.
#   ARCHS=tiny LAYERS=2 REPEATS=1 DEVICE=cpu bash bench/h200/warmup_ab.sh
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$PWD/out}
export OUT
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
ARCHS=${ARCHS:-gpt-oss-20b qwen3-30b-a3b}
LAYERS=${LAYERS:-8}
REPEATS=${REPEATS:-1}
DEVICE=${DEVICE:-auto}
steps=()
for arch in $ARCHS; do
  ENG="pdflash-bench engine --json --arch $arch --layers $LAYERS --max-new-tokens 32 --prompt-len 32 --device $DEVICE --baselines B3 --concurrency 16 --breakdown --out $OUT/$arch"
  cmds=""
  for r in $(seq 1 "$REPEATS"); do
    for warm in short workload; do
      for backends in auto efficient,flash,math; do
        cmds+="PDFLASH_SDPA_BACKENDS=$backends $ENG --warmup $warm --seed $r > /dev/null || exit 1; "
      done
    done
  done
  steps+=("ab_$arch=timeout 200 sh -c '$cmds'; python3 -c 'import json,sys; rows=[json.loads(l) for l in open(sys.argv[1])]; print(json.dumps([{k: r.get(k) for k in (\"warmup\", \"sdpa_backends\", \"output_tokens_per_s\", \"verify_breakdown_ms\")} for r in rows]))' $OUT/$arch/rows.jsonl")
done
exec bash "$HERE/run.sh" "${steps[@]}"
