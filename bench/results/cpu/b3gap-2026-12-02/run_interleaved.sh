#!/bin/bash
# The interleaved before/after runs of this folder's README, from the
# repository root: before = the package installed into $BEFORE (e.g.
# `pip install --no-build-isolation --no-deps --target $BEFORE <main checkout>`),
# put first on PYTHONPATH; after = the package installed in the venv ($PY).
# Writes b_*_N.json (before) and a_*_N.json (after) into $DEST.
set -euo pipefail
PY=${PY:-python}
BEFORE=${BEFORE:?the folder main was installed into}
DEST=${DEST:-.}
G=bench/graph_host.py
for i in 1 2 3; do
  PYTHONPATH=$BEFORE $PY -P $G --steps 300 > "$DEST/b_gpt_$i.json"
  $PY -P $G --steps 300 > "$DEST/a_gpt_$i.json"
  PYTHONPATH=$BEFORE $PY -P $G --arch qwen3_moe --layers 48 --steps 200 > "$DEST/b_qwen_$i.json"
  $PY -P $G --arch qwen3_moe --layers 48 --steps 200 > "$DEST/a_qwen_$i.json"
done
