#!/usr/bin/env bash
# One call (~8 minutes with the build; every step under its own timeout, 575 s in all) on the lent H200 that checks what
# issue15.sh's estimate assumes about the cheaper matrix (run.sh's step style:
# $OUT/results.jsonl, $OUT/log.txt, rows under $OUT/<step>/):
#   load_files / load_generated  gpt-oss-20b 24 layers, MXFP4 experts: the
#       synthetic target written as files and loaded, against generated
#       straight into the host store (each a fresh process; prints seconds)
#   warm_shared / warm_workload  gpt-oss-20b 8 layers, B1 and PD, c=4, cache
#       0.2, 48 new tokens, 3 interleaved repeats, --warmup shared against
#       --warmup workload (the summaries' elapsed_s and first_use: the first
#       repeat's verify ms over the later repeats'; rows' warmup field)
#   serve_probe  a HALF-size issue-15 serving run (gpt-oss-20b 24 layers, PD,
#       Poisson 2 req/s, 12 requests of 128-192 tokens, max_running 16, token
#       budget 64, M from the verify step, --warmup short: its shapes are cold,
#       so its wall_s is an upper bound): issue15_estimate.py assumes ~108 s
#       measured for 12 requests (217 s for the full 24) and ~43 s of
#       calibration; rc 124 (no row) means over 230 s in all
#   OUT=/path bash bench/h200/matrixcost_check.sh
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$PWD/out}
export OUT
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
LOAD='import json, sys, time, torch; t0 = time.perf_counter()
from pdflash.bench.engine_run import RunSpec, load_target, resolve_device, synthetic_paths
spec = RunSpec(arch="gpt-oss-20b", baseline="B1", synthetic_format="mxfp4", synthetic_weights=sys.argv[1])
dev = resolve_device("auto"); path, _, dtype = synthetic_paths(spec, dev); t1 = time.perf_counter()
ad = load_target(path, dev, dtype); torch.cuda.synchronize(); t2 = time.perf_counter()
print(json.dumps({"synthetic_weights": sys.argv[1], "write_s": round(t1 - t0, 1), "load_s": round(t2 - t1, 1),
                  "store_gb": round(ad.store.total_nbytes / 1e9, 2)}))'
M="pdflash-bench matrix --arch gpt-oss-20b --synthetic-format mxfp4 --layers 8 --baselines B1,PD"
M+=" --concurrency 4 --cache-fraction 0.2 --max-new-tokens 48 --prompt-len 64 --repeats 3"
M+=" --no-progress --json --no-report"
S="pdflash-bench matrix --arch gpt-oss-20b --synthetic-format mxfp4 --baselines PD --repeats 1"
S+=" --arrivals poisson --rate 2 --num-requests 12 --prompt-len 64 --prompt-len-max 256"
S+=" --max-new-tokens 128 --max-new-tokens-max 192 --max-running 16 --token-budget 64"
S+=" --byte-budget-from verify --concurrency 16 --cache-fraction 0.2 --slo 30"
S+=" --warmup short --no-progress --json --no-report"
exec bash "$HERE/run.sh" \
  "load_files=timeout 90 python3 -c '$LOAD' files" \
  "load_generated=timeout 45 python3 -c '$LOAD' generated" \
  "warm_shared=timeout 90 $M --warmup shared --out $OUT/warm_shared" \
  "warm_workload=timeout 90 $M --warmup workload --out $OUT/warm_workload" \
  "serve_probe=timeout 230 $S --out $OUT/serve_probe"
