#!/usr/bin/env bash
# Issue 13: the MXFP4 dot in the engine, CUDA kernel vs Triton tl.dot_scaled
# (PDFLASH_FUSED_MXFP4_DOT=cuda|scaled). The dot is chosen once per process,
# so each repeat runs one engine process per dot, the order alternating, until
# BUDGET_S; rows go to $OUT/<dot>/rows.jsonl (each row's compressed_gemm_reason
# names the dot that ran), then a pair table (bench/pair_ratios.py keys arms
# by the row's `arm`, so the summary below pairs by repeat itself).
# Defaults: gpt-oss-20b shape, 8 MoE layers, synthetic MXFP4 experts, B3
# (every expert resident: the verify's expert GEMMs are exposed) and PD at
# cache 0.2, c=16, 32 new tokens, --breakdown (verify_breakdown_ms).
#   OUT=/path bash bench/h200/mxfp4dot_engine_ab.sh
# BUDGET_S (default 300), ARCH, LAYERS, POINTS ("B3:1.0 PD:0.2": baseline:cache),
# CONC (16), DEVICE (auto) override; ARCH=tiny-gpt_oss LAYERS=0 DEVICE=cpu is a
# CPU dry run (the dot applies on CUDA only; there both processes run dequant).
set -uo pipefail
OUT=${OUT:-$PWD/out}
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
budget=${BUDGET_S:-300}
arch=${ARCH:-gpt-oss-20b} layers=${LAYERS:-8} conc=${CONC:-16} device=${DEVICE:-auto}
points=${POINTS:-B3:1.0 PD:0.2}
layer_arg=()
[ "$layers" != 0 ] && layer_arg=(--layers "$layers")
start=$(date +%s)
repeat=0
while :; do
  if [ $((repeat % 2)) = 0 ]; then order="cuda scaled"; else order="scaled cuda"; fi
  for dot in $order; do
    for point in $points; do
      base=${point%%:*} cache=${point##*:}
      left=$((budget - ($(date +%s) - start)))
      [ "$left" -le 20 ] && break 3
      mkdir -p "$OUT/$dot"
      PDFLASH_FUSED_MXFP4_DOT=$dot timeout -k 5 "$left" pdflash-bench engine --json \
        --arch "$arch" "${layer_arg[@]}" --synthetic-format mxfp4 --baselines "$base" \
        --cache-fraction "$cache" --concurrency "$conc" --max-new-tokens 32 --prompt-len 32 \
        --device "$device" --breakdown --seed "$repeat" --out "$OUT/$dot" \
        > "$OUT/$dot/last.json" 2> "$OUT/$dot/last.err"
      echo "== repeat $repeat $dot $base cache $cache rc=$? ($(( $(date +%s) - start )) s)"
    done
  done
  repeat=$((repeat + 1))
done
python3 - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path

out = Path(sys.argv[1])
rows = {}
for dot in ("cuda", "scaled"):
    path = out / dot / "rows.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        r = json.loads(line)
        key = (r["baseline"], r["cache_fraction"], r["concurrency"], r["seed"])
        rows.setdefault(key, {})[dot] = r
by_point = {}
for (base, cache, conc, seed), pair in sorted(rows.items()):
    if len(pair) == 2:
        ratio = pair["cuda"]["output_tokens_per_s"] / pair["scaled"]["output_tokens_per_s"]
        by_point.setdefault((base, cache, conc), []).append((seed, ratio, pair))
for (base, cache, conc), got in by_point.items():
    ratios = [r for _, r, _ in got]
    print(f"{base} cache {cache} c={conc}: cuda/scaled tokens/s per repeat "
          f"{', '.join(f'{r:.3f}' for r in ratios)} (median {statistics.median(ratios):.3f}, n {len(ratios)})")
    for seed, _, pair in got:
        for dot in ("cuda", "scaled"):
            r = pair[dot]
            bd = r.get("verify_breakdown_ms") or {}
            print(f"  seed {seed} {dot}: {r['output_tokens_per_s']:.1f} tok/s, "
                  f"{r.get('compressed_gemm')} ({r.get('compressed_gemm_reason')}); "
                  f"verify ms {json.dumps(bd)[:160]}")
PY
