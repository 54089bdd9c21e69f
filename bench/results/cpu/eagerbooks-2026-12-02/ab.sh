#!/usr/bin/env bash
# Before/after host time of one eager offloaded verify step on this CPU
# (relative only: a shared 2-core box). Alternates the two installs so load
# drifts hit both alike. Usage (from the repo root):
#   BEFORE=/path/to/venv_before/bin/python AFTER=/path/to/venv/bin/python \
#     RUNS=5 bash bench/results/cpu/eagerbooks-2026-12-02/ab.sh > out.jsonl
set -euo pipefail
TRACE=bench/results/h200/proxy-balanced-2026-12-01/trace_gpu_t1.npz
HOST="-m pdflash.bench.eager_host --device cpu --threads 1 --layers 8 --cache-fraction 0.2 --steps 30 --trace $TRACE --arch gpt_oss"
for i in $(seq "${RUNS:-5}"); do
  for side in before after; do
    py=$BEFORE; [ "$side" = after ] && py=$AFTER
    for shape in "c1 --requests 1 --tokens 2 --detail" "c16 --requests 16 --tokens 16 --detail"; do
      set -- $shape
      name=$1; shift
      # shellcheck disable=SC2086
      out=$("$py" -P $HOST "$@")
      printf '{"side": "%s", "shape": "%s", "run": %d, "result": %s}\n' "$side" "$name" "$i" "$out"
    done
  done
done
