"""The gated host part starts off (``PDController(host_gate=...)``): the
gate's first decision, from the first measured host-off steps, switches it
on only where the forwards wait for copies at or above the gate, so a
compute-bound run never runs the host in any step (no host-on probe) and a
link-bound one runs it from its third measured step (simulated steps, and
an engine on a tiny CPU model with its waiting share scripted)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pdflash.engine.pd_controller import (
    ALL_ON,
    HOST_GATE_EXPOSED,
    HOST_GATE_FIRST_STEPS,
    HOST_GATE_WINDOW,
    HOST_PART,
    PartsState,
    PDController,
    StepMeasurement,
)

from .test_engine_hybrid import _assert_greedy_outputs, _cost_model_stack
from .test_engine_offloaded import _stack, offloaded_checkpoint
from .test_pd_controller_stances import WITH_HOST, host_step


def simulate(
    ctl: PDController,
    *,
    exposed: float,
    host_factor: float,
    steps: int,
    seed: int = 0,
    prefill_steps: int = 0,
    share_noise: float = 0.05,
) -> list[bool]:
    """``steps`` engine steps, the first ``prefill_steps`` of them admitting
    a request (not measured): 50 ms each (x ``host_factor`` with the host
    on), whose forwards wait ``exposed`` of the wall for copies with the
    host off (none with it on), with 5% noise on the wall and
    ``share_noise`` on the share (0: none, and no draw for it). Returns the
    host part's state in each step (as the step ran)."""
    rng = np.random.default_rng(seed)
    ctl.bind(WITH_HOST)
    states = []
    for i in range(steps):
        on = ctl.parts.host_experts
        states.append(on)
        wall = 0.05 * (host_factor if on else 1.0) * (1.0 + float(rng.uniform(-0.05, 0.05)))
        share = exposed
        if share_noise:
            share *= 1.0 + float(rng.uniform(-share_noise, share_noise))
        admitted = 1 if i < prefill_steps else 0
        ctl.observe(host_step(wall, admitted, exposed_s=0.0 if on else share * wall))
    return states


def _host_decisions(ctl: PDController) -> list[dict[str, object]]:
    return [d for d in ctl.summary()["decisions"] if d["part"] == HOST_PART]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("exposed", [0.0, 0.05, 0.17])
def test_compute_bound_the_host_part_is_never_on(seed: int, exposed: float) -> None:
    """The forwards wait less than the gate for copies (0.17: the highest
    median PD's compute-bound points showed on the H200): the host part is
    off in every step of a long run, decided after the first two measured
    steps without a probe, and kept off by every later round's gate."""
    ctl = PDController(host_gate=HOST_GATE_EXPOSED)
    states = simulate(ctl, exposed=exposed, host_factor=1.15, steps=150, seed=seed)
    assert not any(states)
    first, *later = _host_decisions(ctl)
    assert first["step"] == HOST_GATE_FIRST_STEPS and first["on"] is False
    assert not first["switched"] and "first 2 measured steps" in str(first["why"])
    # later rounds: the gate's window keeps it off, never a probe
    assert later and all(not d["switched"] and "gated" in str(d["why"]) for d in later)
    s = ctl.summary()
    assert s["on_fraction"][HOST_PART] == 0.0 and s["switches"] >= 0
    assert s["settings"]["host_gate_steps"] == HOST_GATE_FIRST_STEPS
    # PD's own parts are still probed
    assert any(d["part"] != HOST_PART for d in s["decisions"])


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("exposed", [0.29, 0.48])
def test_link_bound_the_host_part_is_on_from_the_third_measured_step(
    seed: int, exposed: float
) -> None:
    """The forwards wait 29-48% of the step for copies (PD's link-bound
    points on the H200) and the host makes the step 25% shorter: off in the
    first two steps (measured), on from the third (the settle step after
    the switch) and kept on by its probes (only their off-arm steps off)."""
    ctl = PDController(host_gate=HOST_GATE_EXPOSED)
    states = simulate(ctl, exposed=exposed, host_factor=0.75, steps=80, seed=seed)
    n = HOST_GATE_FIRST_STEPS
    assert states[:n] == [False] * n and states[n]
    first = _host_decisions(ctl)[0]
    assert first["switched"] and first["on"] is True and "the link binds" in str(first["why"])
    # the first round skips the host part: on for every step of it
    assert all(states[n : n + 20])
    assert not any(d["switched"] and d["on"] is False for d in _host_decisions(ctl))
    assert sum(states) > 0.85 * len(states)


def test_prefill_and_settle_steps_add_no_sample() -> None:
    """Three prefill steps (admitted, not measured) come first: the host
    part stays off through them and the decision waits for two measured
    steps; the settle step after the switch runs the host."""
    ctl = PDController(host_gate=HOST_GATE_EXPOSED)
    states = simulate(ctl, exposed=0.4, host_factor=0.75, steps=12, prefill_steps=3)
    assert states[:5] == [False] * 5 and all(states[5:])
    assert _host_decisions(ctl)[0]["step"] == 5


