"""bench/h200/mxfp4_tma_probe.py (the TMA-loaded MXFP4 grouped GEMM
prototype): its smoke mode runs every probe variant under Triton's
interpreter and checks each point against the dequantized fp32 reference
(tl.dot_scaled is emulated there by the same bytes dequantized and an fp32
dot). Skips where triton is not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("triton.tools.tensor_descriptor")

_SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "h200" / "mxfp4_tma_probe.py"


def test_every_probe_variant_equals_the_reference_under_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run(
        [sys.executable, "-P", str(_SCRIPT), "--smoke", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    points = result["points"]
    assert {p["variant"] for p in points} >= {"tma", "tma_s", "tma_x", "tma_sx"}
    assert all("error" not in p for p in points), [p for p in points if "error" in p]
    assert all(p["max_rel_err"] < 2e-2 for p in points)
    assert result.get("failed_points", 0) == 0
