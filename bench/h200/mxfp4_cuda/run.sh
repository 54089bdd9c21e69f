#!/usr/bin/env bash
# Issue 13 probe: the hand-written CUDA MXFP4 grouped GEMM
# (the library's cuda/src/mxfp4_moe_gemm.cu, built alone) vs the Triton grouped_qgemm (scaled)
# on gpt-oss-20b's expert MLP at 16/64/256 tokens, plus correctness cases.
# Needs pdflash installed (pip install --no-build-isolation --no-deps .) and
# nvcc; builds the .cu itself (into /tmp/mxfp4_cuda). Run from the repo root:
#   OUT=/path bash bench/h200/mxfp4_cuda/run.sh [--variants v4,v8,v10]
# (the variants: probe.py's --variants / MXC_VARIANTS; default all)
# Writes $OUT/mxfp4_cuda.json (and $OUT/mxfp4_cuda.log); exit status: the
# probe's (0 all correctness cases pass, 1 a failure, 2 nvcc failed or an unknown variant).
set -uo pipefail
OUT=${OUT:-/tmp/out}
export OUT
mkdir -p "$OUT"
cd "$(dirname "$0")/../../.." || exit 2
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/mxfp4_cuda.triton}
timeout -k 10 "${PROBE_TIMEOUT_S:-230}" python3 -P bench/h200/mxfp4_cuda/probe.py "$@" 2>&1 | tee "$OUT/mxfp4_cuda.log"
exit "${PIPESTATUS[0]}"
