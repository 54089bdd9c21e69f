#!/usr/bin/env bash
# Build pdflash on the lent H200 machine and run named steps, each a command
# line; results go to $OUT/results.jsonl (one {"step", "cmd", "rc", "result"}
# per step) and the whole log to $OUT/log.txt. Usage:
#   bash bench/h200/run.sh 'gputests=pytest -m gpu -q $(grep -rl pytest.mark.gpu tests)' 'h2d=pdflash-bench h2d --json'
# (the gpu tests' modules only: the image lacks some test extras, e.g. openai)
# SKIP_BUILD=1: skip the install where this machine last built this very
# tree (bench/h200/build_tree.sh: a marker in /tmp holds the hash of the
# tree's sources); on a fresh machine, or after the tree changed, it builds
# anyway and says why.
# PACK=/path/name.tgz: after the build and after every step, everything under
# $OUT (log, results, what the steps wrote there) is packed into that one
# file (the device tool returns only a few files, and a call cut by its
# limit still returns the steps that finished). PACK may lie directly in
# $OUT (it is left out of itself) or anywhere outside it.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
REPO=$PWD
LOG="$OUT/log.txt"
PACK=${PACK:-}
pack() {
  [ -n "$PACK" ] || return 0
  local tmp
  tmp=$(mktemp "${TMPDIR:-/tmp}/pack.XXXXXX")
  tar czf "$tmp" -C "$OUT" --exclude "./$(basename "$PACK")" . && chmod a+r "$tmp" && mv "$tmp" "$PACK"
}
{
  echo "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader 2>&1)"
  python3 -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, torch.version.cuda)'
  bash "$(dirname "$0")/build_tree.sh" "$REPO"
} >>"$LOG" 2>&1
pack
for spec in "$@"; do
  name=${spec%%=*}; cmd=${spec#*=}
  echo "== step $name: $cmd" >>"$LOG"
  t0=$(date +%s)
  ( cd "$REPO" && eval "$cmd" ) >"$OUT/.stdout" 2>>"$LOG"
  rc=$?
  cat "$OUT/.stdout" >>"$LOG"
  echo "== step $name rc=$rc in $(( $(date +%s) - t0 )) s" >>"$LOG"
  python3 - "$name" "$cmd" "$rc" "$OUT/.stdout" >>"$OUT/results.jsonl" <<'PY'
import json, sys
name, cmd, rc, path = sys.argv[1:5]
text = open(path).read().strip()
try:
    result = json.loads(text.splitlines()[-1]) if text else None
except (ValueError, IndexError):
    result = None
print(json.dumps({"step": name, "cmd": cmd, "rc": int(rc), "result": result}))
PY
  rm -f "$OUT/.stdout"
  pack
done
tail -c 6000 "$LOG"
