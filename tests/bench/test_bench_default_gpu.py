"""The default suite and a one-point matrix on a real GPU (rows validate)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pdflash.bench import cli

pytestmark = pytest.mark.gpu


def test_default_quick_on_cuda(tmp_path: Path) -> None:
    out = tmp_path / "default"
    cli.main(["default", "--quick", "--no-progress", "--device", "cuda", "--out", str(out)])
    report = json.loads((out / "report.json").read_text())
    assert report["problems"] == [], report["problems"][:5]
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert len(rows) == 10
    for row in rows:
        assert row["device_type"] == "cuda" and row["timing_method"] == "cuda_events"
        assert row["link_gbps_measured"] > 1.0  # a real PCIe link, not the emulated one
        assert row["emulated_link_gbps"] is None
