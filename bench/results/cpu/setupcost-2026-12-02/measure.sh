#!/bin/bash
# usage: measure.sh LABEL  (appends 3 x (PD+host, PD) rows to /tmp/setupcost_LABEL.jsonl)
export PDFLASH_CACHE=/tmp/setupcost_cache
S=$(cd "$(dirname "$0")" && pwd)/setup_cost.py
for i in 1 2 3; do
  for b in PD+host PD; do
    /work/venvs/bench15/bin/python -P $S gpt-oss-20b $b 1 2>/dev/null | tail -1 >> /tmp/setupcost_$1.jsonl
  done
done
echo done >> /tmp/setupcost_$1.jsonl
