#!/usr/bin/env bash
# focused interleaved before/after (gpt_oss c=1, 2 tokens, B2's lookahead), the same bench module in both
OUT=/work/wt/eagerhost/bench/results/cpu/eagerhost-2026-12-01/ab2.jsonl
PY=/work/venvs/replay/bin/python
: > $OUT
cd /tmp
for rep in 1 2 3 4 5 6; do
  order="before after"; [ $((rep % 2)) = 0 ] && order="after before"
  for v in $order; do
    if [ $v = before ]; then pp=/tmp/eh_before; else pp=; fi
    line=$(PYTHONPATH=$pp $PY -P -m pdflash.bench.eager_host --arch gpt_oss --requests 1 --tokens 2 --steps 40 --detail 2>/dev/null)
    echo "{\"version\": \"$v\", \"repeat\": $rep, \"result\": $line}" >> $OUT
  done
done
echo done >> /tmp/ab2.done
