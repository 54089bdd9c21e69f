"""``pdflash.bench.eager_count``: the harness of the CPU counting scripts
(which method runs, the MoE layers counted, counting from the first timed
step of eager_host)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from pdflash.bench import eager_host
from pdflash.bench.eager_count import EagerCount

from pdflash.cache.expert_cache import ExpertCache
from pdflash.models.offload import OffloadedMoE


class _Toy:
    def outer(self) -> list[str | None]:
        return [self.seen(), *self.inner()]

    def inner(self) -> list[str | None]:
        return [self.seen()]

    def seen(self) -> str | None:
        return None


def test_inside_names_the_innermost_wrapped_method_and_outermost_wraps_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("outer", "inner", "seen"):
        monkeypatch.setattr(_Toy, name, getattr(_Toy, name))
    count = EagerCount()
    entered: list[str | None] = []

    @contextlib.contextmanager
    def outermost() -> Iterator[None]:
        entered.append(count.inside)
        yield

    count.wrap(_Toy, "outer", outermost)
    count.wrap(_Toy, "inner", outermost)
    monkeypatch.setattr(_Toy, "seen", lambda self: count.inside)
    toy = _Toy()
    assert toy.outer() == [None, None]  # counting off: nothing is inside
    count.on = True
    assert toy.outer() == ["_Toy.outer", "_Toy.inner"]
    assert toy.inner() == ["_Toy.inner"]
    assert count.stack == [] and count.inside is None
    # the context is entered only around a call no other wrapped method is under
    assert entered == [None, "_Toy.outer", "_Toy.inner"]
    assert count.layers == 0 and count.moe_layers == 1


def test_run_counts_moe_layers_from_the_first_timed_step(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(OffloadedMoE, "_forward_grouped", OffloadedMoE._forward_grouped)
    monkeypatch.setattr(eager_host.ExclusiveTimer, "patch", eager_host.ExclusiveTimer.patch)
    monkeypatch.setattr(ExpertCache, "acquire", ExpertCache.acquire)
    count = EagerCount()
    acquired: list[tuple[bool, str | None]] = []

    def outermost() -> Any:
        acquired.append((count.on, count.inside))
        return contextlib.nullcontext()

    count.wrap(ExpertCache, "acquire", outermost)
    layers = 4
    argv = ["--arch", "gpt_oss", "--layers", str(layers), "--experts", "16", "--top-k", "4"]
    argv += ["--requests", "1", "--tokens", "2", "--steps", "1", "--cache-fraction", "0.2"]
    threads = torch.get_num_threads()
    try:
        assert count.run(argv) == 0
    finally:
        torch.set_num_threads(threads)  # eager_host sets its own
    capsys.readouterr()
    assert count.on
    assert count.layers > 0 and count.layers % layers == 0
    # the prompt's prefill acquired before counting started; the steps after it
    assert acquired[0] == (False, None)
    assert (True, "ExpertCache.acquire") in acquired
