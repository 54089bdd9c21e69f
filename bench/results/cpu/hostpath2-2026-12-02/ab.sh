#!/usr/bin/env bash
# Interleaved before/after runs of eager_host's verify step (--detail):
# "before" patches the old host path in (hostpath2_old_path.install()),
# "after" is the installed package. One JSON line per run, with side/run.
#   PY=/work/venvs/hostpath/bin/python RUNS=5 bash ab.sh OUT.jsonl [eager_host args]
set -euo pipefail
out=$1; shift
here=$(cd "$(dirname "$0")" && pwd)
OLD="import sys; sys.path.insert(0, '$here'); import hostpath2_old_path as o; o.install(); o.main()"
for i in $(seq "${RUNS:-5}"); do
  for side in before after; do
    if [ $side = before ]; then
      "$PY" -P -c "$OLD" --detail --count-steps 1 "$@"
    else
      "$PY" -P -m pdflash.bench.eager_host --detail --count-steps 1 "$@"
    fi | python3 -c "import json,sys; d=json.load(sys.stdin); d['side']='$side'; d['run']=$i; print(json.dumps(d))" >>"$out"
  done
done
