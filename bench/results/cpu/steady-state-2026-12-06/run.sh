#!/bin/bash
# the default's B1 and PD cold (as the default runs them) and in steady state (B1warm, PDsettled)
OUT=${OUT:-/tmp/s50ss}
mkdir -p "$OUT"
cd /tmp
for i in 1 2 3; do
  /work/venvs/seams/bin/python -P /work/main/bench/h200/default_ab.py --concurrency 1 4 --repeats 8 --arms B1,PD,B1warm,PDsettled --emulated-link-gbps 50 --out "$OUT/p$i" > "$OUT/p$i.log" 2>&1
done
echo ALLDONE > "$OUT/done"
