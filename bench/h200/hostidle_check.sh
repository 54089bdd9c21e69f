#!/usr/bin/env bash
# The hybrid miss service's cost when it hosts nothing, on the H200: the
# eager offloaded verify step's parts (bench/eager_host.py; gpt-oss-20b
# preset, 4 layers, 16 experts top-4, cache 0.5, one request x 16 tokens,
# PD's streaming prefetcher) with
#   none      no host service (PD)
#   forced0   the service present, a forced planner that hosts nothing
#   makespan  the service present, the cost-model planner (makespan rule)
#             with a configured costly host (1 s per expert): every plan COPY
#   affoff    forced0 with --host-affinity off (the service's thread
#             placement not applied: does pinning the forward thread cost?)
# plus gputests: the hybrid GPU tests and tests/engine/test_host_idle.py
# (its GPU tests: the engine's per-verify ahead plan makes no
# torch.cuda.synchronize in a PD+host run; the timer's ready reads do not
# wait for the device). Compare
# forward_us, host.per_step_us.host_split and torch_calls_per_step.total
# against none (the CPU figures are in
# bench/results/cpu/hostidle-2026-12-02/README.md). Every result and the log
# are packed into ONE file, $OUT/hostidle_check.tar.gz. Expected: build
# ~30-60 s, each eager step ~15 s (10 steps), gputests ~40-60 s: about 3
# minutes.
#   OUT=/path bash bench/h200/hostidle_check.sh
# SMOKE=1: the same steps on this machine's CPU (tiny preset, 5 steps, no
# GPU tests; no build: the installed package runs).
set -uo pipefail
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
WORK=$(mktemp -d)
PY=${PYTHON:-python3}
COMMON="--arch gpt_oss --layers 4 --experts 16 --top-k 4 --cache-fraction 0.5 --requests 1 --tokens 16 --stream"
if [ "${SMOKE:-0}" = 1 ]; then
  ARGS="$COMMON --device cpu --steps 5 --count-steps 1"
  TESTS=""
  LIMIT=300
else
  ARGS="$COMMON --device cuda --preset gpt-oss-20b --steps 10 --count-steps 1"
  TESTS="gputests=timeout 100 $PY -P -m pytest -q -p no:cacheprovider tests/hybrid/test_hybrid_gpu.py tests/engine/test_host_idle.py"
  LIMIT=45
fi
EAGER="timeout $LIMIT $PY -P -m pdflash.bench.eager_host $ARGS"
steps=(
  "none=$EAGER"
  "forced0=$EAGER --host-every 0"
  "makespan=$EAGER --host-every 0 --host-planner makespan --host-expert-s 1.0"
  "affoff=$EAGER --host-every 0 --host-affinity off"
)
[ -n "$TESTS" ] && steps+=("$TESTS")
if [ "${SMOKE:-0}" = 1 ]; then
  # no build, no GPU: run.sh's step loop by hand
  for spec in "${steps[@]}"; do
    name=${spec%%=*}; cmd=${spec#*=}
    echo "== step $name: $cmd" >>"$WORK/log.txt"
    out=$(eval "$cmd" 2>>"$WORK/log.txt"); rc=$?
    printf '%s\n' "$out" >>"$WORK/log.txt"
    "$PY" -c 'import json,sys; t=sys.argv[3].strip(); print(json.dumps({"step": sys.argv[1], "rc": int(sys.argv[2]), "result": json.loads(t.splitlines()[-1]) if t else None}))' "$name" "$rc" "$out" >>"$WORK/results.jsonl"
  done
  tar czf "$OUT/hostidle_check.tar.gz" -C "$WORK" .
  rc=0
else
  PACK="$OUT/hostidle_check.tar.gz" OUT=$WORK bash "$(dirname "$0")/run.sh" "${steps[@]}"
  rc=$?
fi
"$PY" - "$WORK/results.jsonl" <<'PYEOF'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    d = r["result"] or {}
    host = d.get("host") or {}
    print(r["step"], "rc", r["rc"], "hosting_layers/step", (host.get("hosting_layers_per_step")), "forward_us", round(d.get("forward_us", float("nan"))),
          "host_split_us/step", round((host.get("per_step_us") or {}).get("host_split", 0.0), 1),
          "torch_calls/step", (d.get("torch_calls_per_step") or {}).get("total"))
PYEOF
ls -la "$OUT"
exit $rc
