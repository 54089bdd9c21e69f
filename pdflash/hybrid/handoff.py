"""How a HOST part's output reaches the device stream (issue 16: "nothing
waits on the host in the GPU stream except the final add").

Two hand-offs, chosen per service (:data:`HANDOFF_CHOICES`):

* ``thread`` (default): the forward's thread blocks in
  :meth:`~pdflash.hybrid.executor.HostJob.result` until the CPU is done,
  then enqueues the output's upload and the add. While it blocks it
  launches nothing (the next layer's attention and router wait for it).
* ``stream``: the forward's thread enqueues, without waiting, a device-side
  wait for the job's completion flag (:class:`StreamSignals`: a one-thread
  kernel polling a slot of a ring of flags in mapped page-locked memory,
  ``pdflash_native._hostsignal``), the upload of the job's output from its
  pinned buffer and the add, and goes on to the next layer. The job's
  completion (its last worker's future) stores the flag, with release
  ordering after the output is written, on success and on failure (a
  failure value).

Safety of the ``stream`` path:

* the device wait is bounded (``timeout_s``): a lost job cannot hang the
  GPU; a timed-out or failed wait sets the ring's sticky error, and every
  later :meth:`StreamSignals.check` (the service's next layer, its
  :meth:`~pdflash.hybrid.service.HostExpertService.settle` after each
  forward) raises :class:`HostHandoffError`: an output the host never wrote
  is added on the device but never reaches a caller silently;
* a flag slot is reused only after its wait has acknowledged it (the
  kernel writes the slot's ack word; the ring refuses, after a bounded
  wait, a slot whose wait has not run);
* the output's pinned buffer is torch's (``pin_memory=True``), one per job:
  torch's caching host allocator records an event on the stream after the
  upload and gives the block to no one before that event completes.
* the ring's page-locked words are freed at a known point: freeing
  page-locked memory synchronizes the whole device, so freed while a device
  wait is pending it blocks until that wait ends, and if the freeing thread
  is the worker that would store the wait's flag, or holds the GIL that
  worker needs, the wait runs into its timeout. A ring outlives
  :meth:`StreamSignals.close` (a finished job's callback holds it; after
  an error its exception's traceback holds that job, a cycle the garbage
  collector frees later, in whichever thread it runs), so
  :meth:`StreamSignals.close` unmaps it right after synchronizing the
  device (``SignalRing.unmap``) and its last reference, dropped anywhere,
  makes no CUDA call;
* a renewed ring runs the same self-test as the first one (a device wait
  for a flag already stored, synchronized) before any forward uses it.

:func:`stream_unavailable` says why ``stream`` cannot run (no CUDA in the
build, no device, a CPU device); the service then runs ``thread`` and
records the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from pdflash.hybrid.executor import HostJob

#: the hand-offs a service can run (module doc)
HANDOFF_CHOICES = ("thread", "stream")
#: the device wait's bound: far beyond any HOST job (milliseconds), short
#: enough that a lost job surfaces as an error instead of a hang
DEFAULT_TIMEOUT_S = 30.0
#: flag slots: the forward's thread syncs on every layer's routing read, so
#: at most a layer or two of waits are ever in flight
DEFAULT_SLOTS = 64


class HostHandoffError(RuntimeError):
    """A HOST job's output never reached the device stream (its job failed,
    or its device wait timed out): the forward that used it is invalid."""


@runtime_checkable
class SignalRing(Protocol):
    """What :class:`StreamSignals` needs of the native ring
    (``pdflash_native._hostsignal.SignalRing``)."""

    @property
    def capacity(self) -> int: ...
    @property
    def error_code(self) -> int: ...
    @property
    def error_seq(self) -> int: ...
    def acquire(self, reuse_wait_ns: int = ...) -> tuple[int, int]: ...
    def signal(self, slot: int, seq: int, failed: bool) -> None: ...
    def enqueue_wait(self, slot: int, seq: int, stream: int, timeout_ns: int) -> None: ...
    def unmap(self) -> None: ...


def stream_unavailable(device: torch.device) -> str | None:
    """Why the ``stream`` hand-off cannot run on ``device`` (None: it can)."""
    if device.type != "cuda":
        return f"the device is {device.type}, not cuda"
    try:
        from pdflash._native import load_native

        native = load_native("_hostsignal")
    except ImportError as exc:
        return f"pdflash_native._hostsignal is not built ({exc})"
    if not native.has_cuda():
        return "pdflash_native._hostsignal was built without CUDA (no nvcc at build time)"
    index = device.index if device.index is not None else torch.cuda.current_device()
    reason: str = native.unavailable(int(index))
    return reason or None


class StreamSignals:
    """The ``stream`` hand-off's device waits (module doc).

    Args:
        device: the CUDA device the forward runs on.
        timeout_s: the device wait's bound.
        slots: flag slots in the ring.
        ring_factory: makes the ring (tests); default a mapped native ring
            on ``device``.
    """

    def __init__(
        self,
        device: torch.device,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        slots: int = DEFAULT_SLOTS,
        ring_factory: Callable[[], SignalRing] | None = None,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        #: each new ring runs :meth:`_self_test` (the native mapped ring)
        self.self_tests = ring_factory is None
        if ring_factory is None:
            why = stream_unavailable(device)
            if why is not None:
                raise RuntimeError(f"the stream hand-off cannot run: {why}")
            from pdflash._native import load_native

            index = device.index if device.index is not None else torch.cuda.current_device()
            device = torch.device("cuda", index)
            native = load_native("_hostsignal")

            def ring_factory() -> SignalRing:
                ring: SignalRing = native.SignalRing(slots, True, index)
                return ring

        self.device = device
        self.timeout_s = float(timeout_s)
        self._factory = ring_factory
        self.ring: SignalRing | None = ring_factory()
        #: device waits enqueued
        self.waits = 0
        #: rings replaced after an error (:meth:`renew`)
        self.renewed = 0
        if self.self_tests:
            self._self_test()

    def _self_test(self) -> None:
        """One device wait for a flag already stored, on the current stream,
        synchronized: loads the kernel once (not in a forward) and proves the
        mapped words work both ways (the flag read, the ack written)."""
        ring = self._ring()
        slot, seq = ring.acquire(int(self.timeout_s * 1e9))
        ring.signal(slot, seq, False)
        ring.enqueue_wait(slot, seq, self.current_stream(), int(self.timeout_s * 1e9))
        torch.cuda.current_stream(self.device).synchronize()
        ack = getattr(ring, "ack", None)
        if ring.error_code != 0 or (ack is not None and ack(slot) != seq):
            raise RuntimeError(
                f"the device wait's self-test failed (error {ring.error_code}, "
                f"ack {None if ack is None else ack(slot)} for seq {seq})"
            )

    def renew(self) -> None:
        """Replace the ring by a fresh one (after an error: the old one's
        sticky error stays set) once the device is done with the old one;
        the new one passes the same self-test as the first (else it is
        closed too, and the error raised)."""
        self.close()
        self.ring = self._factory()
        self.renewed += 1
        if self.self_tests:
            try:
                self._self_test()
            except BaseException:
                self.close()  # no forward arms a ring that failed it
                raise

    def _ring(self) -> SignalRing:
        if self.ring is None:
            raise RuntimeError("StreamSignals is closed")
        return self.ring

    def arm(self, job: HostJob, stream: int) -> None:
        """Enqueue on ``stream`` (a CUDA stream handle) the device wait for
        ``job``, and have the job's completion store its flag. Anything the
        caller enqueues on ``stream`` after this runs once the job is done
        (or failed, or timed out: then :meth:`check` raises)."""
        ring = self._ring()
        self.check()
        slot, seq = ring.acquire(int(self.timeout_s * 1e9))
        ring.enqueue_wait(slot, seq, stream, int(self.timeout_s * 1e9))
        self.waits += 1
        # NOTE: after the enqueue, so a job that already finished stores a
        # flag the wait will see; before any other enqueue, so no later
        # failure of the caller leaves the wait without its flag
        job.on_done(lambda failed: ring.signal(slot, seq, failed))

    def current_stream(self) -> int:
        """The handle of the device's current stream (0 off CUDA: a ring
        from ``ring_factory`` that waits on the host, in tests)."""
        if self.device.type != "cuda":
            return 0
        return int(torch.cuda.current_stream(self.device).cuda_stream)

    def check(self) -> None:
        """Raise :class:`HostHandoffError` if a device wait saw a failed job
        or timed out."""
        ring = self.ring
        if ring is None:
            return
        code = ring.error_code
        if code == 0:
            return
        what = {2: "was given a failed HOST job", 3: "timed out"}.get(code, f"ended {code}")
        raise HostHandoffError(
            f"a HOST job's device wait (seq {ring.error_seq}) {what}: its output was not "
            "written; the forward that added it is invalid"
        )

    def close(self) -> None:
        """Drop the ring once the device is done with it, its page-locked
        words freed now (module doc); idempotent."""
        ring, self.ring = self.ring, None
        if ring is None:
            return
        if self.device.type == "cuda":
            # the wait kernels read the ring's words: none may still run
            torch.cuda.synchronize(self.device)
        # NOTE: here, not when the last reference goes (a job's callback may
        # hold the ring, and drop it in a worker while a new wait is pending)
        ring.unmap()