def test_a_run_shorter_than_the_gate_never_runs_the_host() -> None:
    """One prefill and one measured step: no decision, no host-on step,
    even where the link binds."""
    ctl = PDController(host_gate=HOST_GATE_EXPOSED)
    states = simulate(ctl, exposed=0.9, host_factor=0.5, steps=2, prefill_steps=1)
    assert states == [False, False] and _host_decisions(ctl) == []


def test_the_first_decision_takes_the_median_of_its_steps() -> None:
    """One step above the gate and one below: the median (their mean) decides."""
    for shares, on in (([0.35, 0.1], True), ([0.25, 0.1], False)):
        ctl = PDController(host_gate=HOST_GATE_EXPOSED)
        ctl.bind(WITH_HOST)
        for share in shares:
            ctl.observe(host_step(0.05, exposed_s=share * 0.05))
        assert ctl.parts.host_experts is on
        assert f"{shares[0]:.3g}, {shares[1]:.3g}" in str(_host_decisions(ctl)[0]["why"])


def test_the_gates_watch_rereads_a_closed_first_decision() -> None:
    """The first measured steps wait little for copies (0.05-0.08 of the
    step in the H200's settled c=4 warm-ups), the later ones much (0.8):
    the first decision keeps the host part off, and the gate's watch
    switches it on as the first probe ends, not a round and a hold later;
    it pays (the step 40% shorter) and runs from there but in its probes'
    off steps."""
    ctl = PDController(host_gate=HOST_GATE_EXPOSED)
    ctl.bind(WITH_HOST)
    states = []
    for i in range(100):
        on = ctl.parts.host_experts
        states.append(on)
        wall = 0.05 * (0.6 if on else 1.0)
        share = 0.07 if i < 4 else 0.8
        ctl.observe(host_step(wall, exposed_s=0.0 if on else share * wall))
    decisions = ctl.summary()["decisions"]
    first, second, *_ = _host_decisions(ctl)
    assert first["on"] is False and not first["switched"] and "0.07" in str(first["why"])
    assert second["switched"] and second["on"] is True and "re-read" in str(second["why"])
    first_probe = next(d for d in decisions if d["part"] != HOST_PART)
    assert second["step"] == first_probe["step"] < 30
    # the summary shows the shares the gate reads: host-off steps, 0.8 each by now
    window = ctl.summary()["gate_window"]
    assert 2 <= len(window) <= HOST_GATE_WINDOW and window[-1] == 0.8
    assert PDController().summary()["gate_window"] is None
    assert sum(states[second["step"] + 1 :]) >= 0.8 * len(states[second["step"] + 1 :])


def test_a_must_earn_verdict_ends_the_gates_watch() -> None:
    """Link-bound, but the host makes the step 40% longer: its must-earn
    probe switches it off, and the gate does not switch it back on before
    its next turn (no re-read in the hold after the verdict)."""
    ctl = PDController(host_gate=HOST_GATE_EXPOSED, hold=40, max_hold=40)
    simulate(ctl, exposed=0.4, host_factor=1.4, steps=200, share_noise=0.0)
    host = _host_decisions(ctl)
    verdict = next(i for i, d in enumerate(host) if "must-earn" in str(d["why"]))
    assert host[verdict]["on"] is False
    assert all("re-read" not in str(d["why"]) for d in host[verdict + 1 :])


def test_the_first_decision_needs_host_gate_steps() -> None:
    ctl = PDController(host_gate=HOST_GATE_EXPOSED, host_gate_steps=1)
    assert simulate(ctl, exposed=0.4, host_factor=0.75, steps=4) == [False, True, True, True]
    ctl = PDController(host_gate=HOST_GATE_EXPOSED, host_gate_steps=4)
    assert simulate(ctl, exposed=0.4, host_factor=0.75, steps=6)[:5] == [False] * 4 + [True]
    for bad in (0, HOST_GATE_WINDOW + 1):
        with pytest.raises(ValueError, match="host_gate_steps"):
            PDController(host_gate=HOST_GATE_EXPOSED, host_gate_steps=bad)


@pytest.mark.parametrize("exposed, on", [(0.05, False), (0.4, True)])
def test_the_first_round_waits_for_the_first_decision(exposed: float, on: bool) -> None:
    """No warm-up: the first round of probes waits for the gate's first
    decision (two measured steps), then PD's parts are probed."""
    ctl = PDController(host_gate=HOST_GATE_EXPOSED, warmup=0)
    states = simulate(ctl, exposed=exposed, host_factor=0.75, steps=60)
    assert states[:2] == [False, False] and states[2] is on
    decisions = ctl.summary()["decisions"]
    assert decisions[0]["part"] == HOST_PART and decisions[0]["step"] == 2
    assert any(d["part"] != HOST_PART for d in decisions)


