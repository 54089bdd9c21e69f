# cython: language_level=3, auto_pickle=False
"""Binding of the host-to-stream signals (cuda/include/pdflash/host_signal.h).

A :class:`SignalRing` hands out ``(slot, seq)`` tickets; a host job stores
its outcome with :meth:`SignalRing.signal` (from any thread, without the
GIL), and :meth:`SignalRing.enqueue_wait` makes a CUDA stream (its handle as
an integer) wait for it on the device, bounded by a timeout. The
Python-facing hand-off is ``pdflash.hybrid.handoff``; the protocol, as
runnable code, is ``pdflash._reference.hostsignal``.
"""

from libc.stdint cimport uint32_t, uint64_t, uintptr_t

from pdflash_native._hostsignal_cpp cimport (
    HostSignalRing,
    SignalTicket,
    WaitOutcome,
    host_signal_has_cuda,
    host_signal_unavailable,
    next_signal_seq,
    signal_value,
)

OUTCOME_NONE = <int>WaitOutcome.kNone
OUTCOME_DONE = <int>WaitOutcome.kDone
OUTCOME_FAILED = <int>WaitOutcome.kFailed
OUTCOME_TIMED_OUT = <int>WaitOutcome.kTimedOut
OUTCOME_NAMES = {
    OUTCOME_NONE: "none",
    OUTCOME_DONE: "done",
    OUTCOME_FAILED: "failed",
    OUTCOME_TIMED_OUT: "timed out",
}


def has_cuda():
    """True when this build has the device wait (built with nvcc)."""
    return bool(host_signal_has_cuda())


def unavailable(int device=0):
    """Why the device wait cannot run on ``device`` ("" when it can)."""
    return host_signal_unavailable(device).decode()


def encode(uint32_t seq, bint failed):
    """The flag word a job with ``seq`` stores."""
    return signal_value(seq, failed)


def next_seq(uint32_t seq):
    """The seq after ``seq`` (never 0)."""
    return next_signal_seq(seq)


cdef class SignalRing:
    """``capacity`` signal slots; ``mapped``: page-locked and mapped into
    CUDA ``device`` (needed by :meth:`enqueue_wait`), else plain host memory
    (:meth:`wait_host` only)."""

    cdef HostSignalRing* ring
    cdef readonly int capacity

    def __cinit__(self):
        self.ring = NULL

    def __init__(self, int capacity, bint mapped=False, int device=0):
        if self.ring != NULL:
            raise RuntimeError("SignalRing is already initialised")
        self.ring = new HostSignalRing(capacity, mapped, device)
        self.capacity = capacity

    cdef HostSignalRing* _r(self) except NULL:
        if self.ring == NULL:
            raise RuntimeError("SignalRing was not initialised")
        return self.ring

    def __dealloc__(self):
        # NOTE: without the GIL: a still mapped ring's free synchronizes the
        # device, whose pending waits may need a thread that needs the GIL
        # (owners unmap() first: then this makes no CUDA call)
        cdef HostSignalRing* r = self.ring
        self.ring = NULL
        if r != NULL:
            with nogil:
                del r

    def acquire(self, uint64_t reuse_wait_ns=1_000_000_000):
        """``(slot, seq)`` for the next job (RuntimeError: the sticky error is
        set, or the slot's previous wait has not run within ``reuse_wait_ns``)."""
        cdef SignalTicket t = self._r().acquire(reuse_wait_ns)
        return t.slot, t.seq

    def signal(self, int slot, uint32_t seq, bint failed):
        """Store the job's outcome (release ordering; no GIL held)."""
        cdef HostSignalRing* r = self._r()
        with nogil:
            r.signal(slot, seq, failed)

    def unmap(self):
        """Free the page-locked words now, once no device wait runs (the
        values move to plain host memory: every reader still works, stores
        still land; :meth:`enqueue_wait` raises from then on). Freeing
        page-locked memory synchronizes the device, so the owner does it at
        a known point instead of whichever thread drops the last reference."""
        cdef HostSignalRing* r = self._r()
        with nogil:
            r.unmap()

    @property
    def mapped(self):
        """True while the words are page-locked and mapped into the device."""
        return bool(self._r().mapped())

    def enqueue_wait(self, int slot, uint32_t seq, uintptr_t stream, uint64_t timeout_ns):
        """Enqueue the device wait for ``(slot, seq)`` on ``stream``."""
        cdef HostSignalRing* r = self._r()
        with nogil:
            r.enqueue_wait(slot, seq, stream, timeout_ns)

    def wait_host(self, int slot, uint32_t seq, uint64_t timeout_ns):
        """The device wait's loop on this thread (the host stand-in): an
        ``OUTCOME_*`` code."""
        cdef WaitOutcome o
        cdef HostSignalRing* r = self._r()
        with nogil:
            o = r.wait_host(slot, seq, timeout_ns)
        return <int>o

    @property
    def error_code(self):
        """``OUTCOME_NONE``, or the first failed / timed-out wait's outcome."""
        return <int>self._r().error_code()

    @property
    def error_seq(self):
        return self._r().error_seq()

    @property
    def launches(self):
        return self._r().launches()

    def flag(self, int slot):
        return self._r().flag(slot)

    def ack(self, int slot):
        return self._r().ack(slot)
