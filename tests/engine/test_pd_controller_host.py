"""The PD controller's host-service part (``host_experts``): switched off
where hosting costs, kept where it pays (simulated steps), and applied to an
engine's hybrid miss service (tiny CPU model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pdflash.engine.pd_controller import (
    ALL_ON,
    ALL_PARTS,
    HOST_PART,
    PARTS,
    FixedParts,
    PartsState,
    PDController,
    StepMeasurement,
)

from .test_engine_hybrid import _assert_greedy_outputs, _cost_model_stack
from .test_engine_offloaded import offloaded_checkpoint
from .test_pd_controller_stances import WITH_HOST, host_step


def _run(host_factor: float, seed: int, steps: int = 60) -> PDController:
    """Steps whose wall is ``host_factor`` times longer with the host on
    (a fake host: slower above 1, faster below), with 10% noise."""
    rng = np.random.default_rng(seed)
    ctl = PDController()
    ctl.bind(WITH_HOST)
    for _ in range(steps):
        parts = ctl.parts
        wall = 0.05 * (host_factor if parts.host_experts else 1.0)
        wall *= 1.0 + float(rng.uniform(-0.1, 0.1))
        ctl.observe(host_step(wall))
    return ctl


def _host_switches(ctl: PDController) -> list[dict[str, Any]]:
    return [d for d in ctl.summary()["decisions"] if d["part"] == HOST_PART and d["switched"]]


@pytest.mark.parametrize("seed", range(5))
def test_a_host_that_costs_is_switched_off(seed: int) -> None:
    ctl = _run(1.4, seed)
    assert not ctl.parts.host_experts
    (first, *_) = _host_switches(ctl)
    assert first["on"] is False and "costs more than it saves" in first["why"]
    # the host part is probed first: decided within the warm-up and one probe
    assert first["step"] <= 2 + 2 * ctl.max_pairs + 2 * ctl.settle + 2
    s = ctl.summary()
    assert s["available"][HOST_PART] is True and s["at_end"][HOST_PART] is False
    assert s["on_fraction"][HOST_PART] < 0.5


@pytest.mark.parametrize("seed", range(5))
def test_a_host_that_pays_is_kept(seed: int) -> None:
    ctl = _run(0.7, seed)
    assert ctl.parts.host_experts
    assert _host_switches(ctl) == []
    assert ctl.summary()["on_fraction"][HOST_PART] > 0.75


def test_the_host_part_is_listed_and_switchable_only_where_the_engine_has_it() -> None:
    assert ALL_PARTS[0] == HOST_PART and ALL_PARTS[1:] == PARTS
    # ALL_ON is PD's parts: without a host service nothing about it shows
    assert not ALL_ON.host_experts and ALL_ON.runs("route_ahead")
    ctl = PDController()
    ctl.bind(ALL_ON)
    assert set(ctl.summary()["available"]) == set(PARTS)
    assert not ctl.parts.host_experts
    # with one, every policy starts with it on unless told otherwise
    for policy in (PDController(), FixedParts()):
        policy.bind(WITH_HOST)
        assert policy.parts.host_experts
        assert set(policy.summary()["available"]) == set(ALL_PARTS)
    off = PDController(initial=ALL_ON)
    off.bind(WITH_HOST)
    assert not off.parts.host_experts
    assert PartsState(True, True, True).masked(WITH_HOST) == ALL_ON
    with pytest.raises(ValueError, match="unknown part"):
        ALL_ON.on("hosts")


# ------------------------------------------------------------------ engine
class ToggleHost:
    """Host service on and off in turn, one step each; PD's parts all on."""

    name = "toggle-host"

    def __init__(self) -> None:
        self._i = 0
        self._available = ALL_ON
        self.enabled_seen: list[bool] = []
        self.engine: Any = None

    @property
    def parts(self) -> PartsState:
        return WITH_HOST.with_part(HOST_PART, self._i % 2 == 0).masked(self._available)

    def bind(self, available: PartsState) -> None:
        self._available = available

    def observe(self, m: StepMeasurement) -> PartsState:
        if self.engine is not None:
            self.enabled_seen.append(self.engine.host_service.enabled)
        self._i += 1
        return self.parts

    def summary(self) -> dict[str, Any]:
        return {"policy": self.name, "steps": self._i}

    def reset_stats(self) -> None:
        self._i = 0


@pytest.fixture(scope="module")
def gpt_oss_case(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    return offloaded_checkpoint(tmp_path_factory, "gpt_oss", (5, 8), seed=1)


def test_the_engine_switches_its_host_service_and_keeps_greedy_output(
    gpt_oss_case: tuple[Path, list[Any]],
) -> None:
    tmp, cases = gpt_oss_case
    policy = ToggleHost()
    # a slow assumed link: the host serves misses whenever it runs; the
    # engine's default gate for planning ahead
    eng, adapter, issuer, svc = _cost_model_stack(tmp, min_exposed=0.2, controller=policy)
    assert eng.parts is not None
    assert eng.parts.available.host_experts
    policy.engine = eng
    try:
        _assert_greedy_outputs(eng, cases)
        # the service followed the policy, step by step
        assert policy.enabled_seen[:4] == [True, False, True, False]
        assert svc.books.experts > 0
        assert int(np.asarray(adapter.cache.pins).sum()) == 0
    finally:
        svc.close()
        issuer.close()