def test_without_a_gate_or_with_an_explicit_initial_nothing_changes() -> None:
    """No gate: the host part starts on (the must-earn probes judge it);
    ``initial`` with the host on: the gate's probe judges it (the old
    start, kept for the A/B)."""
    ctl = PDController()
    assert simulate(ctl, exposed=0.05, host_factor=1.15, steps=3)[0]
    old = PDController(host_gate=HOST_GATE_EXPOSED, initial=WITH_HOST)
    states = simulate(old, exposed=0.05, host_factor=1.15, steps=40)
    assert states[0] and not any(states[10:])
    first = _host_decisions(old)[0]
    assert first["switched"] and first["on"] is False and "of its probe" in str(first["why"])
    # an initial with the host off: the gate's first decision applies
    ctl = PDController(host_gate=HOST_GATE_EXPOSED, initial=ALL_ON)
    assert simulate(ctl, exposed=0.4, host_factor=0.75, steps=4) == [False, False, True, True]


@pytest.mark.parametrize("seed", range(3))
def test_the_old_start_ran_the_host_in_a_compute_bound_run(seed: int) -> None:
    """What this change removes: the gated controller started with the host
    on (``initial=WITH_HOST`` is the old default), and a compute-bound run
    ran it for the warm-up and its first probe pair; the new start runs it
    in none of those steps."""
    old = simulate(
        PDController(host_gate=HOST_GATE_EXPOSED, initial=WITH_HOST),
        exposed=0.05,
        host_factor=1.15,
        steps=10,
        seed=seed,
    )
    new = simulate(
        PDController(host_gate=HOST_GATE_EXPOSED), exposed=0.05, host_factor=1.15, steps=10
    )
    assert sum(old) >= 3 and sum(new) == 0


# ------------------------------------------------------------------ engine
class ScriptedExposure:
    """The engine's gated controller fed each step's measurement with its
    waiting share scripted (``share`` of the wall with the host part off,
    none with it on): the tiny CPU model's own copies say nothing about a
    GPU's. Records whether the service ran in each step."""

    name = "scripted-exposure"

    def __init__(self, share: float) -> None:
        self.inner = PDController(host_gate=HOST_GATE_EXPOSED)
        self.share = share
        self.engine: Any = None
        self.enabled: list[bool] = []

    @property
    def parts(self) -> PartsState:
        return self.inner.parts

    def bind(self, available: PartsState) -> None:
        self.inner.bind(available)

    def observe(self, m: StepMeasurement) -> PartsState:
        on = bool(self.engine.host_service.enabled)
        self.enabled.append(on)
        exposed = 0.0 if on else self.share * m.wall_s
        return self.inner.observe(dataclasses.replace(m, exposed_fetch_s=exposed))

    def summary(self) -> dict[str, Any]:
        return self.inner.summary()

    def reset_stats(self) -> None:
        self.inner.reset_stats()


@pytest.fixture(scope="module")
def gpt_oss_case(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    return offloaded_checkpoint(tmp_path_factory, "gpt_oss", (5, 8), seed=1)


def test_the_engines_controller_starts_with_the_service_off(
    gpt_oss_case: tuple[Path, list[Any]],
) -> None:
    """PD+host's own controller (``parts_controller``) has the gate: the
    service is off from the engine's construction, before any step."""
    tmp, _ = gpt_oss_case
    eng, _, issuer = _stack(tmp, "x", "PD+host", cache_slots=6, block_size=5)
    try:
        assert eng.parts is not None and eng.parts.available.host_experts
        policy = eng.parts.policy
        assert isinstance(policy, PDController) and policy.host_gate == HOST_GATE_EXPOSED
        assert not policy.parts.host_experts
        assert eng.host_service is not None and not eng.host_service.enabled
    finally:
        assert eng.host_service is not None
        eng.host_service.close()
        issuer.close()


@pytest.mark.parametrize("share", [0.05, 0.5])
def test_a_compute_bound_engine_run_never_hosts_and_a_link_bound_one_does(
    gpt_oss_case: tuple[Path, list[Any]], share: float
) -> None:
    """Two requests on the tiny gpt-oss model, PD+host with a planner that
    hosts every miss it is asked about. Scripted compute-bound steps (5%
    waiting): the service runs in no step, plans no layer and nothing
    ahead, hosts nothing. Link-bound (50%): it runs from the third measured
    step on and hosts. Greedy outputs are the target's either way."""
    tmp, cases = gpt_oss_case
    policy = ScriptedExposure(share)
    # a slow assumed link: the host serves misses whenever it runs; plan
    # ahead on every verify while on
    eng, adapter, issuer, svc = _cost_model_stack(tmp, min_exposed=0.0, controller=policy)
    policy.engine = eng
    try:
        _assert_greedy_outputs(eng, cases)
        host = [d for d in policy.summary()["decisions"] if d["part"] == HOST_PART]
        assert host and "first 2 measured steps" in str(host[0]["why"])
        if share < HOST_GATE_EXPOSED:
            assert not any(policy.enabled) and len(policy.enabled) > 4
            assert svc.books.experts == 0 and svc.books.planned_layers == 0
            assert svc.books.planned_ahead == 0 and eng.host_ahead is None
            assert policy.summary()["on_fraction"][HOST_PART] == 0.0
        else:
            switched = int(str(host[0]["step"]))
            assert host[0]["on"] is True and not any(policy.enabled[:switched])
            assert all(policy.enabled[switched : switched + 3])
            assert svc.books.experts > 0
        assert int(np.asarray(adapter.cache.pins).sum()) == 0
    finally:
        svc.close()
        issuer.close()
