#!/bin/bash
# alternate processes of the new tree (installed) and the old tree e60898e (/tmp/pkg46)
cd /tmp
for i in 1 2 3; do
  for b in new old; do
    if [ $b = old ]; then export PYTHONPATH=/tmp/pkg46; else unset PYTHONPATH; fi
    /work/venvs/seams/bin/python -P /work/main/bench/h200/default_ab.py --concurrency 1 4 --repeats 8 --arms B1,PD --emulated-link-gbps 50 --out OUT/$b$i > OUT/$b$i.log 2>&1
  done
done
echo finished > OUT/done
