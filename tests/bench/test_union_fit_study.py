"""bench/union_fit_study.py: the measured union curve of a committed proxy
trace (reproduces the committed result) and the fits' comparison on the
i.i.d. curve, where the geometric form is exact."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from pdflash.bench import union_fit_study as study

ROOT = Path(__file__).resolve().parents[2]
TRACE = "bench/results/h200/proxy-balanced-2026-12-01/trace_gpu_t1.npz"
RESULT = ROOT / "bench" / "results" / "cpu" / "union-fit-2026-12-04" / "union_fit.json"


def test_the_measured_curve_reproduces_the_committed_result() -> None:
    u, num_experts, k, block = study.measured_curve(str(ROOT / TRACE))
    assert (num_experts, k, block) == (128, 8, 16)
    assert u[1] == k and np.all(np.diff(u[1:]) > 0) and u[block] <= num_experts
    committed = json.loads(RESULT.read_text())[TRACE]
    assert [round(float(x), 2) for x in u[1:]] == committed["measured_union"]
    assert study.compare(u, num_experts, k, block) == {
        key: committed[key] for key in ("measured_union", "fits")
    }


def test_on_iid_routing_the_geometric_fit_is_exact() -> None:
    u = study.iid_curve(128, 8, 16)
    fits = study.compare(u, 128, 8, 16)["fits"]
    for name in study.OBSERVATION_SETS:
        geo = fits[f"{name}/geometric"]
        assert geo["added_rows_10_up_over_measured"] == pytest.approx(1.0, abs=0.03)
        assert geo["union_at_block"] == pytest.approx(u[16], abs=0.5)
        assert fits[f"{name}/hyperbolic"]["added_rows_10_up_over_measured"] < 0.8
