#!/usr/bin/env bash
# One H200 call (<= ~5 minutes with the build, 7 with PIECEWISE=1) for the CUDA graphs of the verify
# forward (issue 13, pdflash.engine.graphs): the graph runner's GPU tests,
# then B3 at c=16, 8 layers, gpt-oss-20b and Qwen3-30B-A3B shapes, graphs off
# and auto interleaved in one process per arch (2 repeats each), with the
# verify breakdown; each step under a hard timeout (engine steps write rows
# as runs finish, so a cut step keeps what it ran). The first run of each arch
# on a fresh machine writes its synthetic checkpoint (~1 min). Everything
# under $OUT is packed into $OUT/graphs_check.tgz after every step.
#   OUT=/path bash bench/h200/graphs_check.sh
# Steps:
#   gputests   pytest -m gpu tests/engine/test_graphs_gpu.py (capture/replay vs
#              eager: fp32 tokens and logits, bf16 tolerance, bucket changes,
#              the engine's greedy tokens with graphs on/off, fallbacks)
#   b3_gptoss / b3_qwen3   rows with cuda_graphs (captures, replays, eager
#              fallbacks, capture errors; captures_in_run: recordings inside
#              the measured run, 0 where the warm-up's pre-capture covered
#              it) and verify_breakdown_ms (graphed_ms is the replayed layers
#              as one region); warmup.graphs: the pre-capture's report
#              (buckets, prepared, skipped, bytes, seconds)
#   host       $OUT/graph_host.json: this host's CPU time per part of a
#              replayed verify step (python -m pdflash.bench.graph_host:
#              plan, checks, buffer fill, cache books, finish; a no-op replay,
#              tiny gpt-oss shape, 8 layers, 16 x 16 tokens; ~15 s)
#   summary    $OUT/graphs_summary.json: per arch, expert format, baseline and
#              setting, the mean verify ms, its parts, drafter ms per verify,
#              tok/s, the verify roofline (hbm_roofline_ms,
#              verify_over_roofline, bytes by part), captures and
#              first-replay checks inside the runs, graphs pre-captured
#   b1_qwen3   only with PIECEWISE=1 (adds up to 130 s): B1 at cache 0.8, c=16,
#              Qwen3-30B-A3B shape, graphs off/auto/piecewise once each (piecewise
#              steps: attention and router replayed, experts eager)
# If captures fail inside cuDNN's attention (capture_errors in the rows), rerun
# with PDFLASH_SDPA_BACKENDS=efficient,math in the environment (both sides).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$PWD/out}
export OUT
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
ENG="pdflash-bench engine --json --layers 8 --max-new-tokens 32 --prompt-len 32 --baselines B3 --concurrency 16 --breakdown --cuda-graphs off,auto --repeats 2"
EXTRA=()
if [ "${PIECEWISE:-0}" = 1 ]; then
  EXTRA+=("b1_qwen3=timeout 130 pdflash-bench engine --json --layers 8 --max-new-tokens 32 --prompt-len 32 --baselines B1 --cache-fraction 0.8 --concurrency 16 --breakdown --cuda-graphs off,auto,piecewise --arch qwen3-30b-a3b --out $OUT/b1_qwen3")
fi
PACK=$OUT/graphs_check.tgz exec bash "$HERE/run.sh" \
  "gputests=timeout 120 python3 -P -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_graphs_gpu.py -rs --timeout 90" \
  "b3_gptoss=timeout 170 $ENG --arch gpt-oss-20b --out $OUT/b3_gptoss" \
  "b3_qwen3=timeout 140 $ENG --arch qwen3-30b-a3b --out $OUT/b3_qwen3" \
  "host=timeout 60 python3 -P -m pdflash.bench.graph_host --steps 300 > $OUT/graph_host.json" \
  ${EXTRA[@]+"${EXTRA[@]}"} \
  "summary=python3 $HERE/graphs_summary.py $OUT/b3_gptoss $OUT/b3_qwen3 $OUT/b1_qwen3 --out $OUT/graphs_summary.json"
