#!/usr/bin/env bash
# The first-use diagnostic on the H200, in one call (~6 minutes with the
# build): is a point's slow first repeat the attention's per-shape setup?
# The same PD verify-width matrix (forced acceptance, synthetic weights) runs
# twice, each in its own process: PDFLASH_SDPA_BACKENDS=auto (torch's choice,
# cuDNN first on this torch) and =efficient,flash,math (no cuDNN). Each
# step prints bench/firstuse_summary.py's JSON: per point the first repeat
# against its later median, and the excess verify seconds per SDPA shape met
# first inside a run. Read: if the restricted backends' first repeats are
# not slow and their later repeats are not slower than auto's, the setup is
# cuDNN's. Rows go to $OUT/<setting>/rows.jsonl, the log to $OUT/log.txt
# (bench/h200/run.sh's step style), everything packed into $OUT/firstuse_ab.tgz.
#   OUT=/path bash bench/h200/firstuse_ab.sh
# ARCH, LAYERS, CONC, WIDTHS, REPEATS, MAX_NEW, BUDGET_S (per setting) and
# DEVICE override, e.g. a local dry run:
#   ARCH=tiny LAYERS=0 DEVICE=cpu BUDGET_S=60 bash bench/h200/firstuse_ab.sh
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$PWD/out}
export OUT
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
ARCH=${ARCH:-gpt-oss-20b}
LAYERS=${LAYERS:-8}
CONC=${CONC:-1,4}
WIDTHS=${WIDTHS:-adaptive,adaptive:beta=one,fixed:1}
REPEATS=${REPEATS:-3}
MAX_NEW=${MAX_NEW:-64}
BUDGET_S=${BUDGET_S:-150}
DEVICE=${DEVICE:-auto}
layers_arg=""
[ "$LAYERS" != 0 ] && layers_arg="--layers $LAYERS"
steps=()
for setting in auto efficient,flash,math; do
  dir=${setting//,/_}  # "+" or "," in a name does not come back from the device
  MATRIX="pdflash-bench matrix --json --no-progress --no-report --arch $ARCH $layers_arg --device $DEVICE --baselines PD --cache-fraction 0.2 --concurrency $CONC --acceptance forced --verify-width $WIDTHS --repeats $REPEATS --max-new-tokens $MAX_NEW --budget-s $BUDGET_S --out $OUT/$dir"
  steps+=("firstuse_$dir=PDFLASH_SDPA_BACKENDS=$setting timeout $((BUDGET_S + 60)) $MATRIX > /dev/null; python3 bench/firstuse_summary.py --json $OUT/$dir/rows.jsonl")
done
PACK=${PACK:-$OUT/firstuse_ab.tgz} exec bash "$HERE/run.sh" "${steps[@]}"
