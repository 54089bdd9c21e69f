"""What PD's stream does with the gate lookahead's experts below its
threshold (``lookahead_tail``) as a run setting: a RunSpec field with the
engine's default that reaches the engine configuration and the stream,
checked (with the combinations it refuses), keyed by the report where the
label runs the stream, and settable on an issue-16 arm."""

from __future__ import annotations

import pytest
from bench_fixtures import check_an_issue16_arm_sets
from pdflash.bench.engine_run import RunSpec

from pdflash.engine.config import LOOKAHEAD_TAILS, EngineConfig
from pdflash.engine.prefetch import ExpertPrefetcher
from pdflash.protocols import Band
from pdflash.report.schema import RUN_SETTINGS, row_key, spec_settings

(SETTING,) = [s for s in RUN_SETTINGS if s.name == "lookahead_tail"]


class _Shape:
    num_layers, num_experts, top_k = 2, 4, 2


def test_the_default_is_the_engines_and_reaches_the_stream() -> None:
    assert SETTING.default == EngineConfig().lookahead_tail == "skip"
    assert LOOKAHEAD_TAILS == ("skip", "background")
    assert RunSpec(arch="tiny", baseline="PD").lookahead_tail == "skip"
    spec = RunSpec(arch="tiny", baseline="PD", lookahead_tail="background")
    spec.validate()
    config = spec.engine_config()
    assert config.lookahead_tail == "background"
    for tail, band in (("skip", None), ("background", Band.BACKGROUND)):
        planner = ExpertPrefetcher(
            _Shape(),  # type: ignore[arg-type]
            object(),  # type: ignore[arg-type]
            EngineConfig.preset("PD", lookahead_tail=tail),
        )
        assert planner.built_stream is not None
        assert planner.built_stream.tail_band == band


def test_bad_values_and_combinations_are_refused() -> None:
    with pytest.raises(ValueError, match="lookahead_tail"):
        EngineConfig(lookahead_tail="route_ahead")
    with pytest.raises(ValueError, match="lookahead_tail"):
        RunSpec(arch="tiny", baseline="PD", lookahead_tail="route_ahead").validate()
    # under "every" nothing is below the threshold
    with pytest.raises(ValueError, match="needs a threshold"):
        EngineConfig.preset("PD", lookahead_score="every", lookahead_tail="background")
    with pytest.raises(ValueError, match="needs a threshold"):
        RunSpec(
            arch="tiny", baseline="PD", lookahead_score="every", lookahead_tail="background"
        ).validate()
    # the host split plans only the confident copies
    with pytest.raises(ValueError, match="host_experts"):
        EngineConfig.preset("PD+host", lookahead_tail="background")
    with pytest.raises(ValueError, match="hybrid miss service"):
        RunSpec(arch="tiny", baseline="PD+host", lookahead_tail="background").validate()


def test_specs_and_rows_are_keyed_by_it_where_the_stream_runs() -> None:
    base = {"arch": "tiny", "baseline": "PD", "concurrency": 1, "cache_fraction": 0.2}
    assert spec_settings(base) == spec_settings({**base, "lookahead_tail": "skip"})
    assert spec_settings(base) != spec_settings({**base, "lookahead_tail": "background"})
    plain = {**base, "baseline": "B1"}  # no stream: no tail to copy
    assert spec_settings(plain) == spec_settings({**plain, "lookahead_tail": "background"})
    full = {**base, "cache_fraction": 1.0}  # a full cache runs no stream
    assert spec_settings(full) == spec_settings({**full, "lookahead_tail": "background"})
    row = {"arch": "tiny", "baseline": "PD", "concurrency": 1, "cache_fraction": 0.2}
    assert SETTING.of_row(row) == SETTING.of_row({**row, "lookahead_tail": None}) == "skip"
    assert row_key({**row, "lookahead_tail": "background"}) != row_key(row)


def test_an_issue16_arm_sets_it() -> None:
    check_an_issue16_arm_sets("lookahead_tail", "background", "background")
