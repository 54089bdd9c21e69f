"""bench/h200/mxfp4_sweep.py (the fused MXFP4 expert MLP's variant x tile x
row-tile grid): its smoke mode runs under Triton's interpreter and checks
every point against the dequantized fp32 reference; ``--block-m`` adds row
tiles beside the library's pick and refuses what tl.dot cannot take. Skips
where triton is not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

_SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "h200" / "mxfp4_sweep.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run(
        [sys.executable, "-P", str(_SCRIPT), "--smoke", "--json", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def test_each_row_tile_equals_the_reference_under_the_interpreter() -> None:
    out = _run("--variants", "registers", "--block-m", "auto,32", "--tokens", "16,256")
    assert out.returncode == 0, out.stderr[-2000:]
    points = json.loads(out.stdout.strip().splitlines()[-1])["points"]
    assert all("error" not in p for p in points), [p for p in points if "error" in p]
    assert all(p["max_rel_err"] < 2e-2 for p in points)
    by_tokens = {
        t: {(p["block_m"], p["block_m_auto"]) for p in points if p["tokens"] == t}
        for t in (16, 256)
    }
    # the library's pick (16 at 16 tokens over 4 experts, 64 at 256) and the row tile asked for
    assert by_tokens[16] == {(16, True), (32, False)}
    assert by_tokens[256] == {(64, True), (32, False)}


def test_a_row_tile_tl_dot_cannot_take_is_refused() -> None:
    out = _run("--block-m", "8")
    assert out.returncode != 0 and "--block-m: '8'" in out.stderr
