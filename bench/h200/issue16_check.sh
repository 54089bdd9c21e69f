#!/usr/bin/env bash
# Issue 16's decisive points after the critical-path planner and the PD
# controller's host part, in ONE device call (about 4 minutes wall: ~30 s
# build, ~55 s for the first run (model load, host weights, format choice),
# then interleaved PD / PD+host repeats until --budget-s 160; the step is
# killed at 200 s whatever happens): gpt-oss-20b shape, 8 MoE layers,
# synthetic bf16 weights, forced acceptance, 24 new tokens, 14 host threads,
# 1 worker, planner defaults, the points
#   cache 0.5 c=1 (this morning PD+host 0.78x, "slower outside noise"),
#   cache 0.2 c=4 (1.45x) and cache 0.2 c=1 (1.58x),
# one process, repeat-major (PD and PD+host alternate which goes first).
# Everything (log.txt, results.jsonl, check/rows.jsonl + summary.json,
# table.txt) is packed into ONE file, $OUT/issue16_check.tar.gz, and the
# compact table is printed last: per point the median tokens/s of both, the
# median ratio and the verdict (95% t intervals), the host's share of the
# misses, the busy fractions, and per PD+host run median the planner's
# measured critical-path terms (hidden_s, host_overhead_s), its split layers
# and copy-sampled layers, and the share of steps the PD controller ran the
# host part (short runs: at 24 tokens the controller rarely finishes a probe
# at c=1, so these points judge the planner).
# Usage (repository root): OUT=/path/to/out bash bench/h200/issue16_check.sh
# SMOKE=1: the same on the tiny CPU shapes (a local check of the script).
# REPEATS / BUDGET_S / HARD_S (the step's kill time) / MAX_NEW / POINTS / EXTRA (more
# issue16.py options, e.g. --host-critical-path) override the defaults.
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
work="$OUT/issue16_check"
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
here=$(cd "$(dirname "$0")" && pwd)
arch=gpt-oss-20b layers=8 threads=${HOST_THREADS:-14} budget=${BUDGET_S:-160} hard=${HARD_S:-200}
points=${POINTS:-0.5:1,0.2:4,0.2:1}
if [ "${SMOKE:-0}" = 1 ]; then
  arch=tiny-gpt_oss layers=0 threads=${HOST_THREADS:-2} budget=${BUDGET_S:-60} hard=240
  points=${POINTS:-0.5:1,0.5:4}
fi
py="python3 bench/h200/issue16.py --archs $arch --layers $layers --points $points"
py="$py --repeats ${REPEATS:-8} --max-new-tokens ${MAX_NEW:-24} --host-threads $threads"
py="$py --host-workers 1 --host-format auto --budget-s $budget ${EXTRA:-} --out \"$work/check\""
OUT="$work" bash "$here/run.sh" "check=timeout -k 5 $hard $py"
rc=$?
python3 - "$work/check" >"$work/table.txt" 2>&1 <<'PY'
import json, statistics, sys
from pathlib import Path

d = Path(sys.argv[1])
try:
    summary = json.loads((d / "summary.json").read_text())
except (OSError, ValueError) as exc:
    print(f"no summary ({exc}); rows: {sum(1 for _ in open(d / 'rows.jsonl')) if (d / 'rows.jsonl').exists() else 0}")
    sys.exit(0)
runs = summary.get("host_runs", [])


def med(values):
    vals = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(vals) if vals else None


def fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


print(f"issue16 check: {summary.get('device')}, runs {summary.get('runs')}, "
      f"not started (budget) {summary.get('runs_not_started_budget')}, errors {len(summary.get('errors', []))}")
head = ("cache c  | PD tok/s (n) | PD+host (n) | ratio | verdict        | host share | "
        "PD+host busy c/l/h | PD busy c/l | hidden ms | overhead ms | split/layers | copy-sampled | host part on")
print(head)
for p in summary.get("points", []):
    tps = p.get("tokens_per_s", {})
    a, b = tps.get("PD", {}), tps.get("PD+host", {})
    ph, pd = p.get("pd_host", {}), p.get("pd", {})
    bf, pbf = ph.get("busy_fraction", {}), pd.get("busy_fraction", {})
    mine = [r for r in runs if r["cache_fraction"] == p["cache_fraction"] and r["concurrency"] == p["concurrency"]]
    cp = [r.get("critical_path") or {} for r in mine]
    dec = [r.get("planner_decisions") or {} for r in mine]
    split = med([x.get("split") for x in dec])
    layers = med([x.get("layers") for x in dec])
    print(
        f"{p['cache_fraction']:<5} {p['concurrency']:<2} | {fmt(a.get('median'), '.1f')} ({a.get('n', 0)}) "
        f"| {fmt(b.get('median'), '.1f')} ({b.get('n', 0)}) | {fmt(p.get('speedup_median'))}x "
        f"| {p.get('verdict', '-'):<14} | {fmt(ph.get('host_share_of_misses'))} "
        f"| {fmt(bf.get('compute'))}/{fmt(bf.get('link'))}/{fmt(bf.get('host_cpu'))} "
        f"| {fmt(pbf.get('compute'))}/{fmt(pbf.get('link'))} "
        f"| {fmt(med([1e3 * x['hidden_s'] for x in cp if 'hidden_s' in x]))} "
        f"| {fmt(med([1e3 * x['host_overhead_s'] for x in cp if 'host_overhead_s' in x]))} "
        f"| {fmt(split, '.0f')}/{fmt(layers, '.0f')} "
        f"| {fmt(med([r.get('copy_sampled') for r in mine]), '.0f')} "
        f"| {fmt(med([r.get('host_part_on_fraction') for r in mine]))}"
    )
PY
cat "$work/table.txt"
tar -czf "$OUT/issue16_check.tar.gz" -C "$OUT" issue16_check && rm -rf "$work"
ls -l "$OUT"
exit $rc
