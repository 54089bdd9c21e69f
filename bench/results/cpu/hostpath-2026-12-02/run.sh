#!/usr/bin/env bash
# Before/after of the HOST part's forward-thread pieces on this CPU box:
# two copies of the installed package (PKG_BEFORE: main's block/executor/
# offload over the same build; PKG_AFTER: the branch), the same bench module
# (pdflash.bench.eager_host with --host-every) in both, runs interleaved.
#   PKG_BEFORE=/tmp/hp_before PKG_AFTER=/tmp/hp_after PY=python3 OUTDIR=. bash run.sh
set -euo pipefail
PY=${PY:-python3}
OUTDIR=${OUTDIR:-.}
RUNS=${RUNS:-3}
ARGS=${ARGS:---layers 8 --requests 1 --tokens 2 --steps 40 --cache-fraction 0.2}
TAG=${TAG:-c1}
for run in $(seq 1 "$RUNS"); do
  for side in before after; do
    pkg=PKG_${side^^}
    for every in 0 1; do
      (cd /tmp && PYTHONPATH=${!pkg} $PY -P -m pdflash.bench.eager_host $ARGS --host-every $every) \
        > "$OUTDIR/${TAG}-${side}-every${every}-run${run}.json"
    done
  done
done
