"""SchedulerConfig validation: clear errors naming the bad value."""

from __future__ import annotations

import math
from typing import Any

import pytest

from pdflash import SchedulerConfig


def test_defaults_are_token_only_b2() -> None:
    cfg = SchedulerConfig(token_budget=256)
    assert cfg.token_only and cfg.byte_budget is None
    assert cfg.num_flat == 48 * 128
    assert cfg.quantum == 1.0


@pytest.mark.parametrize("budget", [None, math.inf])
def test_unbounded_byte_budget_is_token_only(budget: Any) -> None:
    assert SchedulerConfig(token_budget=8, missing_byte_budget=budget).token_only


def test_integral_float_byte_budget_is_accepted_as_int() -> None:
    cfg = SchedulerConfig(token_budget=8, missing_byte_budget=550e6)
    assert cfg.byte_budget == 550_000_000 and isinstance(cfg.missing_byte_budget, int)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"token_budget": 0}, r"token_budget must be an int >= 1, got 0"),
        ({"token_budget": 2.5}, r"token_budget must be an int >= 1, got 2\.5"),
        ({"token_budget": True}, r"token_budget must be an int >= 1, got True"),
        ({"missing_byte_budget": 0}, r"missing_byte_budget must be >= 1 byte, got 0"),
        ({"missing_byte_budget": -3}, r"missing_byte_budget must be >= 1 byte, got -3"),
        ({"missing_byte_budget": 1.5}, r"missing_byte_budget must be an int >= 1 .* got 1\.5"),
        ({"missing_byte_budget": "1GB"}, r"missing_byte_budget must be .* got '1GB'"),
        ({"quantum": 0.5}, r"quantum=0\.5 is below the largest normal item cost 1\.0"),
        ({"quantum": math.nan}, r"quantum must be a finite number, got nan"),
        ({"quantum": math.inf}, r"quantum must be a finite number, got inf"),
        ({"max_requests_per_step": 0}, r"max_requests_per_step must be None or an int >= 1, got 0"),
        ({"num_layers": 0}, r"num_layers must be an int >= 1, got 0"),
        ({"num_experts": -1}, r"num_experts must be an int >= 1, got -1"),
        ({"max_tokens_per_item": 0}, r"max_tokens_per_item must be None or an int >= 1, got 0"),
    ],
)
def test_bad_config_raises_naming_the_value(kwargs: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {"token_budget": 64, "missing_byte_budget": 1000}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(**args)


def test_quantum_floor_is_checkable_in_token_only_mode() -> None:
    # token-only with a known item size: c_max = 16 / 256, so Q = 0.1 is enough
    cfg = SchedulerConfig(token_budget=256, quantum=0.1, max_tokens_per_item=16)
    assert cfg.largest_normal_cost == 16 / 256
    with pytest.raises(ValueError, match=r"largest normal item cost 0\.0625"):
        SchedulerConfig(token_budget=256, quantum=0.05, max_tokens_per_item=16)
    # with a byte budget a normal item may cost up to 1 (mb <= M)
    with pytest.raises(ValueError, match=r"largest normal item cost 1\.0"):
        SchedulerConfig(
            token_budget=256, missing_byte_budget=10, quantum=0.1, max_tokens_per_item=16
        )


def test_config_is_frozen() -> None:
    cfg = SchedulerConfig(token_budget=8)
    with pytest.raises(AttributeError):
        cfg.token_budget = 9  # type: ignore[misc]
