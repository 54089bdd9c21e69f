# cython: language_level=3, auto_pickle=False
"""Binding of the C++ H2D issuer (cuda/include/pdflash/issuer.h).

Pointers are plain integers; arrays are contiguous int64/uint64/uint8 NumPy
arrays. Every call that can block or touches many copies releases the GIL.
The Python-facing class is ``pdflash.h2d.H2DIssuer``.
"""

from cpython.buffer cimport PyBUF_FORMAT
from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.stdint cimport int64_t, uint8_t, uint64_t, uintptr_t
from libcpp.string cimport string
from libcpp.vector cimport vector

from pdflash_native._issuer_cpp cimport (
    IssuerConfig,
    IssuerStats,
    LinkState,
    LiveCounts,
    LogEvent,
    WaitResult,
    alloc_pinned as c_alloc_pinned,
    built_with_cuda as c_built_with_cuda,
    cuda_device_count as c_cuda_device_count,
    free_pinned as c_free_pinned,
    kNumBands,
    live_counts as c_live_counts,
    register_host as c_register_host,
    unregister_host as c_unregister_host,
)

import numpy as np

#: Bands, most urgent first; their number comes from issuer.h (kNumBands).
BAND_NAMES = ("ON_DEMAND", "ROUTE_AHEAD", "BACKGROUND")
NUM_BANDS = kNumBands
assert len(BAND_NAMES) == NUM_BANDS
STATE_QUEUED = 0
STATE_RUNNING = 1
STATE_DONE = 2
STATE_FAILED = 3
STATE_CANCELLED = 4

LOG_SUBMIT = 0
LOG_PROMOTE = 1
LOG_CANCEL = 2
LOG_START = 3
LOG_END = 4
LOG_FINISH = 5

# Matches struct pdflash::LogEvent (natural C alignment).
LOG_DTYPE = np.dtype(
    [
        ("t_s", np.float64),
        ("kind", np.int32),
        ("band", np.int32),
        ("ticket", np.int64),
        ("chunk", np.int64),
        ("bytes", np.int64),
        ("ok", np.int32),
    ],
    align=True,
)
if LOG_DTYPE.itemsize != sizeof(LogEvent):
    raise ImportError(
        f"LogEvent layout mismatch: numpy {LOG_DTYPE.itemsize} != C++ {sizeof(LogEvent)}"
    )


class CopyFailedError(RuntimeError):
    """A copy failed; the message carries the backend's (CUDA) error text."""

    def __init__(self, ticket, message):
        super().__init__(f"ticket {ticket}: {message}")
        self.ticket = ticket


class CopyCancelledError(RuntimeError):
    """A copy was cancelled (cancel() or shutdown) before it completed."""

    def __init__(self, ticket, message):
        super().__init__(f"ticket {ticket}: {message}")
        self.ticket = ticket


cdef object _raise_for(WaitResult& r):
    if r.code == 0:
        return None
    msg = r.message.decode("utf-8", "replace")
    if r.code == 1:
        raise TimeoutError(msg)
    if r.code == 2:
        raise CopyFailedError(r.ticket, msg)
    raise CopyCancelledError(r.ticket, msg)


def cuda_device_count():
    """CUDA devices usable by the CUDA backend (0 without CUDA or a device)."""
    return c_cuda_device_count()


def built_with_cuda():
    """True when this build contains the CUDA backend."""
    return bool(c_built_with_cuda())


def live_counts():
    """Live native objects (issuers, threads, pinned allocations,
    registrations), for leak checks."""
    cdef LiveCounts c = c_live_counts()
    return {
        "issuers": c.issuers,
        "threads": c.threads,
        "pinned_allocations": c.pinned_allocations,
        "registrations": c.registrations,
    }


