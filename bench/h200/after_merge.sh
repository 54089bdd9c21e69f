#!/usr/bin/env bash
# One H200 call (<= ~9 minutes with the build) after merging the step split
# (issue 11), the verify-path speed-ups (issue 13), the host executor formats
# (issue 16) and the PD controller: the GPU tests, then the most important
# point of each issue's own script, most important first, each step under a
# hard timeout (engine steps write rows as runs finish, so a cut step keeps
# what it ran). Everything under $OUT is packed into $OUT/after_merge.tgz at
# the end of every step (the device tool returns a few files per call).
#   OUT=/path bash bench/h200/after_merge.sh
# Steps:
#   gputests   pytest -m gpu (CUDA issuer, engine, models, MXFP4, hybrid, attention)
#   b3_gptoss / b3_qwen3   B3 at c=16, 8 layers: verify_breakdown_ms (issue 13)
#   host_gptoss  the executor diagnostic, then PD vs PD+host, gpt-oss-20b 8
#              layers, bf16 experts over the link, cache 0.2, c = 1, 4, 16 (issue 16)
#   pays_qwen  B1, B2, PD (controller), PD-all-on at the Qwen3 shape, 2 layers,
#              cache 0.8, c=16, 64 requests x 128 tokens (the PD controller)
#   link       PD from an MXFP4 checkpoint at cache 0.2, c = 4, 16: experts moved
#              as MXFP4 vs dequantized to bf16 (issue 13)
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$PWD/out}
export OUT
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
# the modules holding gpu tests: collecting the whole tree would need every
# test extra (openai for the server tests), which the image lacks
GPU_MODULES=$(cd "$HERE/../.." && grep -rl 'pytest.mark.gpu' tests --include='test_*.py' | sort | tr '\n' ' ')
ENG="pdflash-bench engine --json --layers 8 --max-new-tokens 32 --prompt-len 32"
HOST="python3 $HERE/issue16.py --cache 0.2 --repeats 3 --host-threads 14 --host-workers 1 --layers 8"
PAYS="pdflash-bench matrix --weights synthetic --draft synthetic --block-sizes 16 --concurrency 16 --num-requests 64 --max-new-tokens 128 --baselines B1,B2,PD,PD-all-on --repeats 3 --device cuda --no-progress --json"
PACK=$OUT/after_merge.tgz exec bash "$HERE/run.sh" \
  "gputests=timeout 90 python3 -P -m pytest -q -p no:cacheprovider -m gpu $GPU_MODULES -rs --timeout 60" \
  "b3_gptoss=timeout 55 $ENG --arch gpt-oss-20b --baselines B3 --concurrency 16 --breakdown --out $OUT/b3_gptoss" \
  "b3_qwen3=timeout 50 $ENG --arch qwen3-30b-a3b --baselines B3 --concurrency 16 --breakdown --out $OUT/b3_qwen3" \
  "host_gptoss=timeout -k 5 130 $HOST --archs gpt-oss-20b --concurrency 1,4,16 --diag --diag-experts 8 --budget-s 100 --out $OUT/host_gptoss" \
  "pays_qwen=timeout 95 $PAYS --arch qwen3-30b-a3b --layers 2 --cache-fraction 0.8 --budget-s 70 --out $OUT/pays_qwen" \
  "link=timeout 80 python3 $HERE/issue13b_link.py --out $OUT/link --budget-s 55 --arch gpt-oss-20b --layers 8"
