"""The target runner's typed seams to its adapter: whether the adapter's MoE
takes an outside routing (:class:`pdflash.protocols.RoutedMoEAdapter`) and
whether it may run offloaded (:class:`pdflash.models.offload.OffloadedAdapter`,
whose runtime may carry the hybrid miss service and its clock) are checked
once, when the adapter is set; the runtime itself is read per forward (a
cache may be attached or detached between forwards)."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pdflash.engine.target import Chunk, TargetRunner, kv_cache_for
from pdflash.models.offload import OffloadedAdapter
from pdflash.protocols import RoutedMoEAdapter

from .conftest import HFQwen3MoeAdapter


class CountingAdapter(HFQwen3MoeAdapter):
    """The resident test adapter, counting its MoE calls (no ``moe_routed``,
    no ``runtime``)."""

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self.moe_calls = 0

    def moe(self, layer: int, normed: torch.Tensor) -> torch.Tensor:
        self.moe_calls += 1
        return super().moe(layer, normed)


class RoutedAdapter(CountingAdapter):
    """Takes the runner's routing (computes the same MoE) and carries a
    runtime (None: no cache attached)."""

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self.routed_calls = 0
        self.runtime: Any = None

    def moe_routed(
        self, layer: int, normed: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        self.routed_calls += 1
        return HFQwen3MoeAdapter.moe(self, layer, normed)


class Clock:
    """Stands in for the host service's ForwardClock: counts its marks."""

    def __init__(self) -> None:
        self.marks: list[float] = []

    def sync(self, now: float) -> None:
        self.marks.append(now)


class SameRouting:
    """A routing source that keeps the router's choice."""

    name = "same"

    def begin_forward(self, chunks: Sequence[tuple[int, int, torch.Tensor]]) -> None:
        pass

    def route(
        self, layer: int, normed: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return ids, weights

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}


def _runner(adapter: Any) -> TargetRunner:
    kv = kv_cache_for(adapter, page_size=4, num_pages=16, dtype=torch.float32, device="cpu")
    return TargetRunner(adapter, kv)


def _forward(runner: TargetRunner, seq: int) -> torch.Tensor:
    runner.kv.add_sequence(seq)
    out = runner.forward([Chunk(seq, torch.arange(5) + 3, False)])
    return out.logits[0]


def test_an_adapter_without_moe_routed_runs_its_own_moe(hf_target: Any) -> None:
    adapter = CountingAdapter(hf_target)
    assert not isinstance(adapter, RoutedMoEAdapter)
    assert not isinstance(adapter, OffloadedAdapter)
    runner = _runner(adapter)
    assert not runner.takes_routing and runner.offloaded_runtime is None
    _forward(runner, 0)
    assert adapter.moe_calls == adapter.num_layers
    # a routing source needs the routed MoE: refused with a clear error
    runner.routing = SameRouting()
    with pytest.raises(RuntimeError, match="moe_routed"):
        _forward(runner, 1)


def test_an_adapter_with_moe_routed_gets_the_runners_routing(hf_target: Any) -> None:
    plain = CountingAdapter(hf_target)
    want = _forward(_runner(plain), 0)
    adapter = RoutedAdapter(hf_target)
    assert isinstance(adapter, RoutedMoEAdapter) and isinstance(adapter, OffloadedAdapter)
    runner = _runner(adapter)
    assert runner.takes_routing
    got = _forward(runner, 0)
    assert adapter.routed_calls == adapter.num_layers and adapter.moe_calls == 0
    torch.testing.assert_close(got, want)
    # setting another adapter checks it again: the plain one runs its moe()
    runner.adapter = plain
    assert not runner.takes_routing
    before = plain.moe_calls
    _forward(runner, 1)
    assert plain.moe_calls == before + plain.num_layers
    assert adapter.routed_calls == adapter.num_layers


def test_the_host_services_clock_is_read_from_the_runtime_per_forward(hf_target: Any) -> None:
    adapter = RoutedAdapter(hf_target)
    runner = _runner(adapter)
    _forward(runner, 0)  # no runtime: no clock
    clock = Clock()
    adapter.runtime = SimpleNamespace(host_service=SimpleNamespace(clock=clock))
    assert runner.offloaded_runtime is adapter.runtime  # read per call, not kept
    _forward(runner, 1)
    assert len(clock.marks) == adapter.num_layers  # one mark per layer's routing read
    adapter.runtime.host_service = None  # the service detached between forwards
    _forward(runner, 2)
    assert len(clock.marks) == adapter.num_layers
    adapter.runtime.host_service = SimpleNamespace(clock=clock)
    adapter.runtime = None  # the cache detached
    _forward(runner, 3)
    assert len(clock.marks) == adapter.num_layers
