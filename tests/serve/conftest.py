"""A tiny synthetic model (target + DFlash draft + tokenizer) and servers
over it on loopback ports, for the ``pdflash serve`` tests."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pdflash.serve.app import BackgroundServer, ServerState, make_state
from pdflash.serve.build import ServeModelConfig, build_engine, write_synthetic_model
from pdflash.serve.loop import EngineLoop


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    # NOTE: tiny ops on a shared 2-core machine run much slower with torch's
    # default thread pool (oversubscription); the engine thread uses it too.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    target, draft = write_synthetic_model(tmp_path_factory.mktemp("tiny"), "qwen3_moe", "tiny")
    assert draft is not None
    return target, draft


def start_server(
    target: Path, draft: Path | None, *, no_eos: bool = True, max_queue: int = 256, **cfg: Any
) -> tuple[BackgroundServer, EngineLoop]:
    """A started server over ``target``. ``no_eos``: the end-of-text tokens
    do not stop generation, so lengths are exactly ``max_tokens`` (random
    weights emit them at random)."""
    config = ServeModelConfig(model=str(target), draft=None if draft is None else str(draft), **cfg)
    loop = EngineLoop(lambda: build_engine(config), max_queue=max_queue)
    loop.start(timeout_s=120)
    loop.record_outputs = True
    state: ServerState = make_state(loop, str(target))
    if no_eos:
        state = dataclasses.replace(state, stop_ids=())
    server = BackgroundServer(state).start()
    return server, loop


@pytest.fixture(scope="module")
def server(tiny_model: tuple[Path, Path]) -> Iterator[tuple[BackgroundServer, EngineLoop]]:
    target, draft = tiny_model
    srv, loop = start_server(target, draft, block_size=4, max_running=8)
    yield srv, loop
    srv.stop()
    loop.stop()


def wait_until(pred: Callable[[], bool], timeout_s: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or pred}")
        time.sleep(0.02)


def idle_counts(loop: EngineLoop) -> dict[str, int]:
    """Resource counters once nothing is live and copies have settled."""
    last: dict[str, int] = {}

    def zero() -> bool:
        nonlocal last
        last = loop.call(lambda b: b.resource_counts())
        return loop.outstanding == 0 and not any(last.values())

    with contextlib.suppress(AssertionError):
        wait_until(zero, what="requests and copies to drain")
    return last
