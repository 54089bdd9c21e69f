#!/bin/bash
# PD at rest running B1's step against the rest before it, settled and cold (tree 83a4b83;
# each rows.jsonl then slimmed to the fields read here: gzip, mtime 0)
OUT=${OUT:-/tmp/s51ab}
mkdir -p "$OUT"
cd /tmp
for i in 1 2 3; do
  /work/venvs/seams/bin/python -P /work/main/bench/h200/default_ab.py --concurrency 1 4 --repeats 8 --arms B1warm,PDsettled,PDsetBusy,B1,PD,PDbusyrest --emulated-link-gbps 50 --out "$OUT/p$i" > "$OUT/p$i.log" 2>&1
done
echo ALLDONE > "$OUT/done"
