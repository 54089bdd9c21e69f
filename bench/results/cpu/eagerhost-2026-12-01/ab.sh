#!/usr/bin/env bash
# interleaved before/after: before = /tmp/eh_before (commit with the bench, no cuts), after = the venv's install
OUT=/work/wt/eagerhost/bench/results/cpu/eagerhost-2026-12-01/ab.jsonl
T=/work/wt/eagerhost/bench/results/h200/proxy-balanced-2026-12-01/trace_gpu_t1.npz
PY=/work/venvs/replay/bin/python
: > $OUT
cd /tmp
for rep in 1 2 3; do
  for cfg in "gpt_oss 1 2" "gpt_oss 1 2 trace" "gpt_oss 1 16" "gpt_oss 16 16" "qwen3_moe 1 2"; do
    set -- $cfg
    extra=""; [ "${4:-}" = trace ] && extra="--trace $T"
    order="before after"; [ $((rep % 2)) = 0 ] && order="after before"
    for v in $order; do
      if [ $v = before ]; then pp=/tmp/eh_before; else pp=; fi
      line=$(PYTHONPATH=$pp $PY -P -m pdflash.bench.eager_host --arch $1 --requests $2 --tokens $3 --steps 30 $extra 2>/dev/null)
      echo "{\"version\": \"$v\", \"repeat\": $rep, \"result\": $line}" >> $OUT
    done
  done
done
echo done >> /tmp/ab.done
