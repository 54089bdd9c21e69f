#!/usr/bin/env bash
# Interleaved CPU A/B of bench/eager_host.py: no service / forced-COPY /
# cost-model makespan / queue (costly configured host: every plan COPY),
# 3 rounds, each arm once per round. Usage: bash ab.sh TAG [DIR]
# (rows go to DIR/TAG-ARM-ROUND.json; DIR defaults to /tmp/hi_ab)
PY=${PYTHON:-/work/venvs/hybrid/bin/python}
COMMON="--arch gpt_oss --layers 4 --experts 16 --top-k 4 --cache-fraction 0.5 --requests 1 --tokens 16 --stream --steps 30 --count-steps 2"
TAG=$1
DIR=${2:-/tmp/hi_ab}
mkdir -p "$DIR"
for r in 1 2 3; do
  for arm in none forced0 makespan queue; do
    case $arm in
      none) extra="";;
      forced0) extra="--host-every 0";;
      makespan) extra="--host-every 0 --host-planner makespan --host-expert-s 1e-3";;
      queue) extra="--host-every 0 --host-planner queue --host-expert-s 1e-3";;
    esac
    $PY -P -m pdflash.bench.eager_host $COMMON $extra > "$DIR/$TAG-$arm-$r.json"
  done
done