cdef class PinnedBuffer:
    """Page-locked host memory (cudaHostAlloc, or aligned malloc on the host
    backend). Exposes a writable 1-D uint8 buffer: ``np.frombuffer(buf,
    np.uint8)`` views it without a copy. Freed when the last reference (and
    the last view) goes away, or by :meth:`free` when no view exists.
    ``release(ptr, nbytes)``, when given, runs first (an issuer's
    ``release_region``: no copy may still read the memory)."""

    def __cinit__(self):
        self._ptr = NULL
        self._exports = 0
        self._nbytes = 0
        self._release = None

    def __init__(self, size_t nbytes, bint cuda, int device=0, release=None):
        if self._ptr != NULL:
            raise RuntimeError("PinnedBuffer is already initialised")
        with nogil:
            self._ptr = c_alloc_pinned(cuda, device, nbytes)
        self._nbytes = nbytes
        self._cuda = cuda
        self._device = device
        self._release = release
        self._shape[0] = <Py_ssize_t>nbytes
        self._strides[0] = 1

    def __dealloc__(self):
        if self._ptr != NULL and self._release is not None:
            try:
                self._release(<uintptr_t>self._ptr, self._nbytes)
            except BaseException:
                pass  # NOTE: nothing can be raised from a deallocator
        self._free()

    cdef void _free(self) noexcept:
        if self._ptr != NULL:
            c_free_pinned(self._cuda, self._device, self._ptr)
            self._ptr = NULL

    @property
    def ptr(self):
        """The address (int); 0 once freed."""
        return <uintptr_t>self._ptr

    @property
    def nbytes(self):
        return self._nbytes

    @property
    def cuda(self):
        """True when allocated with cudaHostAlloc."""
        return bool(self._cuda)

    def free(self):
        """Free now. Raises BufferError while a view (e.g. a NumPy array)
        still exports this buffer."""
        if self._exports > 0:
            raise BufferError(f"{self._exports} view(s) of this pinned buffer are alive")
        if self._ptr != NULL and self._release is not None:
            self._release(<uintptr_t>self._ptr, self._nbytes)
        self._free()

    def __getbuffer__(self, Py_buffer* buf, int flags):
        if self._ptr == NULL:
            raise BufferError("pinned buffer was freed")
        buf.buf = self._ptr
        buf.obj = self
        buf.len = <Py_ssize_t>self._nbytes
        buf.readonly = 0
        buf.itemsize = 1
        if flags & PyBUF_FORMAT:
            buf.format = b"B"
        else:
            buf.format = NULL
        buf.ndim = 1
        buf.shape = self._shape
        buf.strides = self._strides
        buf.suboffsets = NULL
        buf.internal = NULL
        self._exports += 1

    def __releasebuffer__(self, Py_buffer* buf):
        self._exports -= 1


