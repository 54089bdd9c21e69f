#!/usr/bin/env bash
# Issue 13: the MXFP4 dot in the engine, one process per arm per repeat (the
# dot is chosen once per process, from the environment), the arms' order
# rotated each repeat, until BUDGET_S; rows go to $OUT/<arm>/rows.jsonl (each
# row's compressed_gemm_reason names the dot that ran), then a table pairing
# every arm with the first by repeat (seed) at each point.
# ARMS: space-separated NAME=ENV=VALUE[:ENV=VALUE...] (default: the CUDA
# kernel as the library picks it, the CUDA kernel with its mma.sync path at
# block_m 64, Triton's tl.dot_scaled):
#   "cuda=PDFLASH_FUSED_MXFP4_DOT=cuda
#    cudamma=PDFLASH_FUSED_MXFP4_DOT=cuda:PDFLASH_MXFP4_CUDA_BM64=mma
#    scaled=PDFLASH_FUSED_MXFP4_DOT=scaled"
# Defaults: gpt-oss-20b shape, 8 MoE layers, synthetic MXFP4 experts, B3
# (every expert resident: the verify's expert GEMMs are exposed) and PD at
# cache 0.2, c=16, 3 x c requests of 64 new tokens, CUDA graphs auto,
# REPEATS (3) runs a process (one model load for all of them; pairs are
# matched by process round and run).
#   OUT=/path bash bench/h200/mxfp4dot_engine_ab.sh
# BUDGET_S (default 300), ARCH, LAYERS, POINTS ("B3:1.0 PD:0.2": baseline:cache),
# CONC (16), MAX_NEW (64), REPEATS (3), DEVICE (auto), BREAKDOWN (1: add
# --breakdown, verify_breakdown_ms) override; ARCH=tiny-gpt_oss LAYERS=0
# DEVICE=cpu is a CPU dry run (the dot applies on CUDA only; there every
# process runs dequant).
set -uo pipefail
OUT=${OUT:-$PWD/out}
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
budget=${BUDGET_S:-300}
arch=${ARCH:-gpt-oss-20b} layers=${LAYERS:-8} conc=${CONC:-16} device=${DEVICE:-auto}
points=${POINTS:-B3:1.0 PD:0.2}
max_new=${MAX_NEW:-64} repeats=${REPEATS:-3}
breakdown=()
[ "${BREAKDOWN:-0}" = 1 ] && breakdown=(--breakdown)
arms=${ARMS:-cuda=PDFLASH_FUSED_MXFP4_DOT=cuda cudamma=PDFLASH_FUSED_MXFP4_DOT=cuda:PDFLASH_MXFP4_CUDA_BM64=mma scaled=PDFLASH_FUSED_MXFP4_DOT=scaled}
read -r -a arm_list <<< "$arms"
names=()
for arm in "${arm_list[@]}"; do
  name=${arm%%=*}
  if [ -z "$name" ] || [ "$name" = "$arm" ]; then
    echo "bad arm '$arm': want NAME=ENV=VALUE[:ENV=VALUE...]" >&2
    exit 2
  fi
  names+=("$name")
done
layer_arg=()
[ "$layers" != 0 ] && layer_arg=(--layers "$layers")
start=$(date +%s)
repeat=0
n=${#arm_list[@]}
while :; do
  for ((i = 0; i < n; i++)); do
    arm=${arm_list[$(((i + repeat) % n))]}
    name=${arm%%=*}
    IFS=: read -r -a envs <<< "${arm#*=}"
    for point in $points; do
      base=${point%%:*} cache=${point##*:}
      left=$((budget - ($(date +%s) - start)))
      [ "$left" -le 20 ] && break 3
      mkdir -p "$OUT/$name"
      env "${envs[@]}" timeout -k 5 "$left" pdflash-bench engine --json \
        --arch "$arch" "${layer_arg[@]}" --synthetic-format mxfp4 --baselines "$base" \
        --cache-fraction "$cache" --concurrency "$conc" --num-requests $((3 * conc)) \
        --max-new-tokens "$max_new" --prompt-len 32 --cuda-graphs auto --repeats "$repeats" \
        --device "$device" "${breakdown[@]}" --seed "$repeat" --out "$OUT/$name" \
        > "$OUT/$name/last.json" 2> "$OUT/$name/last.err"
      echo "== repeat $repeat $name $base cache $cache rc=$? ($(( $(date +%s) - start )) s)"
    done
  done
  repeat=$((repeat + 1))
done
python3 - "$OUT" "${names[@]}" <<'PY'
import json, statistics, sys
from pathlib import Path

out, names = Path(sys.argv[1]), sys.argv[2:]
rows = {}
for name in names:
    path = out / name / "rows.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        r = json.loads(line)
        key = (r["baseline"], r["cache_fraction"], r["concurrency"])
        rows.setdefault(key, {}).setdefault((r["seed"], r.get("repeat")), {})[name] = r
first = names[0]
for (base, cache, conc), by_seed in sorted(rows.items()):
    print(f"{base} cache {cache} c={conc}")
    for name in names[1:]:
        ratios = [
            pair[first]["output_tokens_per_s"] / pair[name]["output_tokens_per_s"]
            for _, pair in sorted(by_seed.items())
            if first in pair and name in pair
        ]
        if ratios:
            print(f"  {first}/{name} tokens/s per run {', '.join(f'{r:.3f}' for r in ratios)} "
                  f"(median {statistics.median(ratios):.3f}, n {len(ratios)})")
    for (seed, run), pair in sorted(by_seed.items()):
        for name in names:
            r = pair.get(name)
            if r is None:
                continue
            bd = r.get("verify_breakdown_ms") or {}
            print(f"  round {seed} run {run} {name}: {r['output_tokens_per_s']:.1f} tok/s, "
                  f"{r.get('steps')} steps, verify x roofline {r.get('verify_over_roofline')}, "
                  f"{r.get('compressed_gemm')} ({r.get('compressed_gemm_reason')})"
                  + (f"; verify ms {json.dumps(bd)[:160]}" if bd else ""))
PY
