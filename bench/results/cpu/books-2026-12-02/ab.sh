#!/usr/bin/env bash
# Interleaved before/after runs of eager_host's verify step with the books'
# per-method detail. BEFORE: a directory holding main's installed package
# (pip install --target), put first on PYTHONPATH; after: the venv's.
#   BEFORE=/tmp/books_before PY=/work/venvs/reliab/bin/python RUNS=3 bash ab.sh OUT.jsonl [eager_host args]
set -euo pipefail
out=$1; shift
for i in $(seq "${RUNS:-3}"); do
  for side in before after; do
    if [ $side = before ]; then pp=$BEFORE; else pp=; fi
    PYTHONPATH=$pp "$PY" -P -m pdflash.bench.eager_host --detail --count-steps 1 "$@" |
      python3 -c "import json,sys; d=json.load(sys.stdin); d['side']='$side'; d['run']=$i; print(json.dumps(d))" >>"$out"
  done
done
