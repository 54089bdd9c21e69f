# shellcheck shell=bash
# Sourced (`. "$(dirname "$0")/trace_args.sh"`) by the bench/h200 scripts
# that replay the trained proxy's temperature-1 trace (routing and
# acceptance, tau ~1.2-1.7; its 128 experts map 4:1 onto gpt-oss-20b's 32) on
# a published shape with synthetic weights: trace_baselines.sh, width.sh,
# eager_check.sh and eager_profile.sh. It owns the trace and the replay's
# `pdflash-bench matrix` arguments; TRACE=path replays another trace.
TRACE=${TRACE:-bench/results/h200/proxy-balanced-2026-12-01/trace_gpu_t1.npz}

# trace_matrix_args ARCH CONCURRENCY CACHE_FRACTION MAX_NEW REPEATS BUDGET_S:
# the matrix arguments of the replay (8 MoE layers, synthetic weights and
# drafter, block 16, prompt 64, CUDA, JSON rows, no progress bars, no new run
# after BUDGET_S); the caller adds its labels, widths and --out.
trace_matrix_args() {
  local arch=$1 concurrency=$2 cache_fraction=$3 max_new=$4 repeats=$5 budget_s=$6
  echo "--arch $arch --layers 8 --weights synthetic --draft synthetic" \
    "--routing-source trace --acceptance trace --trace $TRACE --block-sizes 16" \
    "--concurrency $concurrency --cache-fraction $cache_fraction --prompt-len 64" \
    "--max-new-tokens $max_new --repeats $repeats --device cuda --no-progress --json" \
    "--budget-s $budget_s"
}
