"""The engine's host part when the service hosts nothing (tiny CPU model):
its per-verify read of the forwards' waiting share takes no device sync, a
switched-off service plans nothing (no ahead plan, no layer plan), and the
PD controller switches a service that costs without hosting off, after
which it costs nothing per layer. The GPU test: the timer's ready reads do
not wait for the device."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pdflash.engine.pd_controller import HOST_PART, PDController
from pdflash.hybrid import ForcedHostPlanner
from pdflash.hybrid.planner import LinkState, MissPlan

from .test_engine_offloaded import MAX_NEW, _stack, offloaded_checkpoint


@pytest.fixture(scope="module")
def gpt_oss_case(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    return offloaded_checkpoint(tmp_path_factory, "gpt_oss", (5, 8), seed=1)


class ManualClock:
    """An engine clock that moves only when told: step times the controller
    reads are exactly what the test charges, whatever the box's load."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class IdleCostlyPlanner(ForcedHostPlanner):
    """Hosts nothing, but each layer's plan costs ``cost_s`` of the forward
    thread (an idle service that costs): slept, or charged to ``clock``
    where one is given; counts its plans."""

    def __init__(self, cost_s: float, clock: ManualClock | None = None) -> None:
        super().__init__(every=None, ids=())
        self.cost_s = cost_s
        self.clock = clock
        self.plans = 0
        self.ahead_plans = 0

    def plan(self, layer: int, missed: Any, tokens: Any, link: LinkState) -> MissPlan:
        self.plans += 1
        if self.clock is None:
            time.sleep(self.cost_s)
        else:
            self.clock.advance(self.cost_s)
        return super().plan(layer, missed, tokens, link)

    def plan_ahead(self, expected_tokens: Any, resident: Any, link: LinkState) -> Any:
        self.ahead_plans += 1
        return super().plan_ahead(expected_tokens, resident, link)


def _no_sync(*_: Any) -> float:
    raise AssertionError("a syncing timer read (ComputeTimer.stall_s / host_wait_s)")


def test_the_waiting_share_is_read_without_a_device_sync(
    gpt_oss_case: tuple[Path, list[Any]],
) -> None:
    """Every verify plans ahead (the waiting share read each time) and
    never through the timer's syncing totals; the output stays greedy."""
    tmp, cases = gpt_oss_case
    from pdflash.engine.pd_controller import FixedParts

    eng, _, issuer = _stack(
        tmp,
        "x",
        "PD+host",
        cache_slots=6,
        controller=FixedParts(),
        block_size=5,
        host_ahead_min_exposed=0.0,
    )
    svc = eng.host_service
    assert svc is not None
    planner = IdleCostlyPlanner(0.0)
    svc.planner = planner
    eng.timer.stall_s = _no_sync  # type: ignore[method-assign]
    eng.timer.host_wait_s = _no_sync  # type: ignore[method-assign]
    try:
        ids = [eng.add_request(p, max_new_tokens=MAX_NEW) for p, _ in cases]
        done = eng.run_until_done(max_steps=400)
        for rid, (_, ref) in zip(ids, cases, strict=True):
            assert done[rid].output == ref
        assert planner.ahead_plans > 1 and planner.plans > 0
        assert svc.books.experts == 0
    finally:
        svc.close()
        issuer.close()


