#!/usr/bin/env bash
# Issue 18's multi-GPU benchmark (expert-parallel offload), in run.sh's step
# style (one JSON result per step in $OUT/results.jsonl, the log in
# $OUT/log.txt; engine steps also append each finished run to
# $OUT/<step>/rows.jsonl, so a step cut by its timeout keeps its rows).
# Needs a multi-GPU kind (nvidia-h200-x2, or -x4 with GPUS="1 2 4"). One
# shape per device call (build ~30 s, smoke <= 90 s, then REPEATS (2)
# rounds of one engine step per GPU count, <= T=150 s each; a call cut by
# its limit keeps the steps that finished):
#   bash bench/h200/issue18.sh                                   # gpt-oss-20b
#   SMOKE=0 ARCHS=qwen3-30b-a3b bash bench/h200/issue18.sh       # Qwen3-30B-A3B
# Steps, most important first:
#  smoke_nccl   tiny model, 2 ranks over NCCL: the path works on the GPUs
#  <arch>_g<N>  PD (BASELINES, default PD; e.g. BASELINES=PD,PD+host adds
#               the hybrid miss service, each rank's host service on its own
#               share of the host's cores) at cache 0.2 per GPU, c = 4, 16, 32, 8 layers, N GPUs
#               (N = 1 is the baseline of the same build): rows carry gpus,
#               ranks[] (each rank's link_busy_s, h2d_bytes, all_to_all_s,
#               host_packed_bytes: each rank packs only its own experts),
#               aggregate_link_gbps and all_to_all_share
#               (step <arch>_g<N>_r<R>: round R, its seed R; rows of every
#               round append to <arch>_g<N>/rows.jsonl)
#  scale_*      the SIMULATED scaling of this run's 1-GPU rows (pdflash-bench
#               scale), to set beside the measured N-GPU rows
#  pairs        bench/h200/issue18_pairs.py: N GPUs over 1 per baseline and concurrency,
#               one ratio per round (the interleaved pairs), their median
#               and interval, g1's exposed fetch share (link-bound or not)
# Target (issue 18): >= 1.8x tokens/s on 2 GPUs where the 1-GPU run is
# link-bound (compare each c's g2 row with its g1 row: output_tokens_per_s,
# exposed_fetch_s / wall_s of g1; aggregate_link_gbps, all_to_all_share of g2).
# On CPU (gloo, tiny shapes, emulated link) the same commands run with
#   DEVICE=cpu ARCHS="tiny-gpt_oss tiny-qwen3_moe" LAYERS=2 CONC=2,4 \
#   EXTRA="--emulated-link-gbps 0.5 --max-new-tokens 8" T=120 bash bench/h200/issue18.sh
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$PWD/out}
export OUT
DEVICE=${DEVICE:-auto}
ARCHS=${ARCHS:-gpt-oss-20b}
SMOKE=${SMOKE:-1}
GPUS=${GPUS:-"1 2"}
LAYERS=${LAYERS:-8}
CONC=${CONC:-4,16,32}
T=${T:-150}
REPEATS=${REPEATS:-2}
EXTRA=${EXTRA:-}
BASELINES=${BASELINES:-PD}
ENG="pdflash-bench engine --json --device $DEVICE --layers $LAYERS --prompt-len 32 --max-new-tokens 32 --baselines $BASELINES --cache-fraction 0.2 $EXTRA"
steps=()
if [ "$SMOKE" = 1 ]; then
  steps+=("smoke_nccl=timeout 90 pdflash-bench engine --json --device $DEVICE --arch tiny --baselines PD --concurrency 4 --gpus 2 --max-new-tokens 8 --out $OUT/smoke_nccl")
fi
rounds=()
for r in $(seq 1 "$REPEATS"); do rounds+=("$r"); done
for arch in $ARCHS; do
  tag=${arch//[-.]/_}
  for r in "${rounds[@]}"; do
    # each round runs every GPU count once, the order reversed every other
    # round: interleaved repeats, so drift on the machine spreads over both sides
    order=$GPUS
    if [ $((r % 2)) = 0 ]; then order=$(echo "$GPUS" | tr ' ' '\n' | tac | tr '\n' ' '); fi
    for n in $order; do
      steps+=("${tag}_g${n}_r$r=timeout $T $ENG --arch $arch --concurrency $CONC --gpus $n --seed $r --out $OUT/${tag}_g$n")
    done
  done
  steps+=("scale_$tag=pdflash-bench scale --json $OUT/${tag}_g1/rows.jsonl --gpus 1,2,4 --out $OUT/scale_$tag")
done
steps+=("pairs=python3 $HERE/issue18_pairs.py $OUT --json")
exec bash "$HERE/run.sh" "${steps[@]}"
