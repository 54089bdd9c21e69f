#!/bin/bash
cd /tmp
for i in 3 4; do
  for t in old new; do
    if [ $t = old ]; then export PYTHONPATH=/tmp/pkg44; else unset PYTHONPATH; fi
    /work/venvs/seams/bin/python -P /work/main/bench/h200/default_ab.py --concurrency 1 --repeats 16 --arms B1,PD --emulated-link-gbps 50 --out /tmp/cpuab/f$t$i > /tmp/cpuab/f$t$i.log 2>&1
  done
done
echo done > /tmp/cpuab/DONEF2
