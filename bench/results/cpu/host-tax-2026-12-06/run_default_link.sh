#!/bin/bash
# alternate: new tree (installed), old tree (1936957 at /tmp/pkg44)
cd /tmp
for i in 1 2; do
  for t in new old; do
    if [ $t = old ]; then export PYTHONPATH=/tmp/pkg44; else unset PYTHONPATH; fi
    /work/venvs/seams/bin/python -P /work/main/bench/h200/default_ab.py --concurrency 1 4 --repeats 8 --arms B1,PD --out /tmp/cpuab/$t$i > /tmp/cpuab/$t$i.log 2>&1
  done
done
echo done > /tmp/cpuab/DONE
