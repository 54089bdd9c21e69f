#!/usr/bin/env bash
# Time host weight preparation in fresh processes with the INSTALLED pdflash:
#   bench/results/cpu/prepfast-2026-12-02/measure.sh PYTHON OUT.jsonl [REPS]
# rows: every format's digest at the tiny shape, native and auto timed at
# the tiny shape and at gpt-oss-20b (2 layers x 16 experts), REPS each.
set -euo pipefail
py=$1 out=$2 reps=${3:-3}
here=$(dirname "$0")
ck=${PREPFAST_CKPT:-/tmp/prepfast-ckpt}
for fmt in out_in onednn native fp32_out_in fp32_in_out; do
  "$py" -P "$here/../../../h200/prep_time.py" --dir "$ck" --preset tiny --layers 2 --experts 8 --fmt "$fmt" --digest >>"$out"
done
for r in $(seq "$reps"); do
  for fmt in native auto; do
    "$py" -P "$here/../../../h200/prep_time.py" --dir "$ck" --preset tiny --layers 2 --experts 8 --fmt "$fmt" --digest >>"$out"
    "$py" -P "$here/../../../h200/prep_time.py" --dir "$ck" --preset gpt-oss-20b --layers 2 --experts 16 --fmt "$fmt" --digest >>"$out"
  done
done
