"""``pdflash serve --gpus N``: rank 0 serves in this process, ranks 1..N-1
are local processes that follow it (:mod:`.lockstep`).

:func:`start_followers` sets this process's torchrun environment as rank 0
and starts the followers (spawned, one per rank); the serving loop's engine
factory then calls :func:`build_rank0`, which joins the group and builds the
engine behind a :class:`~.lockstep.LockstepEngine`. When the server stops,
closing the engine stops the followers; :func:`join_followers` waits for
them (and ends any still running after ``timeout_s``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from .group import free_port, init_from_env, shutdown
from .lockstep import follow

if TYPE_CHECKING:
    from pdflash.serve.build import EngineBundle, ServeModelConfig


def _device_kind(device: str) -> str:
    return "cpu" if device == "cpu" else ("cuda" if device.startswith("cuda") else "auto")


def _follower_main(cfg: ServeModelConfig, rank: int, port: int) -> None:
    from pdflash.serve.build import build_engine

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(cfg.gpus),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(cfg.gpus),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    group = init_from_env(_device_kind(cfg.device), timeout_s=7 * 24 * 3600.0)
    try:
        bundle = build_engine(cfg)
        try:
            follow(bundle.engine, group)
        finally:
            bundle.close()
    finally:
        shutdown()


def start_followers(cfg: ServeModelConfig) -> list[Any]:
    """Make this process rank 0 of ``cfg.gpus`` and start ranks 1..N-1."""
    import torch.multiprocessing as mp

    if cfg.gpus < 2:
        raise ValueError(f"followers are for --gpus >= 2, got {cfg.gpus}")
    port = free_port()
    os.environ.update(
        RANK="0",
        WORLD_SIZE=str(cfg.gpus),
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE=str(cfg.gpus),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(1, cfg.gpus):
        proc = ctx.Process(
            target=_follower_main, args=(cfg, rank, port), name=f"pdflash-rank{rank}"
        )
        proc.start()
        procs.append(proc)
    return procs


def build_rank0(cfg: ServeModelConfig) -> EngineBundle:
    """Join the group as rank 0 and build the serving engine (lockstep)."""
    from pdflash.serve.build import build_engine

    # NOTE: an idle server steps nobody: the followers wait in a broadcast,
    # so the group's timeout must outlast any idle stretch
    init_from_env(_device_kind(cfg.device), timeout_s=7 * 24 * 3600.0)
    try:
        bundle = build_engine(cfg)
    except BaseException:
        shutdown()
        raise
    bundle.closers.append(shutdown)  # after the lockstep engine stopped the followers
    return bundle


def join_followers(procs: list[Any], timeout_s: float = 60.0) -> list[int | None]:
    """Wait for the followers; end those still running after ``timeout_s``
    (e.g. rank 0 failed before it could stop them). Their exit codes."""
    codes = []
    for proc in procs:
        proc.join(timeout_s)
        if proc.is_alive():
            proc.terminate()
            proc.join(10.0)
        codes.append(proc.exitcode)
    return codes
