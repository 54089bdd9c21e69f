"""Row validation: every planted defect is named; a valid set passes."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

from pdflash.report.schema import METRIC_FIELDS, validate_row, validate_rows

Row = dict[str, Any]


def test_valid_row_has_no_problems(make_row: Callable[..., Row]) -> None:
    assert validate_row(make_row()) == []


def test_valid_matrix_has_no_problems(matrix_rows: Callable[..., list[Row]]) -> None:
    assert validate_rows(matrix_rows()) == []


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"output_tokens_per_s": math.nan}, "output_tokens_per_s is non-finite"),
        ({"ttft_p99_s": math.inf}, "ttft_p99_s is non-finite"),
        ({"h2d_bytes": -1.0}, "h2d_bytes is negative"),
        ({"eta": 1.2}, "eta = 1.2 is a fraction above 1"),
        ({"committed_tokens": 2.5}, "committed_tokens = 2.5 is not a whole count"),
        ({"scheduler_us_per_step": "fast"}, "scheduler_us_per_step is 'fast', not a number"),
        ({"exposed_fetch_s": True}, "exposed_fetch_s is True, not a number"),
        ({"baseline": "B9"}, "unknown baseline 'B9'"),
        ({"concurrency": 0}, "concurrency = 0 must be >= 1"),
        ({"cache_fraction": 1.5}, "cache_fraction = 1.5 must be in (0, 1]"),
        ({"device": ""}, "identity field device is empty"),
        ({"block_size": "16"}, "identity field block_size = '16' has the wrong type"),
        # null metric needs a reason
        ({"exposed_fetch_s": None}, "exposed_fetch_s is null without a reason"),
        # a value and a reason at once
        (
            {"not_measured": {"eta": "no CUDA events"}},
            "eta has a value and a not_measured reason",
        ),
        # vacuous metrics
        (
            {"committed_tokens": 0, "output_tokens_per_s": 0.0},
            "acceptance_length_mean reported with no committed tokens (vacuous)",
        ),
        (
            {"baseline": "B1"},
            "routeahead_coverage reported for baseline B1, which predicts nothing (vacuous)",
        ),
        (
            {"routed_expert_bytes": 0.0},
            "routeahead_coverage reported with no routed experts observed (vacuous)",
        ),
        (
            {"slo_s": None, "not_measured": {"slo_s": "no SLO"}},
            "goodput_rps reported without an SLO",
        ),
        ({"acceptance_length_mean": 0.5}, "acceptance_length_mean = 0.5 < 1"),
        (
            {"issuer_backend": "host", "exposed_fetch_s": 0.0, "issuer_blocked_wait_s": 0.064},
            "exposed_fetch_s = 0 s but callers blocked 0.064 s in the issuer's wait",
        ),
        ({"acceptance_length_mean": 17.0}, "exceeds the block size 16"),
    ],
)
def test_planted_defect_is_named(
    make_row: Callable[..., Row], overrides: Row, expected: str
) -> None:
    problems = validate_row(make_row(**overrides))
    assert any(expected in p for p in problems), problems


def test_missing_metric_and_identity_are_named(make_row: Callable[..., Row]) -> None:
    row = make_row()
    del row["wall_s"], row["seed"]
    problems = validate_row(row)
    assert any("missing metric 'wall_s'" in p for p in problems)
    assert any("missing identity field 'seed'" in p for p in problems)


def test_every_metric_is_required(make_row: Callable[..., Row]) -> None:
    for name in METRIC_FIELDS:
        row = make_row()
        del row[name]
        assert any(f"missing metric {name!r}" in p for p in validate_row(row)), name


def test_null_with_reason_is_fine(make_row: Callable[..., Row]) -> None:
    row = make_row(eta=None, not_measured={"eta": "no CUDA events on CPU"})
    assert validate_row(row) == []


def test_reason_for_absent_field_is_named(make_row: Callable[..., Row]) -> None:
    row = make_row(not_measured={"warp_speed": "n/a"})
    assert any("not_measured names 'warp_speed'" in p for p in validate_row(row))


def test_missing_baselines_are_named(matrix_rows: Callable[..., list[Row]]) -> None:
    rows = [
        r
        for r in matrix_rows()
        if not (r["baseline"] == "B2" and r["concurrency"] == 4) and r["baseline"] != "B3"
    ]
    problems = validate_rows(rows)
    assert "missing baseline(s) B3 at tiny/blk16/c1/cf0.2" in problems
    assert "missing baseline(s) B2, B3 at tiny/blk16/c4/cf0.2" in problems
    assert len(problems) == 2


def test_required_baselines_can_be_narrowed(matrix_rows: Callable[..., list[Row]]) -> None:
    rows = [r for r in matrix_rows() if r["baseline"] in ("B1", "PD")]
    assert validate_rows(rows, required_baselines=("B1", "PD")) == []
    with pytest.raises(ValueError, match="B7"):
        validate_rows(rows, required_baselines=("B7",))


def test_duplicates_are_named(matrix_rows: Callable[..., list[Row]]) -> None:
    rows = matrix_rows()
    rows.append(dict(rows[0]))
    problems = validate_rows(rows)
    assert problems == [f"row {len(rows) - 1}: duplicate of row 0 (tiny/B0/blk16/c1/cf0.2/r0)"]


def test_empty_and_non_object() -> None:
    assert validate_rows([]) == ["no rows"]
    assert validate_row([1, 2]) == ["row is list, not a JSON object"]  # type: ignore[arg-type]


def test_exposed_fetch_consistent_with_issuer_wait_is_fine(make_row: Callable[..., Row]) -> None:
    row = make_row(issuer_backend="host", exposed_fetch_s=0.06, issuer_blocked_wait_s=0.064)
    assert validate_row(row) == []
    # on CUDA the two clocks measure different things: no check
    assert (
        validate_row(
            make_row(issuer_backend="cuda", exposed_fetch_s=0.0, issuer_blocked_wait_s=1.0)
        )
        == []
    )


@pytest.mark.parametrize(
    ("label", "width"),
    # retired: PD at the adaptive width, recorded while PD's preset verified
    # every draft; live: PD verifying every draft (the full-width arm)
    [("PD-adaptive-width", "adaptive"), ("PD-full-width", "full")],
)
def test_rows_of_the_width_arms_are_read_under_their_own_label(
    label: str, width: str, matrix_rows: Callable[..., list[Row]]
) -> None:
    """Rows of the retired ``PD-adaptive-width`` and of the live
    ``PD-full-width`` validate, resolve ``auto`` to the width they ran at,
    and the report and its ablation table show them under their own label
    beside PD."""
    from pdflash.report.ablation import ablation_table
    from pdflash.report.evaluate import evaluate
    from pdflash.report.schema import BASELINES, RETIRED_LABELS, ROW_LABELS, resolved_width

    assert RETIRED_LABELS == ("PD-adaptive-width",) and label in ROW_LABELS
    assert (label in BASELINES) == (label not in RETIRED_LABELS)
    assert resolved_width("auto", label) == width
    assert resolved_width("auto", "PD") == resolved_width("auto", "PD+host") == "adaptive"
    rows = matrix_rows()
    arm = [
        dict(r, baseline=label, verify_width={"setting": width})
        for r in rows
        if r["baseline"] == "PD"
    ]
    assert arm and validate_rows(rows + arm) == []
    variants = {e["variant"] for e in ablation_table(rows + arm)}
    assert variants == {label}
    assert label in evaluate(rows + arm)["ordering"][0]["tokens_per_s"]


def test_host_planner_settings_read_what_the_planner_records() -> None:
    """``host_ahead`` and the retired ``host_plan`` read a row's host
    planner through one reader: its recorded value, else the default where
    the row has no host service, no planner or no such entry."""
    from pdflash.report.schema import RUN_SETTINGS

    settings = {s.name: s for s in RUN_SETTINGS}
    ahead, plan = settings["host_ahead"], settings["host_plan"]
    assert ahead.recorded is not None and plan.recorded is not None
    recorded = {"host_service": {"planner": {"ahead": "weighted", "rule": "queue"}}}
    assert (ahead.recorded(recorded), plan.recorded(recorded)) == ("weighted", "queue")
    for row in (
        {},
        {"host_service": None},
        {"host_service": {}},
        {"host_service": {"planner": None}},
        {"host_service": {"planner": {"ahead": None}}},
    ):
        assert (ahead.recorded(row), plan.recorded(row)) == ("certain", "makespan")
