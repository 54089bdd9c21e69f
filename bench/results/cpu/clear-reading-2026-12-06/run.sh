#!/bin/bash
# alternate processes of the new tree 4f64879 (installed) and the old tree 437f67a (/tmp/pkgOld:
# git worktree add /tmp/wtOld 437f67a && pip install --no-build-isolation --no-deps --target /tmp/pkgOld /tmp/wtOld)
OUT=${OUT:-/tmp/cr}
mkdir -p "$OUT"
cd /tmp
for i in 1 2 3 4; do
  for b in new old; do
    if [ $b = old ]; then export PYTHONPATH=/tmp/pkgOld; else unset PYTHONPATH; fi
    /work/venvs/seams/bin/python -P /work/main/bench/h200/default_ab.py --concurrency 1 --repeats 12 --arms B1,PD --emulated-link-gbps 50 --out "$OUT/$b$i" > "$OUT/$b$i.log" 2>&1
  done
done
