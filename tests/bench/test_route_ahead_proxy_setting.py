"""What the route-ahead union's approximate router reads
(``route_ahead_proxy``) as a run setting: a RunSpec field with the engine's
default, checked, reaching the predictor, and keyed by the report only where
the union's router pass runs."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from bench_fixtures import (
    PD_MATRIX_ARGV,
    check_a_matrix_option_keys_its_runs,
    check_an_issue16_arm_sets,
)
from pdflash.bench.engine_run import RunSpec

from pdflash.engine.predict import ROUTE_AHEAD_PROXIES, route_ahead_predictor
from pdflash.report.schema import RUN_SETTINGS, row_key, spec_settings
from pdflash.routeahead import ApproxRouterPredictor

(SETTING,) = [s for s in RUN_SETTINGS if s.name == "route_ahead_proxy"]


def test_the_default_and_choices_reach_the_union() -> None:
    assert SETTING.default == RunSpec(arch="tiny", baseline="PD").route_ahead_proxy == "auto"
    assert ROUTE_AHEAD_PROXIES == ("auto", "drafter", "embed")
    adapter = SimpleNamespace(num_layers=2, num_experts=4, top_k=2)
    for proxy in ROUTE_AHEAD_PROXIES:
        union = route_ahead_predictor(adapter, "union", proxy=proxy)
        (approx, _), _ = union.members  # type: ignore[attr-defined]
        assert isinstance(approx, ApproxRouterPredictor) and approx.proxy == proxy
    with pytest.raises(ValueError, match="proxy"):
        route_ahead_predictor(adapter, "union", proxy="block")
    with pytest.raises(ValueError, match="route_ahead_proxy"):
        RunSpec(arch="tiny", baseline="PD", route_ahead_proxy="block").validate()


def test_specs_and_rows_are_keyed_by_it_where_the_union_runs() -> None:
    base = {"arch": "tiny", "baseline": "PD", "concurrency": 1, "cache_fraction": 0.2}
    assert spec_settings(base) == spec_settings({**base, "route_ahead_proxy": "auto"})
    assert spec_settings(base) != spec_settings({**base, "route_ahead_proxy": "embed"})
    for other in (
        {"baseline": "B1"},  # no route-ahead
        {"route_ahead_source": "previous_round"},  # no router pass
        {"cache_fraction": 1.0},  # a full cache predicts nothing
    ):
        spec = {**base, **other}
        assert spec_settings(spec) == spec_settings({**spec, "route_ahead_proxy": "embed"})
    row = {"arch": "tiny", "baseline": "PD", "concurrency": 1, "cache_fraction": 0.2}
    assert SETTING.of_row(row) == SETTING.of_row({**row, "route_ahead_proxy": None}) == "auto"
    assert row_key({**row, "route_ahead_proxy": "embed"}) != row_key(row)


def test_an_issue16_arm_sets_it() -> None:
    check_an_issue16_arm_sets("route_ahead_proxy", "embed", "embed")


def test_the_matrix_option_reaches_the_spec_key_and_command(tmp_path: Path) -> None:
    from pdflash.bench import cli

    check_a_matrix_option_keys_its_runs(
        PD_MATRIX_ARGV, "--route-ahead-proxy", "embed", "route_ahead_proxy", tmp_path / "o"
    )
    # the predictor's attention proxy is not offered
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args([*PD_MATRIX_ARGV, "--route-ahead-proxy", "block_attention"])
