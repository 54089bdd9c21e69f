"""Reused page-locked staging buffers for small host-to-device uploads.

A non-blocking upload needs its source in page-locked memory, and the
source must not change until the copy has run. A fresh pinned tensor per
upload satisfies both but costs an allocation through torch's caching host
allocator every call. :class:`StagingRing` keeps a few buffers of one
shape and dtype and uses them in turn; each upload records an event on the
stream after its copy, and a buffer is refilled only after the event of the
copy that last read it has completed (the ring is its only waiter: nothing
else holds these events, so re-recording one once it completed is safe).
When the next buffer's copy has not run yet (the host far ahead of the
stream) the ring grows by one buffer instead of waiting, up to
``max_depth``; only then does the host wait.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch


class StagingEvent(Protocol):
    """The part of ``torch.cuda.Event`` the ring uses."""

    def record(self, stream: Any = None) -> None: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


def new_cuda_event() -> StagingEvent:
    """A new ``torch.cuda.Event``: the default event maker of
    :class:`StagingRing` and :class:`~pdflash.cache.slot_events.SlotEvents`
    (tests pass a fake one instead)."""
    return torch.cuda.Event()  # type: ignore[no-untyped-call]


class StagingRing:
    """Page-locked host buffers of ``shape``/``dtype`` for uploads to one
    CUDA ``device``, ``depth`` at first, at most ``max_depth`` (see the
    module doc).

    Books: :attr:`uploads` (every :meth:`upload`), :attr:`allocations`
    (buffers made), :attr:`grown` (buffers added because the next one's copy
    was pending), :attr:`waits` (refills that had to wait for a pending copy:
    the ring was at ``max_depth``)."""

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        *,
        depth: int = 2,
        max_depth: int = 16,
        pin_memory: bool = True,
        new_event: Callable[[], StagingEvent] = new_cuda_event,
        current_stream: Callable[[torch.device], Any] | None = None,
    ) -> None:
        if not 1 <= depth <= max_depth:
            raise ValueError(f"need 1 <= depth <= max_depth, got {depth}, {max_depth}")
        self.shape = tuple(int(n) for n in shape)
        self.dtype = dtype
        self.device = torch.device(device)
        self.max_depth = max_depth
        self._pin = pin_memory
        self._new_event = new_event
        self._stream = torch.cuda.current_stream if current_stream is None else current_stream
        self._buffers: list[torch.Tensor | None] = [None] * depth
        self._host: list[npt.NDArray[Any] | None] = [None] * depth
        # the event recorded after the last copy out of each buffer (None: never used)
        self._events: list[StagingEvent | None] = [None] * depth
        self._next = 0
        self.uploads = 0
        self.allocations = 0
        self.grown = 0
        self.waits = 0

    @property
    def depth(self) -> int:
        """Buffers in the ring now."""
        return len(self._buffers)

    def stage(self) -> tuple[int, npt.NDArray[Any]]:
        """The next buffer, once the copy that last read it has run:
        ``(index, writable numpy view)``. Hand the index to :meth:`submit`."""
        i = self._next
        ev = self._events[i]
        if ev is not None and not ev.query():
            if len(self._buffers) < self.max_depth:
                # a new buffer before the busy one, which stays next in turn
                self._buffers.insert(i, None)
                self._host.insert(i, None)
                self._events.insert(i, None)
                self.grown += 1
            else:
                self.waits += 1
                ev.synchronize()
        self._next = (i + 1) % len(self._buffers)
        host = self._host[i]
        if host is None:
            buf = torch.empty(self.shape, dtype=self.dtype, pin_memory=self._pin)
            host = buf.numpy()
            self._buffers[i] = buf
            self._host[i] = host
            self.allocations += 1
        return i, host

    def submit(self, index: int) -> torch.Tensor:
        """Copy buffer ``index`` to the device (non-blocking, on the current
        stream) and record the event its next refill waits on."""
        buf = self._buffers[index]
        assert buf is not None, "submit() takes an index from stage()"
        out = buf.to(self.device, non_blocking=True)
        ev = self._events[index]
        if ev is None:
            ev = self._new_event()
            self._events[index] = ev
        ev.record(self._stream(self.device))
        self.uploads += 1
        return out

    def upload(self, values: npt.ArrayLike) -> torch.Tensor:
        """A device copy of ``values`` (of the ring's shape), on the current stream."""
        i, host = self.stage()
        host[...] = values
        return self.submit(i)


def upload_from_ring(
    rings: dict[tuple[int, ...], StagingRing],
    values: np.ndarray,
    dtype: torch.dtype,
    device: torch.device,
    *,
    max_shapes: int = 8,
) -> torch.Tensor:
    """``values`` on ``device`` through the ring of its shape in ``rings``
    (made on first use; the dict is cleared past ``max_shapes`` shapes, its
    buffers then freed through torch's host allocator, which keeps each
    alive until its copies ran)."""
    ring = rings.get(values.shape)
    if ring is None:
        if len(rings) >= max_shapes:
            rings.clear()
        ring = rings[values.shape] = StagingRing(values.shape, dtype, device)
    return ring.upload(values)
