"""Replicated control for serving: every rank's engine sees the same
requests in the same order and steps together.

Rank 0 serves (HTTP, the engine loop) through a :class:`LockstepEngine`: the
loop calls ``add_request``/``abort``/``step`` on it as on an
:class:`~pdflash.engine.Engine`; each ``step()`` first broadcasts the
operations since the previous step (``broadcast_object_list``, one per step)
to the other ranks, which apply them in the same order with
:func:`follow` and step too. Token callbacks stay on rank 0 (followers pass
none). :meth:`LockstepEngine.stop` ends the followers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from pdflash.engine.verify_width import is_adaptive

from .group import RankGroup

if TYPE_CHECKING:
    from pdflash.engine.config import EngineConfig

_STOP = "stop"


def replicated_config(config: EngineConfig) -> EngineConfig:
    """The engine configuration every rank runs: PD's parts fixed as
    configured, and the verify width ``full`` where it was ``adaptive``.
    Ranks replicate the engine's control, and the PD controller and the
    adaptive width decide from each rank's own timings, so ranks could switch
    parts (the scheduler) or cut drafts differently at the same step and their
    batches would diverge (``fixed:K`` is the same on every rank and stays)."""
    width = "full" if is_adaptive(config.verify_width) else config.verify_width
    return config.replace(parts_controller=False, verify_width=width)


class LockstepEngine:
    """Rank 0's engine facade (module doc); anything else is the engine's."""

    def __init__(self, engine: Any, group: RankGroup) -> None:
        if not group.is_main:
            raise ValueError("only rank 0 drives the group's engines; other ranks call follow()")
        self.engine = engine
        self.group = group
        self._ops: list[tuple[str, Any]] = []
        self.stopped = False

    def add_request(self, prompt_ids: Any, params: Any = None, **kwargs: Any) -> int:
        # NOTE: a request the engine refuses (it raises, nothing queued) is not
        # sent: the followers' engines would refuse it the same way
        rid = int(self.engine.add_request(prompt_ids, params, **kwargs))
        kwargs.pop("on_token", None)  # callbacks stay here
        self._ops.append(("add", (list(prompt_ids), params, kwargs)))
        return rid

    def abort(self, request_id: int) -> bool:
        self._ops.append(("abort", int(request_id)))
        return bool(self.engine.abort(request_id))

    def step(self) -> Any:
        if self.stopped:
            raise RuntimeError("the lockstep group was stopped")
        ops, self._ops = self._ops, []
        box: list[Any] = [[*ops, ("step", None)]]
        dist.broadcast_object_list(box, src=0)
        return self.engine.step()

    def stop(self) -> None:
        """End every follower's loop (no-op when already stopped)."""
        if self.stopped:
            return
        self.stopped = True
        box: list[Any] = [[(_STOP, None)]]
        dist.broadcast_object_list(box, src=0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def follow(engine: Any, group: RankGroup) -> int:
    """A follower rank's loop: apply rank 0's operations and step, until it
    stops the group. Returns the number of steps taken."""
    if group.is_main:
        raise ValueError("rank 0 drives the group (LockstepEngine), it does not follow")
    steps = 0
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        for kind, arg in box[0]:
            if kind == _STOP:
                return steps
            if kind == "add":
                prompt_ids, params, kwargs = arg
                engine.add_request(prompt_ids, params, **kwargs)
            elif kind == "abort":
                engine.abort(arg)
            elif kind == "step":
                engine.step()
                steps += 1
                # a follower keeps no finished requests (rank 0 reports them)
                engine.finished.clear()
            else:
                raise RuntimeError(f"unknown lockstep operation {kind!r}")
