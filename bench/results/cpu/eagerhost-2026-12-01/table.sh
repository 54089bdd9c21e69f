#!/usr/bin/env bash
# the parts of each shape with this branch's code (2 repeats each), after ab2.jsonl on a quieter box
OUT=bench/results/cpu/eagerhost-2026-12-01/table.jsonl
T=bench/results/h200/proxy-balanced-2026-12-01/trace_gpu_t1.npz
PY=${PY:-python}
: > $OUT
for rep in 1 2; do
  for cfg in "gpt_oss 1 2" "gpt_oss 1 2 trace" "gpt_oss 1 16" "gpt_oss 16 2" "gpt_oss 16 16" "qwen3_moe 1 2" "qwen3_moe 16 16"; do
    set -- $cfg
    extra=""; [ "${4:-}" = trace ] && extra="--trace $T"
    line=$($PY -P -m pdflash.bench.eager_host --arch $1 --requests $2 --tokens $3 --steps 30 $extra)
    echo "{\"repeat\": $rep, \"result\": $line}" >> $OUT
  done
done
