#!/usr/bin/env bash
# Install this checkout of pdflash on the lent machine, unless SKIP_BUILD=1
# and this machine last built this very tree (a marker in /tmp holds the hash
# of the tree's sources, not the recorded results); on a fresh machine, or
# after the tree changed, it builds anyway and says why. Exit status: the
# install's (0 when skipped). Used by run.sh and mxfp4_sweep.sh:
#   bash bench/h200/build_tree.sh [REPO]
# PDFLASH_BUILT_MARK moves the marker (tests).
set -uo pipefail
REPO=${1:-$PWD}
built_mark=${PDFLASH_BUILT_MARK:-/tmp/pdflash-built-tree}
tree=$(cd "$REPO" && find pdflash pdflash_native cuda bench cmake CMakeLists.txt pyproject.toml \
    \( -path bench/results -o -name __pycache__ \) -prune -o -type f -not -name '*.pyc' \
    -print 2>/dev/null | LC_ALL=C sort \
    | xargs -d '\n' sha256sum | sha256sum | cut -c1-16)
if [ "${SKIP_BUILD:-0}" = 1 ] && [ "$(cat "$built_mark" 2>/dev/null)" = "$tree" ]; then
  echo "== build skipped (SKIP_BUILD=1: this machine built this tree, $tree)"
  exit 0
fi
if [ "${SKIP_BUILD:-0}" = 1 ]; then
  echo "== SKIP_BUILD=1, but this machine has not built this tree ($tree): building"
fi
t0=$(date +%s)
rm -f "$built_mark"
python3 -m pip install -q --no-build-isolation --no-deps "$REPO" 2>&1 | tail -20
rc=${PIPESTATUS[0]}
echo "== build rc=$rc in $(( $(date +%s) - t0 )) s"
if [ "$rc" = 0 ]; then echo "$tree" >"$built_mark"; fi
exit "$rc"
