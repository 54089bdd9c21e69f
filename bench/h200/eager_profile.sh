#!/usr/bin/env bash
# Where an EAGER offloaded verify step's time goes on the H200 at c=1 (the
# session-7 verify-width rows: ~55-70 ms of compute-stream time per step for
# a 2-token verify through 8 offloaded layers, vs ~7.5 ms for B3's graphed
# 256-token verify). Steps (bench/h200/run.sh style, one process each):
#   host_*   python -m pdflash.bench.eager_host on CUDA: each host part of an
#            eager offloaded verify (router + read-back, cache books, waits,
#            grouped GEMM dispatch, attention, the gate lookahead, glue) at a
#            tiny gpt-oss / qwen3 shape (so the device work is negligible and
#            the parts are launches, syncs and Python), 8 layers, cache 0.2,
#            c = 1 and 16, 2 and 16 tokens per request, routing replayed from
#            the proxy trace; once with every expert padded to gpt-oss-20b's
#            49.8 MB (copies, slots and waits at the real size: where the
#            host blocks on copies shows in waits / books / lookahead); each
#            also counts one step's host syncs (torch's sync debug mode);
#   profile  bench/h200/profile_verify.py on B2 (verify width fixed:1) and PD
#            (adaptive width) at the width rows' exact workload (gpt-oss-20b
#            shape, 8 layers, cache 0.2, c=1, routing and acceptance replayed
#            from the proxy's T=1 trace, prompt 64, 32 new tokens, CUDA
#            graphs off): op tables by self CUDA / CPU time and call count,
#            each run's unprofiled row (warm_row: compute_busy_s, verify_s,
#            exposed_fetch_s, ...) and gzipped timelines (Perfetto) where the
#            compute stream's idle gaps between kernels show.
# Every result, log, table and timeline is packed into ONE file, $OUT/eager_profile.tar.gz
# (the device tool returns at most 8 files).
# Expected: build ~30-60 s, gputests ~15 s, host steps ~10 s each (the
# padded one ~30 s: a 12.7 GB host store), profile ~90-120 s (two engine
# runs per baseline, the first with the model's setup): about 4 minutes.
#   OUT=/path bash bench/h200/eager_profile.sh
set -uo pipefail
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
# the steps write under WORK; run.sh packs it into ONE file in $OUT after each step
WORK=$(mktemp -d)
. "$(dirname "$0")/trace_args.sh"
HOST="python3 -P -m pdflash.bench.eager_host --device cuda --layers 8 --cache-fraction 0.2 --steps 30 --trace $TRACE"
RUN="arch=gpt-oss-20b,layers=8,weights=synthetic,draft=synthetic,routing_source=trace,acceptance=trace,trace=$TRACE,block_size=16,concurrency=1,cache_fraction=0.2,prompt_len=64,max_new_tokens=32,device=cuda,cuda_graphs=off"
PACK="$OUT/eager_profile.tar.gz" OUT=$WORK bash "$(dirname "$0")/run.sh" \
  "gputests=timeout 120 python3 -P -m pytest -q -p no:cacheprovider tests/models/test_routed_readback_gpu.py" \
  "host_gptoss_c1_t2=timeout 60 $HOST --arch gpt_oss --requests 1 --tokens 2 --detail" \
  "host_gptoss_c1_t2_padded=timeout 120 $HOST --arch gpt_oss --requests 1 --tokens 2 --detail --expert-bytes-as gpt-oss-20b" \
  "host_gptoss_c16_t2=timeout 60 $HOST --arch gpt_oss --requests 16 --tokens 2" \
  "host_gptoss_c16_t16=timeout 60 $HOST --arch gpt_oss --requests 16 --tokens 16" \
  "host_qwen3_c1_t2=timeout 60 $HOST --arch qwen3_moe --requests 1 --tokens 2 --detail" \
  "profile=timeout 200 python3 -P bench/h200/profile_verify.py --out $WORK/profile.json --chrome-dir $WORK/timelines --run baseline=B2,verify_width=fixed:1,$RUN --run baseline=PD,verify_width=adaptive,$RUN"
rc=$?
ls -la "$OUT"
exit $rc
