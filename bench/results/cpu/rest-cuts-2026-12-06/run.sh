#!/bin/bash
# alternate processes of the new tree 80c2737 (installed) and the old tree 5172a75 (/tmp/pkgOld:
# git worktree add /tmp/wtOld 5172a75 && pip install --no-build-isolation --no-deps --target /tmp/pkgOld /tmp/wtOld);
# each rows.jsonl was then slimmed to the fields read here (gzip, mtime 0)
OUT=${OUT:-/tmp/s50cpu}
mkdir -p "$OUT"
cd /tmp
for i in 1 2 3 4; do
  for b in new old; do
    if [ $b = old ]; then export PYTHONPATH=/tmp/pkgOld; else unset PYTHONPATH; fi
    /work/venvs/seams/bin/python -P /work/main/bench/h200/default_ab.py --concurrency 1 --repeats 12 --arms B1,PD --emulated-link-gbps 50 --out "$OUT/$b$i" > "$OUT/$b$i.log" 2>&1
  done
done
