"""`pdflash-bench h2d` runs end to end (tiny sizes; no speed assertions:
targets live in the benchmark, not in tests)."""

from __future__ import annotations

import json

import pytest
from pdflash.bench import cli

pytestmark = pytest.mark.native

REQUIRED = [
    "link_peak_gbps",
    "issue_us_768",
    "issue_us_768_idle",
    "issue_us_768_quiescent",
    "naive_issue_us_768",
    "expert_copy_gbps",
    "on_demand_alone_us",
    "on_demand_under_load_us",
    "background_gbps_under_load",
]


def test_h2d_suite_reports_every_metric(capsys: pytest.CaptureFixture[str]) -> None:
    # A slow emulated link, so the backlog outlasts any scheduling hiccup.
    argv = ["h2d", "--json", "--backend", "host", "--emulated-gbps", "0.5"]
    argv += ["--background-mib", "32", "--expert-mib", "2", "--on-demand-mib", "4"]
    argv += ["--reps", "1", "--issue-reps", "3"]
    assert cli.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["backend"] == "host"
    for name in REQUIRED:
        assert isinstance(result[name], float) and result[name] > 0, name
    # not measurable on the host backend: absent with a reason, never a number
    assert result["naive_priority_under_load_us"] is None
    assert "CUDA" in result["not_measured"]["naive_priority_under_load_us"]
    # the on-demand copy really arrived while the backlog was queued
    assert (
        result["background_queued_bytes_at_on_demand"] >= result["scenario_bytes"]["background"] / 2
    )
