"""BM4 on a real GPU: CUDA events on copy and compute streams."""

from __future__ import annotations

import argparse

import pytest
from pdflash.bench.suites import bm

pytestmark = pytest.mark.gpu


def test_bm4_measures_overlap_on_cuda() -> None:
    args = argparse.Namespace(device="cuda", expert_mib=4.0, iters=5)
    result = bm.bm4(args)
    assert result["measured"] is True
    assert 0.0 <= result["overlap_fraction"] <= 1.0 + 1e-6
    assert 0.0 < result["eta"] <= 1.0 + 1e-6
    assert result["copy_busy_s"] > 0 and result["compute_busy_s"] > 0
    assert result["wall_s"] >= max(result["copy_busy_s"], result["compute_busy_s"]) - 1e-6
    part = result["issuer"]
    assert part["measured"] is True
    assert part["copy_busy_s"] > 0 and part["compute_busy_s"] > 0
    assert 0.0 <= part["overlap_fraction"] <= 1.0
