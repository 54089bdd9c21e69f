"""The bench tests' fixtures (``make_row``, ``matrix_rows``, ``fake_engine``)
come from the ``bench_fixtures`` plugin, shared with tests/report; its helpers
are re-exported here for ``from .conftest import ...`` in this directory."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from bench_fixtures import FAKE_TPS, FakeEngine, FakeRunResult, base_row, full_matrix

__all__ = ["FAKE_TPS", "FakeEngine", "FakeRunResult", "base_row", "full_matrix"]


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Any:
    # NOTE: the engine runs here (run_spec on tiny models) are far faster on
    # one thread on a shared 2-core machine, as in tests/engine.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
