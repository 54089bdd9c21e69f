"""Run settings (pdflash.report.schema.RUN_SETTINGS): one list keys both the
matrix's resume and the report's rows, so two settings of one label are two
runs to both, and the report shows each as its own series."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
from pdflash.bench.engine_run import RunSpec
from pdflash.bench.suites import matrix

from pdflash.report.evaluate import evaluate
from pdflash.report.schema import (
    RUN_SETTINGS,
    recorded_spec_settings,
    row_key,
    row_settings,
    series_labels,
    spec_settings,
    validate_rows,
)
from pdflash.report.writers import markdown_report

Row = dict[str, Any]

#: the settings the engine records in a row, as the engine writes them
RECORDED = {
    "cuda_graphs": ("cuda_graphs", {"setting": "auto", "state": "on"}),
    "verify_width": ("verify_width", {"setting": "adaptive", "requested": "auto"}),
    "warmup": ("warmup", {"mode": "shared", "requested": "workload"}),
    "eviction": ("eviction_policy", "lru"),
    "host_experts": ("host_experts", "auto"),
    "host_control": ("host_control", "always"),
    "expert_dtype": ("expert_format", "fp8"),
    "compressed_gemm": ("compressed_gemm", "fused"),
    "route_ahead_source": ("route_ahead_source", "router"),
    "routing_source": ("routing_source", "trace"),
}


def test_every_spec_setting_is_a_runspec_field_with_its_default() -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(RunSpec)}
    for setting in RUN_SETTINGS:
        if not setting.in_spec:
            assert setting.name not in defaults, setting.name
            continue
        assert setting.name in defaults, setting.name
        assert setting.default == defaults[setting.name], setting.name


@pytest.mark.parametrize("name", [s.name for s in RUN_SETTINGS if s.in_spec])
def test_each_spec_setting_splits_the_resume_key(name: str) -> None:
    spec: dict[str, Any] = {
        "arch": "tiny",
        "baseline": "PD",
        "block_size": 16,
        "concurrency": 4,
        "cache_fraction": 0.2,
        "repeat": 0,
    }
    (setting,) = [s for s in RUN_SETTINGS if s.name == name]
    assert matrix.spec_key(spec) == matrix.spec_key({**spec, name: setting.default})
    other = {**spec, name: "something-else"}
    assert matrix.spec_key(spec) != matrix.spec_key(other)
    # the report keys a row of either spec apart too
    assert spec_settings(spec) != spec_settings(other)


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_rows_of_two_settings_of_one_label_are_not_duplicates(
    name: str, make_row: Callable[..., Row]
) -> None:
    field, value = RECORDED[name]
    plain, other = make_row(baseline="PD"), make_row(baseline="PD")
    other[field] = value
    assert row_key(plain) != row_key(other)
    assert validate_rows([plain, other], required_baselines=("PD",)) == []
    # the same setting twice is still a duplicate
    twice = validate_rows([other, dict(other)], required_baselines=("PD",))
    assert any("duplicate" in p for p in twice)


def test_a_row_with_a_spec_is_keyed_by_its_spec(make_row: Callable[..., Row]) -> None:
    a, b = make_row(baseline="PD"), make_row(baseline="PD")
    a["spec"] = {"host_max_ratio": 1.5}
    b["spec"] = {"host_max_ratio": 3.0}
    assert row_key(a) != row_key(b)
    # a spec that omits a setting ran with its default
    b["spec"] = {}
    assert row_key(a) == row_key(b)
    # the spec's terms, not what a row resolved them to: both asked for eviction
    # "auto" (rows recorded by older code may lack the resolved field)
    a["eviction_policy"] = "layer_cyclic"
    assert row_key(a) == row_key(b)
    b["spec"] = {"eviction": "lru"}
    assert row_key(a) != row_key(b)
    # the report's key of a matrix row holds the matrix's resume key's settings
    spec = {
        "baseline": "PD",
        "verify_width": "adaptive",
        "cuda_graphs": "auto",
        "warmup": "workload",
        "compressed_gemm": "dequant",
    }
    a["spec"] = spec
    by_name = dict(zip([s.name for s in RUN_SETTINGS], row_settings(a), strict=True))
    in_spec = [by_name[s.name] for s in RUN_SETTINGS if s.in_spec]
    assert tuple(in_spec) == spec_settings(spec)
    assert by_name["compressed_gemm"] == "dequant"  # the mode the matrix planned under
    # a spec that names no mode (recorded before specs named it): the row's record
    a["spec"] = {k: v for k, v in spec.items() if k != "compressed_gemm"}
    a["compressed_gemm"] = "fused"
    assert (
        dict(zip([s.name for s in RUN_SETTINGS], row_settings(a), strict=True))["compressed_gemm"]
        == "fused"
    )


def test_rows_before_the_marginal_rule_are_keyed_as_m_hard(make_row: Callable[..., Row]) -> None:
    """The matrix names the marginal rule in a spec only where it differs from
    the default ``verify``; a row whose spec does not name it is keyed by what
    the row records, a row recorded before the rule existed (no field) as M
    hard where the rule could apply, and ``off`` and ``verify`` are one run
    where it cannot (no calibrated or given M, or no 2-D scheduler)."""
    (setting,) = [s for s in RUN_SETTINGS if s.name == "marginal_rule"]
    binding = {"baseline": "PD", "byte_budget_from": "verify"}
    old, new = make_row(baseline="PD"), make_row(baseline="PD")
    old["spec"] = new["spec"] = binding
    new["marginal_rule"] = "verify"
    assert setting.of_row(old) == "off" and setting.of_row(new) == "verify"
    assert setting.of_row(new) == setting.of_spec(binding)  # resumes as the default
    assert row_key(old) != row_key(new)
    point = {"arch": "tiny", "block_size": 16, "concurrency": 4, "cache_fraction": 0.2}
    planned = {**point, **binding, "repeat": 0}
    assert matrix.spec_key(planned) != matrix.spec_key({**planned, "marginal_rule": "off"})
    for spec in (
        {"baseline": "PD"},  # M from every expert's bytes: never binds
        {"baseline": "B2", "byte_budget_from": "verify"},  # token-only
        {"baseline": "PD-token-sched", "byte_budget": 60000},
    ):
        assert setting.of_spec({**spec, "marginal_rule": "off"}) == setting.of_spec(spec)
        old["spec"] = spec
        assert setting.of_row(old) == setting.of_spec(spec)
    given = {"baseline": "PD-all-on", "byte_budget": 60000}  # an explicit M: F is calibrated
    assert setting.of_spec({**given, "marginal_rule": "off"}) != setting.of_spec(given)


def test_the_report_shows_each_setting_as_its_own_series(
    matrix_rows: Callable[..., list[Row]],
) -> None:
    rows = matrix_rows(concurrency=(1,), repeats=3)
    adaptive = [dict(r) for r in rows if r["baseline"] == "PD"]
    for r in rows:
        r["verify_width"] = {"setting": "full"}
    for r in adaptive:
        r["verify_width"] = {"setting": "adaptive"}
        r["output_tokens_per_s"] = 50.0
    rows += adaptive
    labels = set(series_labels(rows).values())
    assert labels == {
        "B0",
        "B1",
        "B2",
        "B3",
        "PD [verify_width=adaptive]",
        "PD [verify_width=full]",
    }
    ev = evaluate(rows)
    assert ev["valid"], ev["problems"]
    (order,) = ev["ordering"]
    assert order["tokens_per_s"]["PD [verify_width=adaptive]"] == 50.0
    assert order["tokens_per_s"]["PD [verify_width=full]"] == 38.0
    assert {"B2 < PD [verify_width=adaptive]", "PD [verify_width=full] <= B3"} <= {
        c["relation"] for c in order["checks"]
    }
    # PD's two settings are judged against each other once, and each against B1
    pairs = [(v["a"], v["b"]) for v in ev["verdicts"]]
    assert ("PD [verify_width=adaptive]", "PD [verify_width=full]") in pairs
    assert ("PD [verify_width=full]", "PD [verify_width=adaptive]") not in pairs
    assert ("PD [verify_width=full]", "B1") in pairs
    # targets name the series they judged; neither setting is pooled
    names = [t["target"] for t in ev["targets"]]
    assert "PD [verify_width=full] eta >= 0.9" in names
    assert "PD [verify_width=adaptive] beats B1 (tokens/s, 95% intervals separate)" in names
    (eta_adaptive,) = [
        e for e in ev["eta_phys"]["per_point"] if e["baseline"] == "PD [verify_width=adaptive]"
    ]
    assert eta_adaptive["repeats"] == 3
    md = markdown_report(ev, rows)
    assert (
        "| B0 | B1 | B2 | PD [verify_width=adaptive] | PD [verify_width=full] | B3 "
        "| B0<B1<B2<PD<=B3 |"
    ) in md
    assert "| PD / B1 / B3 |" in md
    # the rows table names each row's series
    assert md.count("| PD [verify_width=adaptive] | 16 | 1 |") == 3


def test_one_setting_keeps_the_bare_label(matrix_rows: Callable[..., list[Row]]) -> None:
    rows = matrix_rows(concurrency=(1,))
    for r in rows:
        r["cuda_graphs"] = {"setting": "auto"}
    assert set(series_labels(rows).values()) == {"B0", "B1", "B2", "B3", "PD"}


def test_a_setting_that_follows_the_point_splits_nothing(
    matrix_rows: Callable[..., list[Row]],
) -> None:
    """The default benchmark sets max_running from the concurrency: each
    point holds one setting of each label, so nothing is pooled or split."""
    rows = matrix_rows(concurrency=(1, 4))
    for r in rows:
        r["spec"] = {"max_running": 2 * r["concurrency"]}
    assert set(series_labels(rows).values()) == {"B0", "B1", "B2", "B3", "PD"}
    assert validate_rows(rows) == []
    # two settings at one point do split, and only that label
    extra = [dict(r, spec={"max_running": 3}) for r in rows if r["baseline"] == "PD"]
    labels = set(series_labels(rows + extra).values())
    assert labels == {
        "B0",
        "B1",
        "B2",
        "B3",
        "PD [max_running=2]",
        "PD [max_running=3]",
        "PD [max_running=8]",
    }


def test_plots_draw_each_setting_as_its_own_series(
    matrix_rows: Callable[..., list[Row]], tmp_path: Any
) -> None:
    from pdflash.report.plots import _medians, concurrency_plot, money_plot

    rows = matrix_rows(concurrency=(1,))
    adaptive = [dict(r, output_tokens_per_s=50.0) for r in rows if r["baseline"] == "PD"]
    for r in rows:
        r["verify_width"] = {"setting": "full"}
    for r in adaptive:
        r["verify_width"] = {"setting": "adaptive"}
    medians = {k[5]: v for k, v in _medians(rows + adaptive).items()}
    assert medians["PD [verify_width=adaptive]"] == 50.0
    assert medians["PD [verify_width=full]"] == 38.0
    assert "PD" not in medians
    for plot in (money_plot, concurrency_plot):
        out = plot(rows + adaptive, tmp_path / f"{plot.__name__}.png")
        assert out is not None and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_split_label_is_judged_only_where_its_setting_ran(
    matrix_rows: Callable[..., list[Row]],
) -> None:
    """PD at two widths at c=1 but one at c=4: c=4 judges the one it holds,
    and nothing is 'missing' for the setting that did not run there."""
    rows = matrix_rows(concurrency=(1, 4), repeats=3)
    extra = [
        dict(r, verify_width={"setting": "adaptive"})
        for r in rows
        if r["baseline"] == "PD" and r["concurrency"] == 1
    ]
    for r in rows:
        r["verify_width"] = {"setting": "full"}
    ev = evaluate(rows + extra)
    assert ev["valid"], ev["problems"]
    at4 = [t for t in ev["targets"] if t["where"].endswith("/c4/cf0.2")]
    assert at4 and all(t["target"].startswith("PD [verify_width=full]") for t in at4)
    assert ev["verdict"]["label"] == "GO", ev["verdict"]["reasons"]
    c4 = [o for o in ev["ordering"] if o["concurrency"] == 4]
    assert c4[0]["holds"] is True
    assert [g["series"]["PD"] for g in ev["gap"] if g["concurrency"] == 4] == [
        "PD [verify_width=full]"
    ]


def _adaptive_row(
    width: str,
    beta_mode: str | None,
    *,
    spec: bool = True,
    voi: bool | None = True,
    cost: bool | None = True,
) -> Row:
    """A PD row whose adaptive policy recorded ``beta_mode``,
    ``explore_voi`` and ``cost_gate`` (None: not recorded, as before each
    existed)."""
    estimates: dict[str, Any] = {} if beta_mode is None else {"beta_mode": beta_mode}
    if voi is not None:
        estimates["explore_voi"] = voi
    if cost is not None:
        estimates["cost_gate"] = cost
    row: Row = {
        "arch": "tiny",
        "baseline": "PD",
        "verify_width": {"setting": width, "requested": width, "estimates": estimates},
    }
    if spec:
        row["spec"] = {"arch": "tiny", "baseline": "PD", "verify_width": width}
    return row


def _width_of(row: Row) -> Any:
    names = [s.name for s in RUN_SETTINGS]
    return row_settings(row)[names.index("verify_width")]


def _keys_as_todays_adaptive(row: Row) -> bool:
    """Whether ``row``'s resume key holds today's spec at ``adaptive``
    (the verify width's place in the key)."""
    spec = {"arch": "tiny", "baseline": "PD", "verify_width": "adaptive"}
    at = [s.name for s in RUN_SETTINGS if s.in_spec].index("verify_width")
    return bool(recorded_spec_settings(row)[at] == spec_settings(spec)[at])


def test_an_adaptive_row_of_an_earlier_default_charge_is_not_todays_adaptive() -> None:
    """``adaptive`` changed its default charge (``beta=average`` to
    ``beta=hinge``): a row whose policy recorded another charge, or none
    (only ``average`` existed), keys and shows as the width naming that
    charge, in the order the width's own parser writes it; today's rows,
    explicit charges and widths without a policy keep their width."""
    from pdflash.engine.verify_width import ADAPTIVE_OPTION_KEYS, AdaptiveWidth, parse_width
    from pdflash.report import schema

    assert schema.ADAPTIVE_BETA_DEFAULT == AdaptiveWidth.BETA_MODE
    assert tuple(ADAPTIVE_OPTION_KEYS) == schema._OPTION_ORDER
    assert _width_of(_adaptive_row("adaptive", "hinge")) == "adaptive"
    assert _width_of(_adaptive_row("adaptive", "average")) == "adaptive:beta=average"
    assert _width_of(_adaptive_row("adaptive", None)) == "adaptive:beta=average"
    assert _width_of(_adaptive_row("adaptive", "average", spec=False)) == "adaptive:beta=average"
    named = _width_of(_adaptive_row("adaptive:z=1:row=wall:explore=0", "average"))
    assert named == "adaptive:z=1:beta=average:row=wall:explore=0"
    assert named == str(parse_width(named, 16))
    assert _width_of(_adaptive_row("adaptive:beta=one", "one")) == "adaptive:beta=one"
    assert _width_of(_adaptive_row("fixed:1", "average")) == "fixed:1"
    no_policy = _adaptive_row("adaptive", None)
    no_policy["verify_width"]["estimates"] = None
    assert _width_of(no_policy) == "adaptive"
    # the resume key: today's spec is not the earlier run
    assert not _keys_as_todays_adaptive(_adaptive_row("adaptive", "average"))
    assert _keys_as_todays_adaptive(_adaptive_row("adaptive", "hinge"))


def test_an_adaptive_row_that_ran_every_due_exploration_is_not_todays_adaptive() -> None:
    """``adaptive`` gained ``voi`` (on by default): a row whose policy ran
    every due exploration (``estimates.explore_voi`` false, or absent as
    before it existed) keys and shows as ``...:voi=0``, after its charge
    where that differs too; today's rows, explicit ``voi=`` and widths that
    never explore keep their width."""
    from pdflash.engine.verify_width import AdaptiveWidth, parse_width
    from pdflash.report import schema

    assert schema.ADAPTIVE_VOI_DEFAULT is AdaptiveWidth.EXPLORE_VOI
    assert _width_of(_adaptive_row("adaptive", "hinge")) == "adaptive"
    assert _width_of(_adaptive_row("adaptive", "hinge", voi=False)) == "adaptive:voi=0"
    assert _width_of(_adaptive_row("adaptive", "hinge", voi=None)) == "adaptive:voi=0"
    named = _width_of(_adaptive_row("adaptive:reach=1", "average", voi=None))
    assert named == "adaptive:beta=average:reach=1:voi=0"
    assert named == str(parse_width(named, 16))
    # a width that never explores has nothing for the rule to judge
    never = _width_of(_adaptive_row("adaptive:explore=0", "hinge", voi=None))
    assert never == "adaptive:explore=0"
    assert _width_of(_adaptive_row("adaptive:voi=0", "hinge", voi=False)) == "adaptive:voi=0"
    assert _width_of(_adaptive_row("adaptive:voi=1", "hinge", voi=True)) == "adaptive:voi=1"
    assert _width_of(_adaptive_row("fixed:1", "hinge", voi=None)) == "fixed:1"
    assert not _keys_as_todays_adaptive(_adaptive_row("adaptive", "hinge", voi=None))
    assert _keys_as_todays_adaptive(_adaptive_row("adaptive", "hinge"))


def test_an_adaptive_row_that_never_stood_down_for_its_host_time_is_not_todays_adaptive() -> None:
    """``adaptive`` gained the cost gate (on by default): a row whose policy
    never judged its own host time (``estimates.cost_gate`` false, or absent
    as before it existed) keys and shows as ``...:cost=0``, after its charge
    and ``voi`` where those differ too, in the order the width's parser
    writes them; today's rows and explicit ``cost=`` keep their width."""
    from pdflash.engine.verify_width import AdaptiveWidth, parse_width
    from pdflash.report import schema

    assert schema.ADAPTIVE_COST_DEFAULT is AdaptiveWidth.COST_GATE
    assert _width_of(_adaptive_row("adaptive", "hinge")) == "adaptive"
    assert _width_of(_adaptive_row("adaptive", "hinge", cost=False)) == "adaptive:cost=0"
    assert _width_of(_adaptive_row("adaptive", "hinge", cost=None)) == "adaptive:cost=0"
    earliest = _width_of(_adaptive_row("adaptive:reach=1", None, voi=None, cost=None))
    assert earliest == "adaptive:beta=average:reach=1:voi=0:cost=0"
    assert earliest == str(parse_width(earliest, 16))
    named = _width_of(_adaptive_row("adaptive:cost=0", "hinge", voi=False, cost=False))
    assert named == "adaptive:voi=0:cost=0" and named == str(parse_width(named, 16))
    assert _width_of(_adaptive_row("adaptive:cost=1", "hinge")) == "adaptive:cost=1"
    assert _width_of(_adaptive_row("fixed:1", "hinge", cost=None)) == "fixed:1"
    assert not _keys_as_todays_adaptive(_adaptive_row("adaptive", "hinge", cost=None))
    assert _keys_as_todays_adaptive(_adaptive_row("adaptive", "hinge"))
