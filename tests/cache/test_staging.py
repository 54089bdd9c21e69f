"""The page-locked staging ring's reuse rule on the CPU: a buffer is refilled
only after the copy that read it has run. The copies are simulated: each
upload's "device" tensor aliases its staging buffer (a CPU ``.to`` returns
the tensor itself) and is read only when its event completes, as a DMA
that runs late would; a refill before that wait shows up as a copy that
read the later values. A ring with the wait removed is caught by the same
check."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hostpath_reference import NoWaitRing

from pdflash.cache.staging import StagingRing


class _Stream:
    """Copies queued in order; each runs (reads its source) when an event
    recorded after it is waited on."""

    def __init__(self) -> None:
        self.queue: list[list[Any]] = []  # [event, source alias, expected values]
        self.bad = 0
        self.ran = 0

    def run_through(self, event: _Event) -> None:
        last = max((i for i, op in enumerate(self.queue) if op[0] is event), default=-1)
        for _, source, want in self.queue[: last + 1]:
            self.ran += 1
            self.bad += not np.array_equal(source.numpy(), want)
        del self.queue[: last + 1]


class _Event:
    def __init__(self) -> None:
        self.stream: _Stream | None = None

    def record(self, stream: Any = None) -> None:
        self.stream = stream
        stream.queue.append([self, None, None])

    def query(self) -> bool:
        return self.stream is None or all(op[0] is not self for op in self.stream.queue)

    def synchronize(self) -> None:
        assert self.stream is not None
        self.stream.run_through(self)


def _drive(
    cls: type[StagingRing], depth: int, max_depth: int, uploads: int, seed: int
) -> tuple[StagingRing, _Stream]:
    stream = _Stream()
    ring = cls(
        (3, 5),
        torch.int64,
        torch.device("cpu"),
        depth=depth,
        max_depth=max_depth,
        pin_memory=False,
        new_event=_Event,
        current_stream=lambda device: stream,
    )
    rng = np.random.default_rng(seed)
    for _ in range(uploads):
        values = rng.integers(-9, 9, (3, 5))
        out = ring.upload(values)
        stream.queue[-1][1:] = [out, values.copy()]
        # now and then the host waits for everything (a sync elsewhere)
        if rng.random() < 0.1 and stream.queue:
            stream.run_through(stream.queue[-1][0])
    for op in list(stream.queue):
        stream.run_through(op[0])
    return ring, stream


SIZES = [(1, 1), (2, 2), (1, 4), (2, 16)]


@pytest.mark.parametrize(("depth", "max_depth"), SIZES)
def test_ring_refills_a_buffer_only_after_its_copy_ran(depth: int, max_depth: int) -> None:
    ring, stream = _drive(StagingRing, depth, max_depth, 60, seed=max_depth)
    assert stream.ran == 60 and stream.bad == 0
    assert ring.uploads == 60
    assert ring.allocations == ring.depth <= max_depth  # one allocation per buffer
    assert ring.grown == ring.depth - depth
    # the copies run only at the occasional host sync: a small ring must wait
    if max_depth <= 4:
        assert ring.waits > 0


@pytest.mark.parametrize(("depth", "max_depth"), SIZES)
def test_the_check_catches_a_premature_refill(depth: int, max_depth: int) -> None:
    _, stream = _drive(NoWaitRing, depth, max_depth, 60, seed=max_depth)
    assert stream.ran == 60 and stream.bad > 0


def test_upload_values_and_bad_depth() -> None:
    values = np.arange(6, dtype=np.int64).reshape(2, 3)
    ring = StagingRing(
        values.shape,
        torch.int64,
        torch.device("cpu"),
        pin_memory=False,
        new_event=_Event,
        current_stream=lambda device: _Stream(),
    )
    assert torch.equal(ring.upload(values), torch.from_numpy(values))
    for depth, max_depth in ((0, 4), (5, 4)):
        with pytest.raises(ValueError, match="depth"):
            StagingRing((1,), torch.int64, torch.device("cpu"), depth=depth, max_depth=max_depth)