def test_a_costly_idle_service_is_switched_off_and_then_costs_nothing(
    gpt_oss_case: tuple[Path, list[Any]],
) -> None:
    """An engine run whose service hosts nothing but costs each layer with
    misses 15 ms of the (manual) engine clock: the PD controller's host probe
    switches it off (must earn, a loss shown), and from then on no layer
    plans and no verify plans ahead (an off service is off)."""
    tmp, cases = gpt_oss_case
    ctl = PDController()
    eng, adapter, issuer = _stack(
        tmp,
        "x",
        "PD+host",
        cache_slots=6,
        controller=ctl,
        block_size=5,
        max_running=2,
        token_budget=8,
        host_ahead_min_exposed=0.0,  # plan ahead on every verify while on
    )
    svc = eng.host_service
    assert svc is not None and eng.parts is not None and eng.parts.available.host_experts
    # the engine's clock is charged 10 ms a forward (each embeds once) plus
    # 15 ms a layer plan: the controller's step times do not depend on the
    # box's load
    clock = ManualClock()
    eng.clock = clock
    embed = adapter.embed

    def charged_embed(*args: Any, **kwargs: Any) -> Any:
        clock.advance(0.010)
        return embed(*args, **kwargs)

    adapter.embed = charged_embed
    planner = IdleCostlyPlanner(0.015, clock)
    svc.planner = planner
    # on or off, no verify waits for the device to read the waiting share
    eng.timer.stall_s = _no_sync  # type: ignore[method-assign]
    eng.timer.host_wait_s = _no_sync  # type: ignore[method-assign]
    per_step: list[tuple[bool, int, int]] = []  # (on, layer plans, ahead plans)
    try:
        prompts = [p for p, _ in cases] * 3
        for p in prompts:
            eng.add_request(p, max_new_tokens=40)
        steps = 0
        while eng.requests.live and steps < 400:
            on = ctl.parts.host_experts  # what the step applies at its start
            before = (planner.plans, planner.ahead_plans)
            eng.step()
            steps += 1
            per_step.append((on, planner.plans - before[0], planner.ahead_plans - before[1]))
        assert not eng.requests.live
        host_decisions = [d for d in ctl.summary()["decisions"] if d["part"] == HOST_PART]
        assert host_decisions, "the host part was never judged"
        first = host_decisions[0]
        assert first["switched"] and first["on"] is False, first["why"]
        # off for good unless a later decision switched it on (a run that
        # ends inside a probe of the host part may stand on its arm B, on)
        assert not ctl.configured.host_experts or any(d["on"] for d in host_decisions[1:])
        # while off, nothing of the service's planning ran
        off_steps = [(n, a) for on, n, a in per_step if not on]
        assert off_steps and all(n == 0 and a == 0 for n, a in off_steps)
        assert any(n > 0 for on, n, _ in per_step if on)
        assert svc.books.experts == 0
        assert int(np.asarray(adapter.cache.pins).sum()) == 0
    finally:
        svc.close()
        issuer.close()


@pytest.mark.gpu
def test_the_timers_ready_reads_do_not_wait_for_the_device() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from pdflash.engine.timing import ComputeTimer

    timer = ComputeTimer(torch.device("cuda"))
    torch.cuda.synchronize()
    with timer.stall("miss"):
        torch.cuda._sleep(int(2e9))  # about a second of device time (cycles)
    with timer.host_wait():
        pass
    t0 = time.perf_counter()
    ready = timer.stall_s_ready() + timer.host_wait_s_ready()
    took = time.perf_counter() - t0
    assert took < 0.1 and ready == 0.0  # the spans had not ended: counted later
    torch.cuda.synchronize()
    assert timer.stall_s_ready() > 0.1
    assert timer.stall_s() == timer.stall_s_ready()


@pytest.mark.gpu
def test_a_pd_host_run_plans_ahead_without_a_device_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PD+host on CUDA (tiny model, cache 0.5): no ``torch.cuda.synchronize``
    inside the engine's per-verify ahead plan (PD without the host has none
    there; one would wait for the prefetch copies in flight)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    monkeypatch.setenv("PDFLASH_CACHE", str(tmp_path))
    from pdflash.bench.engine_run import RunSpec, run_spec

    from pdflash.engine.engine import Engine

    inside = [False]
    syncs = [0]
    plans = [0]
    real_sync = torch.cuda.synchronize
    real_plan = Engine._plan_host_ahead

    def counting_sync(*args: Any, **kw: Any) -> None:
        syncs[0] += int(inside[0])
        real_sync(*args, **kw)

    def plan(self: Engine) -> None:
        inside[0] = True
        plans[0] += 1
        try:
            real_plan(self)
        finally:
            inside[0] = False

    monkeypatch.setattr(torch.cuda, "synchronize", counting_sync)
    monkeypatch.setattr(Engine, "_plan_host_ahead", plan)
    # the gated host part starts off and a compute-bound tiny run may never
    # switch it on (then no plan runs): gate 0 switches it on after two
    # measured steps, so the later verifies plan with the service on
    from pdflash.engine import pd_controller

    monkeypatch.setattr(pd_controller, "HOST_GATE_EXPOSED", 0.0)
    row = run_spec(
        RunSpec(
            arch="tiny",
            baseline="PD+host",
            concurrency=1,
            block_size=8,
            max_new_tokens=40,
            prompt_len=8,
            cache_fraction=0.5,
        )
    ).row
    assert row["output_tokens_per_s"] > 0
    assert row["pd_parts"]["on_fraction"]["host_experts"] > 0
    assert plans[0] > 0 and syncs[0] == 0
