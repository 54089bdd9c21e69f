"""How deep PD's route-ahead stream copies beyond the next layer
(``stream_ahead``) as a run setting: a RunSpec field with the engine's
default that reaches the engine configuration, checked, keyed by the report
where the label runs the stream, and settable on an issue-16 arm."""

from __future__ import annotations

from typing import Any

import pytest
from bench_fixtures import check_an_issue16_arm_sets
from pdflash.bench.engine_run import RunSpec

from pdflash.engine.config import EngineConfig
from pdflash.labels import BASELINES
from pdflash.report.schema import RUN_SETTINGS, STREAM_LABELS, row_key, spec_settings

(SETTING,) = [s for s in RUN_SETTINGS if s.name == "stream_ahead"]


def test_the_default_is_the_engines_and_reaches_its_configuration() -> None:
    assert SETTING.default == EngineConfig().stream_ahead == 2
    assert RunSpec(arch="tiny", baseline="PD").stream_ahead == 2
    assert (
        RunSpec(arch="tiny", baseline="PD+host", stream_ahead=5).engine_config().stream_ahead == 5
    )


@pytest.mark.parametrize("bad", [-1, True, 2.5, "4"])
def test_a_bad_depth_is_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="stream_ahead must be an int >= 0"):
        RunSpec(arch="tiny", baseline="PD", stream_ahead=bad).validate()


def test_the_stream_labels_mirror_the_presets() -> None:
    assert {b for b in BASELINES if EngineConfig.preset(b).streaming_prefetch} == STREAM_LABELS


def test_specs_and_rows_are_keyed_by_it_where_the_stream_runs() -> None:
    base = {"arch": "tiny", "baseline": "PD+host", "concurrency": 4, "cache_fraction": 0.2}
    assert spec_settings(base) == spec_settings({**base, "stream_ahead": 2})
    assert spec_settings(base) != spec_settings({**base, "stream_ahead": 4})
    # no stream, or a full cache that runs no prefetch part: any depth is the default run
    for plain in ({**base, "baseline": "B1"}, {**base, "baseline": "PD-no-stream"}):
        assert spec_settings(plain) == spec_settings({**plain, "stream_ahead": 4})
    full = {**base, "cache_fraction": 1.0}
    assert spec_settings(full) == spec_settings({**full, "stream_ahead": 4})
    assert spec_settings({**full, "full_cache": "off"}) != spec_settings(
        {**full, "full_cache": "off", "stream_ahead": 4}
    )
    row = {"arch": "tiny", "baseline": "PD", "concurrency": 4, "cache_fraction": 0.2}
    # a row without the stream, or older than the setting, reads as the default
    assert SETTING.of_row({**row, "stream_ahead": None}) == 2
    assert SETTING.of_row(row) == 2
    assert SETTING.of_row({**row, "stream_ahead": 4}) == 4
    assert row_key({**row, "stream_ahead": 2}) == row_key(row)
    assert row_key({**row, "stream_ahead": 4}) != row_key(row)


def test_an_issue16_arm_sets_it() -> None:
    issue16 = check_an_issue16_arm_sets("stream_ahead", "4", 4)
    base = {"arch": "tiny", "concurrency": 1, "cache_fraction": 0.2, "device": "cpu"}
    with pytest.raises(ValueError, match="run one configuration"):
        issue16.check_arms(issue16.parse_arms("PD,same=PD:stream_ahead=2"), base, ["tiny"])
