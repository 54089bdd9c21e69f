#!/usr/bin/env bash
# Issue 13, after the one-launch RMSNorm became the default: on one lent GPU,
# in one call (about 6-7 minutes with the build), each step under a hard
# timeout:
#   gputests   every GPU test module's gpu-marked tests (the norm is on in all
#              of them now, bit-equality tests between pdflash paths included)
#   probe      the CUDA GEMM's policy variants v8 / v10: mxfp4_cuda/probe.py,
#              correctness then timing (session 59 ran it with two temporary
#              variants beside them: bench/h200/mxfp4_cuda/README.md)
# B3 against its roofline is the next call on the same machine:
#   SKIP_BUILD=1 MXFP4=1 OUT=/path bash bench/h200/roofline_check.sh
#   OUT=/path bash bench/h200/normdefault_check.sh
# Everything lands in ONE file, $OUT/normdefault_check.tgz.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=scratch_pack.sh
source "$HERE/scratch_pack.sh" normdefault_check.tgz
GPU_MODULES=$(grep -rl 'pytest.mark.gpu' tests | sort | tr '\n' ' ')
PROBE="env MXC_VARIANTS=v8,v10 MXC_TOKENS=64,256 MXC_CORR_BUDGET_S=40 MXC_BUDGET_S=140 OUT=$OUT/probe python3 -P $HERE/mxfp4_cuda/probe.py"
exec bash "$HERE/run.sh" \
  "gputests=timeout -k 5 240 python3 -P -m pytest -q -rs -p no:cacheprovider -m gpu $GPU_MODULES > $OUT/gputests.txt 2>&1; rc=\$?; tail -15 $OUT/gputests.txt; exit \$rc" \
  "probe=timeout -k 5 160 $PROBE > $OUT/probe.txt 2>&1; rc=\$?; tail -40 $OUT/probe.txt; exit \$rc"
