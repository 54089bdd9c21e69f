#!/usr/bin/env bash
# Where a benchmark call's first run spends its setup (the rows' setup_s), in
# ONE device call of about 2 minutes wall (~30 s build, then two runs in one
# process: PD first, which pays the target's load, then PD+host, which reuses
# the target and pays the host service: format choice, preparation,
# calibration): gpt-oss-20b shape, 8 MoE layers, synthetic bf16 weights,
# cache 0.2, c=4, one repeat, 14 host threads, 1 worker, host format auto.
# Packs log.txt, results.jsonl, run/rows.jsonl + summary.json and setup.txt
# (each row's setup_s, largest phase first) into $OUT/setup_cost.tar.gz and
# prints setup.txt last.
# Usage (repository root): OUT=/path/to/out bash bench/h200/setup_cost.sh
# SMOKE=1: the same on the tiny CPU shape (a local check of the script).
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
work="$OUT/setup_cost"
export PDFLASH_CACHE=${PDFLASH_CACHE:-/tmp/pdflash-cache}
here=$(cd "$(dirname "$0")" && pwd)
arch=gpt-oss-20b layers=8 threads=14 hard=150
if [ "${SMOKE:-0}" = 1 ]; then
  arch=tiny-gpt_oss layers=0 threads=2
fi
py="python3 bench/h200/issue16.py --archs $arch --layers $layers --points 0.2:4 --repeats 1"
py="$py --max-new-tokens 24 --host-threads $threads --host-workers 1 --host-format auto"
py="$py --budget-s 120 --out \"$work/run\""
OUT="$work" bash "$here/run.sh" "run=timeout -k 5 $hard $py"
rc=$?
python3 - "$work/run/rows.jsonl" >"$work/setup.txt" 2>&1 <<'PY'
import json, sys

try:
    rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
except OSError as exc:
    print(f"no rows ({exc})")
    sys.exit(0)
for r in rows:
    s = r.get("setup_s") or {}
    print(f"{r['baseline']} (runs before: {r.get('process_runs_before')}): "
          f"before_clock {s.get('before_clock', float('nan')):.2f} s, wall {r.get('wall_s', 0):.2f} s")
    for k, v in sorted(s.items(), key=lambda kv: -kv[1]):
        if k != "before_clock":
            print(f"  {k:<44} {v:8.3f}")
PY
tar czf "$OUT/setup_cost.tar.gz" -C "$OUT" setup_cost && rm -rf "$work"
tar xzf "$OUT/setup_cost.tar.gz" -O setup_cost/setup.txt 2>/dev/null
exit $rc
