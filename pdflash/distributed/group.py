"""Process groups for expert-parallel offload: one process per rank.

A rank reads the torchrun environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, and ``LOCAL_WORLD_SIZE``
where set) and joins the default process group: NCCL on CUDA, gloo on CPU.
:func:`launch` starts ``N`` local processes with the same environment (what
``torchrun --nproc-per-node N`` does), so a script runs the same way under
either.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

_CURRENT: list[RankGroup] = []  # the group this process joined (at most one)


@dataclass(frozen=True)
class RankGroup:
    """This process's place in the group: ``rank`` of ``world_size``, the
    device its collectives run on, and the backend (``nccl`` or ``gloo``)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    #: ranks on this rank's host (torchrun's ``LOCAL_WORLD_SIZE``); None: all of them
    local_world_size: int | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} out of range for world_size {self.world_size}")
        if self.local_world_size is not None and not (
            0 <= self.local_rank < self.local_world_size <= self.world_size
        ):
            raise ValueError(
                f"local_rank {self.local_rank} and local_world_size {self.local_world_size} "
                f"do not fit world_size {self.world_size}"
            )

    @property
    def ranks_on_host(self) -> int:
        """How many ranks share this rank's host (its cores, its memory)."""
        return self.world_size if self.local_world_size is None else self.local_world_size

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def distributed_available() -> bool:
    """Whether torch was built with torch.distributed and gloo (CPU tests)."""
    return bool(dist.is_available() and dist.is_gloo_available())


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise RuntimeError(
            f"{name} is not set: run under torchrun, or launch with pdflash.distributed.launch"
        )
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"{name}={value!r} is not an integer") from None


def init_from_env(device: str = "auto", timeout_s: float = 600.0) -> RankGroup:
    """Join the default process group from the torchrun environment.

    ``device``: ``auto`` (``cuda:LOCAL_RANK`` when CUDA is available, else
    CPU), ``cpu`` or ``cuda``. CUDA ranks use NCCL, CPU ranks gloo. Calling
    it again in a process that already joined returns the same group."""
    from datetime import timedelta

    if not distributed_available():
        raise RuntimeError("this torch has no torch.distributed with gloo")
    rank, world, local = _env_int("RANK"), _env_int("WORLD_SIZE"), _env_int("LOCAL_RANK")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
    if device == "cuda":
        if torch.cuda.device_count() <= local:
            raise RuntimeError(
                f"LOCAL_RANK {local} but only {torch.cuda.device_count()} CUDA devices"
            )
        torch.cuda.set_device(local)
        dev, backend = torch.device("cuda", local), "nccl"
    else:
        dev, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
        )
    local_world = os.environ.get("LOCAL_WORLD_SIZE")
    group = RankGroup(
        rank=rank,
        world_size=world,
        local_rank=local,
        device=dev,
        backend=backend,
        local_world_size=None if local_world is None else _env_int("LOCAL_WORLD_SIZE"),
    )
    _CURRENT[:] = [group]
    return group


def current_group() -> RankGroup | None:
    """The group this process joined with :func:`init_from_env`, or None."""
    return _CURRENT[0] if _CURRENT else None


def shutdown() -> None:
    """Leave the default process group (no-op when not joined)."""
    _CURRENT.clear()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def free_port() -> int:
    """A free TCP port on the loopback interface (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(
    local_rank: int,
    world: int,
    port: int,
    device: str,
    out_dir: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
) -> None:
    os.environ.update(
        RANK=str(local_rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    group = init_from_env(device)
    try:
        result = fn(group, *args)
        path = Path(out_dir) / f"rank{local_rank}.pkl"
        path.write_bytes(pickle.dumps(result))
    finally:
        shutdown()


def launch(fn: Callable[..., Any], nprocs: int, *args: Any, device: str = "auto") -> list[Any]:
    """Run ``fn(group, *args)`` in ``nprocs`` local processes (one rank each,
    torchrun environment, spawned) and return every rank's result in rank
    order. ``fn`` and its arguments must be picklable (a module-level
    function). A rank that raises makes this raise
    (``torch.multiprocessing.ProcessRaisedException`` naming the rank)."""
    from torch.multiprocessing.spawn import start_processes

    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    with tempfile.TemporaryDirectory(prefix="pdflash-ranks-") as out_dir:
        start_processes(  # type: ignore[no-untyped-call]
            _rank_main,
            args=(nprocs, free_port(), device, out_dir, fn, args),
            nprocs=nprocs,
            join=True,
            start_method="spawn",
        )
        return [pickle.loads((Path(out_dir) / f"rank{r}.pkl").read_bytes()) for r in range(nprocs)]
