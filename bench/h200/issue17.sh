#!/usr/bin/env bash
# Issue 17 on the H200 (about 3 minutes after the build): pdflash's
# transformers integration vs accelerate's CPU offload at the same GPU memory
# budget for weights, on synthetic qwen3-30b-a3b and gpt-oss-20b shapes
# truncated to 4 layers (tokens/s, peak GPU memory, greedy equality; JSON in
# $OUT/issue17_offload.json), then a GPU smoke run of `pdflash generate`.
#   OUT=/path bash bench/h200/issue17.sh
set -uo pipefail
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
exec bash "$(dirname "$0")/run.sh" \
  'offload=python3 bench/h200/transformers_offload.py --archs qwen3_moe,gpt_oss --layers 4 --cache-fraction 0.2 --prompts 3 --prompt-len 64 --new-tokens 16' \
  'generate=pdflash synthetic --out /tmp/pdflash-issue17-tiny --dtype bfloat16 && pdflash generate --model /tmp/pdflash-issue17-tiny/target --draft /tmp/pdflash-issue17-tiny/draft --prompt "Hello" --max-tokens 32 --device cuda'
