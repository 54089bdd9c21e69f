#!/usr/bin/env bash
# The lookahead branch on the H200: the eager offloaded verify step's parts
# with the router logits taken without the router's own routing (the
# branch) and through the router's whole forward (the old path, switched
# back for the run by replacing pdflash.models.adapters.base.router_logits_only
# with a function that declines), on the issue-14/16 command; plus the
# lookahead's GPU tests. Steps (bench/h200/run.sh style):
#   gputests   tests/routeahead/test_lookahead_host_gpu.py (bf16 logits and
#              predictions equal the old path's) and the route-ahead GPU test
#   old_pd     eager_host --stream (PD's streaming prefetcher: its routed
#              hook, gate lookahead and pump), old router path (gpt-oss-20b
#              preset, 4 layers, 16 experts top-4, cache 0.2, c=1 x 2 tokens)
#   new_pd     the same, the branch's path
#   new_b2     the branch, B1/B2's plain gate lookahead instead of the stream
# Compare parts_us.lookahead_router (and forward_us) and
# torch_calls_per_step.lookahead_router between old_pd and new_pd (CPU:
# 18 -> 16 torch calls per lookahead layer on gpt-oss); every other part's
# torch calls should be equal. new_pd vs new_b2: the stream's own parts
# (stream_routed, lookahead, stream_plan_us) vs the plain lookahead's.
# Every result and the log are packed into ONE file, $OUT/lookahead_check.tar.gz.
# Expected: build ~30-60 s, gputests ~15 s, each host step ~15 s (10
# steps): about 2 minutes.
#   OUT=/path bash bench/h200/lookahead_check.sh
set -uo pipefail
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
WORK=$(mktemp -d)
ARGS="--device cuda --cache-fraction 0.2 --arch gpt_oss --requests 1 --tokens 2 --preset gpt-oss-20b --layers 4 --experts 16 --top-k 4 --steps 10 --count-steps 1"
OLD="import sys; import pdflash.models.adapters.base as b; b.router_logits_only = lambda router, x: None; from pdflash.bench.eager_host import main; sys.exit(main())"
PACK="$OUT/lookahead_check.tar.gz" OUT=$WORK bash "$(dirname "$0")/run.sh" \
  "gputests=timeout 90 python3 -P -m pytest -q -p no:cacheprovider tests/routeahead/test_lookahead_host_gpu.py tests/routeahead/test_routeahead_gpu.py" \
  "old_pd=timeout 45 python3 -P -c '$OLD' $ARGS --stream" \
  "new_pd=timeout 45 python3 -P -m pdflash.bench.eager_host $ARGS --stream" \
  "new_b2=timeout 45 python3 -P -m pdflash.bench.eager_host $ARGS"
rc=$?
ls -la "$OUT"
exit $rc