cdef class NativeIssuer:
    """One issuer: a worker thread, one copy stream, queues per band."""

    def __cinit__(self):
        self._issuer = NULL
        self._registered = {}
        self._sources = {}
        self._destinations = {}

    def __init__(
        self,
        bint use_cuda,
        int device=0,
        size_t chunk_bytes=8 << 20,
        size_t window_bytes=16 << 20,
        int max_inflight_chunks=32,
        double emulated_link_gbps=0.0,
        bint debug_log=False,
        double issue_lead_s=0.0,
    ):
        if self._issuer != NULL:
            raise RuntimeError("NativeIssuer is already initialised")
        cdef IssuerConfig cfg
        cfg.use_cuda = use_cuda
        cfg.device = device
        cfg.chunk_bytes = chunk_bytes
        cfg.window_bytes = window_bytes
        cfg.max_inflight_chunks = max_inflight_chunks
        cfg.emulated_link_gbps = emulated_link_gbps
        cfg.debug_log = debug_log
        cfg.issue_lead_s = issue_lead_s
        self.use_cuda = use_cuda
        self.device = device
        self._issuer = new Issuer(cfg)

    def __dealloc__(self):
        cdef uintptr_t ptr
        if self._issuer != NULL:
            with nogil:
                del self._issuer
            self._issuer = NULL
        if self._registered:
            for key in self._registered:
                ptr = key
                c_unregister_host(self.use_cuda, self.device, <void*>ptr)
            self._registered = {}

    cdef Issuer* _live(self) except NULL:
        # NOTE: an object made with NativeIssuer.__new__ alone has no issuer;
        # every method checks here instead of dereferencing NULL.
        if self._issuer == NULL:
            raise RuntimeError("NativeIssuer is not initialised (its __init__ did not run)")
        return self._issuer

    @property
    def backend(self):
        return self._live().backend_name().decode()

    @property
    def worker_tid(self):
        """The worker thread's kernel id (Linux, once it has started;
        else 0), for ``os.sched_setaffinity``."""
        return self._live().worker_tid()

    @property
    def closed(self):
        return bool(self._live().closed())

    def submit(
        self,
        const int64_t[::1] src,
        const int64_t[::1] dst,
        object nbytes,
        const int64_t[::1] keys,
        int band,
    ):
        """Queue N copies in one band; returns N int64 tickets. ``nbytes`` is
        one int for all copies or an int64 array (one per copy, or one for
        all); ``keys`` are int64 (-1: never deduplicated)."""
        cdef Py_ssize_t n = src.shape[0]
        cdef int64_t one_size
        cdef const int64_t[::1] sizes
        cdef const int64_t* nbytes_ptr
        cdef size_t nbytes_stride = 0
        cdef Py_ssize_t n_sizes = 1
        # NOTE: a plain int needs no array (the engine's case: one expert size).
        if type(nbytes) is int:
            one_size = nbytes
            nbytes_ptr = &one_size
        else:
            sizes = nbytes
            n_sizes = sizes.shape[0]
            if n_sizes > 0:
                nbytes_ptr = &sizes[0]
                nbytes_stride = 0 if n_sizes == 1 else 1
        if dst.shape[0] != n or (n_sizes != 1 and n_sizes != n) or keys.shape[0] != n:
            raise ValueError(
                f"src, dst, nbytes and keys must have one length (nbytes may have 1); got {n}, "
                f"{dst.shape[0]}, {n_sizes}, {keys.shape[0]}"
            )
        out = np.empty(n, dtype=np.int64)
        if n == 0:
            if band < 0 or band >= kNumBands:
                raise ValueError(f"band {band} out of range [0, {kNumBands})")
            return out
        cdef int64_t[::1] tickets = out
        self._live()  # raises unless __init__ ran
        with nogil:
            self._issuer.submit(&src[0], &dst[0], nbytes_ptr, nbytes_stride,
                                <const uint64_t*>&keys[0], <size_t>n, band, &tickets[0])
        return out

    def states(self, const int64_t[::1] tickets):
        """uint8 states (0 queued, 1 running, 2 done, 3 failed, 4 cancelled)."""
        cdef Py_ssize_t n = tickets.shape[0]
        out = np.empty(n, dtype=np.uint8)
        if n == 0:
            return out
        cdef uint8_t[::1] o = out
        self._live()  # raises unless __init__ ran
        with nogil:
            self._issuer.states(&tickets[0], <size_t>n, &o[0])
        return out

    def wait(self, const int64_t[::1] tickets, double timeout_s=-1.0):
        """Block until all tickets are terminal; raises CopyFailedError,
        CopyCancelledError or TimeoutError. timeout_s < 0: forever."""
        cdef Py_ssize_t n = tickets.shape[0]
        cdef WaitResult r
        if n == 0:
            return
        self._live()  # raises unless __init__ ran
        with nogil:
            r = self._issuer.wait(&tickets[0], <size_t>n, timeout_s)
        _raise_for(r)

    def stream_wait(self, const int64_t[::1] tickets, uintptr_t stream, double timeout_s=-1.0):
        """CUDA: the stream waits for the tickets on the device (the host waits
        only until their last chunks are issued). Host backend: like wait()."""
        cdef Py_ssize_t n = tickets.shape[0]
        cdef WaitResult r
        if n == 0:
            return
        self._live()  # raises unless __init__ ran
        with nogil:
            r = self._issuer.stream_wait(&tickets[0], <size_t>n, stream, timeout_s)
        _raise_for(r)

    def cancel(self, int band=-1):
        """Cancel not-yet-started copies of a band (or all when band < 0)."""
        cdef int64_t n
        self._live()  # raises unless __init__ ran
        with nogil:
            n = self._issuer.cancel(band)
        return n

    def cancel_unstarted(self, const int64_t[::1] tickets):
        """Cancel each ticket's copy if none of its chunks started: a bool
        array, True where cancelled now (a started or finished copy runs on
        as before). ValueError on an unknown ticket, before any is cancelled."""
        cdef Py_ssize_t n = tickets.shape[0]
        out = np.zeros(n, dtype=np.uint8)
        if n == 0:
            return out.astype(np.bool_)
        cdef uint8_t[::1] o = out
        self._live()  # raises unless __init__ ran
        with nogil:
            self._issuer.cancel_unstarted(&tickets[0], <size_t>n, &o[0])
        return out.astype(np.bool_)

    def stats(self):
        """Raw counters; quantiles are NaN when a band has no samples."""
        cdef IssuerStats s
        self._live()  # raises unless __init__ ran
        with nogil:
            s = self._issuer.stats()
        bands = {}
        for b in range(kNumBands):
            bs = s.bands[b]
            bands[BAND_NAMES[b]] = {
                "copies": bs.copies,
                "bytes": bs.bytes,
                "submitted": bs.submitted,
                "dedup_hits": bs.dedup_hits,
                "promotions": bs.promotions,
                "cancellations": bs.cancellations,
                "failures": bs.failures,
                "blocked_wait_s": bs.blocked_wait_s,
                "delay_samples": bs.delay_samples,
                "queue_delay_p50_s": bs.queue_delay_p50_s,
                "queue_delay_p99_s": bs.queue_delay_p99_s,
            }
        return {
            "bands": bands,
            "link_busy_s": s.link_busy_s,
            "uptime_s": s.uptime_s,
            "chunks": s.chunks,
            "queued_copies": s.queued_copies,
            "queued_bytes": s.queued_bytes,
            "inflight_chunks": s.inflight_chunks,
            "inflight_bytes": s.inflight_bytes,
            "link_rate_estimate_bps": s.link_rate_estimate_bps,
            "submit_calls": s.submit_calls,
            "submit_lock_wait_s": s.submit_lock_wait_s,
            "submit_locked_s": s.submit_locked_s,
        }

    def link_state(self):
        """(queued copies, chunks in flight, link-rate estimate in bytes/s,
        0 before a chunk finished): the link now, without :meth:`stats`'
        per-band quantiles."""
        cdef LinkState s
        self._live()  # raises unless __init__ ran
        with nogil:
            s = self._issuer.link_state()
        return (s.queued_copies, s.inflight_chunks, s.link_rate_estimate_bps)

    def debug_log(self):
        """Every recorded event (needs debug_log=True) as a LOG_DTYPE array."""
        cdef vector[LogEvent] events
        self._live()  # raises unless __init__ ran
        with nogil:
            events = self._issuer.debug_log()
        if events.size() == 0:
            return np.empty(0, dtype=LOG_DTYPE)
        raw = PyBytes_FromStringAndSize(<char*>events.data(),
                                        <Py_ssize_t>(events.size() * sizeof(LogEvent)))
        return np.frombuffer(raw, dtype=LOG_DTYPE).copy()

    def note_pinned_region(self, uintptr_t ptr, size_t nbytes):
        """A valid copy source: [ptr, ptr+nbytes) is pinned host memory the
        caller allocated or registered itself (not checked with the backend)."""
        self._live().add_source_region(ptr, nbytes, False)

    def note_destination_region(self, uintptr_t ptr, size_t nbytes):
        """A valid copy destination, not checked with the backend (the host
        backend's own pinned buffers)."""
        self._live().add_destination_region(ptr, nbytes, False)

    cdef _add_region(self, bint source, uintptr_t ptr, size_t nbytes):
        """register_source/register_destination: one registration path for
        either end of a copy (``source`` picks the side and its book)."""
        cdef dict book = self._sources if source else self._destinations
        cdef str name = "register_source" if source else "register_destination"
        if ptr in book:
            raise ValueError(f"{name}: 0x{ptr:x} is already registered")
        if source:
            self._live().add_source_region(ptr, nbytes, True)
        else:
            self._live().add_destination_region(ptr, nbytes, True)
        book[ptr] = nbytes

    cdef int64_t _remove_region(self, bint source, uintptr_t ptr) except -1:
        """unregister_source/unregister_destination: cancel the region's
        copies not started, wait (GIL released) for the started ones, forget
        it. Returns how many were cancelled."""
        cdef dict book = self._sources if source else self._destinations
        cdef str name = "unregister_source" if source else "unregister_destination"
        cdef size_t nbytes
        cdef int64_t n
        if ptr not in book:
            raise ValueError(f"{name}: 0x{ptr:x} was not registered here")
        self._live()  # raises unless __init__ ran
        nbytes = book.pop(ptr)
        with nogil:
            if source:
                n = self._issuer.remove_source_region(ptr, nbytes)
            else:
                n = self._issuer.remove_destination_region(ptr, nbytes)
        return n

    def register_source(self, uintptr_t ptr, size_t nbytes):
        """A valid copy source: memory pinned by someone else (CUDA: both ends
        must be page-locked host memory; ValueError otherwise). Undone by
        unregister_source() or close()."""
        self._add_region(True, ptr, nbytes)

    def unregister_source(self, uintptr_t ptr):
        """Undo register_source(): copies from the region that have not
        started are cancelled, started ones waited for (GIL released).
        Returns how many were cancelled."""
        return self._remove_region(True, ptr)

    def register_destination(self, uintptr_t ptr, size_t nbytes):
        """A valid copy destination (CUDA: both ends must be device memory;
        ValueError otherwise). Undone by unregister_destination() or close()."""
        self._add_region(False, ptr, nbytes)

    def unregister_destination(self, uintptr_t ptr):
        """Undo register_destination(): copies into the region that have not
        started are cancelled, started ones waited for (GIL released).
        Returns how many were cancelled."""
        return self._remove_region(False, ptr)

    def release_region(self, uintptr_t ptr, size_t nbytes):
        """Before [ptr, ptr+nbytes) is freed or unregistered: cancel the copies
        from or into it not yet started, wait (GIL released) for the started
        ones, forget every source and destination region beginning inside it.
        Returns how many copies were cancelled."""
        cdef int64_t n
        self._live()  # raises unless __init__ ran
        with nogil:
            n = self._issuer.release_region(ptr, nbytes)
        return n

    def register_host(self, uintptr_t ptr, size_t nbytes):
        """cudaHostRegister an existing host region (no-op on the host backend);
        unregistered by unregister_host() or close()."""
        if ptr == 0 or nbytes == 0 or ptr + nbytes < ptr:
            raise ValueError(f"register_host: empty or wrapping region (ptr={ptr}, nbytes={nbytes})")
        if ptr in self._registered:
            raise ValueError(f"register_host: 0x{ptr:x} is already registered")
        with nogil:
            c_register_host(self.use_cuda, self.device, <void*>ptr, nbytes)
        self._registered[ptr] = nbytes
        self._live().add_source_region(ptr, nbytes, False)

    def unregister_host(self, uintptr_t ptr):
        """Undo register_host() once no copy reads the region any more (see
        release_region)."""
        cdef size_t nbytes
        if ptr not in self._registered:
            raise ValueError(f"unregister_host: 0x{ptr:x} was not registered here")
        nbytes = self._registered.pop(ptr)
        self._live()  # raises unless __init__ ran
        with nogil:
            self._issuer.release_region(ptr, nbytes)
            c_unregister_host(self.use_cuda, self.device, <void*>ptr)

    def test_hold_link(self, bint hold):
        """Host-backend test hook: hold the emulated link (queued chunks do
        not start) or release it. Returns False on the CUDA backend."""
        return bool(self._live().test_hold_link(hold))

    def test_inject_failures(self, int count, str text):
        """Host-backend test hook: the next `count` chunks fail with `text`."""
        cdef string t = text.encode()
        return bool(self._live().test_inject_failures(count, t))

    def close(self):
        """Cancel queued copies, drain in-flight chunks, stop the worker and
        free the stream/events/threads and registrations (host, source and
        destination). Idempotent."""
        self._live()  # raises unless __init__ ran
        with nogil:
            self._issuer.shutdown()
        for ptr in list(self._registered):
            self.unregister_host(ptr)
        for ptr in list(self._sources):
            self.unregister_source(ptr)
        for ptr in list(self._destinations):
            self.unregister_destination(ptr)
