#!/bin/bash
# settled PD's differences from B1 in steady state, one at a time and all three (tree dc4120b;
# each rows.jsonl then slimmed to the fields read here: gzip, mtime 0)
OUT=${OUT:-/tmp/s50sp}
mkdir -p "$OUT"
cd /tmp
for i in 1 2 3; do
  /work/venvs/seams/bin/python -P /work/main/bench/h200/default_ab.py --concurrency 1 4 --repeats 8 --arms B1warm,PDsettled,PDsetFull,PDsetFcfs,PDsetB1cfg --emulated-link-gbps 50 --out "$OUT/p$i" > "$OUT/p$i.log" 2>&1
done
echo ALLDONE > "$OUT/done"
