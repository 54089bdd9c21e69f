"""``host_control`` (EngineConfig, PDController): ``always`` runs the host
part in every step from the first, never probed nor gated, while the
controller still probes PD's other parts; ``controller`` (default) is the
host gate and the must-earn probes. Checked on the configuration, on the
controller fed synthetic steps where the controller would keep the host off
(compute-bound) or switch it off (it costs), and on the engine's greedy
output (tiny CPU model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pdflash.engine.config import HOST_CONTROLS, EngineConfig
from pdflash.engine.pd_controller import (
    ALL_ON,
    HOST_GATE_EXPOSED,
    HOST_PART,
    PARTS,
    PartsState,
    PDController,
)

from .test_engine_hybrid import _assert_greedy_outputs, _cost_model_stack, _spec
from .test_engine_offloaded import offloaded_checkpoint
from .test_pd_controller_host_start import simulate


def test_the_config_checks_it() -> None:
    assert HOST_CONTROLS == ("controller", "always")
    assert EngineConfig().host_control == "controller"
    assert EngineConfig.preset("PD+host").host_control == "controller"
    assert EngineConfig.preset("PD+host", host_control="always").host_control == "always"
    with pytest.raises(ValueError, match=r"host_control must be one of \('controller', 'always'\)"):
        EngineConfig.preset("PD+host", host_control="on")
    # always with no host service: refused, not silently ignored
    with pytest.raises(ValueError, match="host_control 'always' needs host_experts 'auto'"):
        EngineConfig.preset("PD", host_control="always")
    # a full cache switches the host service off, and with it always
    full, off = EngineConfig.preset("PD+host", host_control="always").without_miss_parts()
    assert (full.host_experts, full.host_control) == ("off", "controller")
    assert "host_experts" in off
    with pytest.raises(ValueError, match="host_control must be one of"):
        PDController(host_control="never")


def test_the_run_spec_resolves_it() -> None:
    assert _spec("PD+host").engine_config().host_control == "controller"
    assert _spec("PD+host", host_control="always").engine_config().host_control == "always"
    with_host = _spec("PD", host_experts="auto", host_control="always").engine_config()
    assert with_host.host_control == "always"
    # no host service (PD, B3): nothing to run, so the controller's setting
    assert _spec("PD", host_control="always").engine_config().host_control == "controller"
    assert _spec("B3", host_control="always").engine_config().host_control == "controller"
    _spec("PD+host", host_control="always").validate()
    with pytest.raises(ValueError, match="host_control"):
        _spec("PD+host", host_control="on").validate()


def _host_decisions(ctl: PDController) -> list[dict[str, Any]]:
    return [d for d in ctl.summary()["decisions"] if d["part"] == HOST_PART]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(
    ("exposed", "host_factor"),
    [
        (0.0, 1.0),  # compute-bound: the gate keeps the host off
        (0.05, 1.0),
        (0.4, 1.3),  # link-bound but the host costs: its probes switch it off
    ],
)
def test_always_never_switches_or_gates_the_host_part(
    seed: int, exposed: float, host_factor: float
) -> None:
    always = PDController(host_gate=HOST_GATE_EXPOSED, host_control="always", hold=8)
    states = simulate(always, exposed=exposed, host_factor=host_factor, steps=200, seed=seed)
    assert all(states)  # on in every step, the first included
    assert _host_decisions(always) == []  # never probed, never gated
    summary = always.summary()
    assert summary["on_fraction"][HOST_PART] == 1.0 and summary["at_end"][HOST_PART]
    assert summary["settings"]["host_control"] == "always"
    # PD's other parts are still probed (each probe logs its outcome)
    assert {d["part"] for d in summary["decisions"]} & set(PARTS)
    # the same steps under the controller: the host part is off in some steps
    ctl = PDController(host_gate=HOST_GATE_EXPOSED, hold=8)
    assert not all(simulate(ctl, exposed=exposed, host_factor=host_factor, steps=200, seed=seed))
    assert ctl.summary()["settings"]["host_control"] == "controller"


def test_always_overrides_the_initial_state_and_needs_the_part() -> None:
    ctl = PDController(
        host_gate=HOST_GATE_EXPOSED,
        host_control="always",
        initial=PartsState(host_experts=False),
    )
    ctl.bind(ALL_ON.with_part(HOST_PART, True))
    assert ctl.parts.host_experts
    # an engine without a host service: nothing to switch on
    without = PDController(host_control="always")
    without.bind(ALL_ON)
    assert not without.parts.host_experts
    assert HOST_PART not in without.summary()["on_fraction"]


@pytest.fixture(scope="module")
def gpt_oss_case(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    return offloaded_checkpoint(tmp_path_factory, "gpt_oss", (5, 8), seed=1)


def test_the_engine_runs_the_host_in_every_step_and_keeps_greedy_output(
    gpt_oss_case: tuple[Path, list[Any]],
) -> None:
    """PD+host's own controller built from ``host_control="always"``: the
    service serves misses, its part ran in every measured step with no
    host decision, and the outputs are the greedy references."""
    tmp, cases = gpt_oss_case
    eng, adapter, issuer, svc = _cost_model_stack(
        tmp, min_exposed=0.2, own_controller=True, host_control="always"
    )
    try:
        assert eng.parts is not None
        policy = eng.parts.policy
        assert isinstance(policy, PDController) and policy.host_control == "always"
        assert svc.enabled
        _assert_greedy_outputs(eng, cases)
        summary = policy.summary()
        assert summary["steps"] > 0 and summary["on_fraction"][HOST_PART] == 1.0
        assert [d for d in summary["decisions"] if d["part"] == HOST_PART] == []
        assert svc.books.experts > 0
        assert int(np.asarray(adapter.cache.pins).sum()) == 0  # no expert left pinned
    finally:
        svc.close()
        issuer.close()
