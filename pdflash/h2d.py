"""The H2D expert-copy issuer: named priority bands enforced in software.

:class:`H2DIssuer` implements :class:`pdflash.protocols.CopyIssuer` over the
C++ issuer in ``cuda/`` (binding: ``pdflash_native._issuer``).

Why software bands: on the H200, CUDA stream priority does not reorder copies
(a top-priority 16 MiB copy behind a 1 GiB low-priority backlog finished after
all of it). The issuer keeps a small window of bytes in flight on ONE copy
stream and picks the next chunk by band (``ON_DEMAND`` > ``ROUTE_AHEAD`` >
``BACKGROUND``), FIFO within a band; a C++ worker thread keeps the window full.

Defaults: ``chunk_bytes`` = 8 MiB, ``window_bytes`` = 16 MiB (two chunks in
flight), and on CUDA a just-in-time lead of 20 us. From the H200 sweep
(``pdflash-bench h2d --json --sweep``, run 2 of 2026-11-29,
``bench/results/h200/2026-11-29-run2.jsonl``): 8 MiB / 16 MiB was the only
setting meeting all three targets (16 MiB on-demand copy under a 512 MiB
backlog at 1.13x its alone latency, background at 92.1% and 9 MiB expert
copies at 95.0% of the link peak); 4 MiB / 8 MiB (the previous default) gave
1.19x, 89.5%, 92.3%. But that run submitted the on-demand copy at a fixed
delay after the backlog, i.e. at one phase of the chunk pattern; with random
arrivals the emulated-link sweep (same scenario, sizes / 4) gives 8 / 16 MiB
1.36x without a lead and 1.13x with one, so the CUDA default has a lead (see
:data:`DEFAULT_CUDA_ISSUE_LEAD_US`). A copy is split into
``ceil(nbytes / chunk_bytes)`` equal chunks (a 9 MiB expert: 2 x 4.5 MiB),
and the window admits a chunk only while in-flight bytes plus a full
``chunk_bytes`` fit, so it holds two chunks whatever their size. The tables
and caveats (a fixed ~4.7 us per chunk caps expert-copy bandwidth by chunks
per expert) are in ``cuda/README.md``; ``--sweep`` re-measures every
trade-off side by side.

The issuer never touches memory it was not given: every copy's source must
lie inside one source region (a buffer from :meth:`H2DIssuer.alloc_pinned` /
:meth:`H2DIssuer.pinned_array`, or a range given to
:meth:`H2DIssuer.register_host` or :meth:`H2DIssuer.register_source`) and
its destination inside one destination region (a range given to
:meth:`H2DIssuer.register_destination`; on the host backend also the
issuer's own pinned buffers, its stand-in for device memory). A batch with
one copy outside them is rejected whole (ValueError naming the copy, its
range and the nearest region) before anything is queued.

Example::

    with H2DIssuer() as issuer:
        host = issuer.pinned_array((num_experts, expert_nbytes), np.uint8)
        slots = torch.empty((num_slots, expert_nbytes), dtype=torch.uint8, device="cuda")
        issuer.register_destination(slots.data_ptr(), slots.numel())
        tickets = issuer.submit(src_ptrs, dst_ptrs, nbytes, keys, Band.ROUTE_AHEAD)
        issuer.stream_wait(tickets, torch.cuda.current_stream().cuda_stream)
"""

from __future__ import annotations

import functools
import math
import weakref
from types import TracebackType
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import numpy.typing as npt

from pdflash import protocols
from pdflash._native import load_native
from pdflash.metrics import NotMeasured
from pdflash.protocols import Band, LinkState

if TYPE_CHECKING:
    import torch

    # mypy types every call against the checked stub (_issuer.pyi)
    from pdflash_native import _issuer as _native
else:
    _native = load_native("_issuer")

# The copy errors and ticket states live in pdflash.protocols (the issuer's
# contract); the names stay importable from here.
CopyFailedError = protocols.CopyFailedError
CopyCancelledError = protocols.CopyCancelledError
PinnedBuffer = _native.PinnedBuffer

DEFAULT_CHUNK_BYTES = 8 << 20
DEFAULT_WINDOW_BYTES = 16 << 20
DEFAULT_MAX_INFLIGHT_CHUNKS = 32
#: Just-in-time issue lead of the CUDA backend (us): the second chunk of the
#: window is queued only when the running one is about to end, so an urgent
#: copy arriving at a random phase waits behind one chunk, not two. A few tens
#: of microseconds exceed the worker's reaction time on CUDA without leaving
#: the copy engine idle (the H200 sweep behind this value:
#: bench/results/h200/README.md).
DEFAULT_CUDA_ISSUE_LEAD_US = 20.0
#: Host backend with an emulated link: the lead as a fraction of one chunk's
#: time on that link (none without one). A CPU worker wakes up tens to
#: hundreds of microseconds late, so the lead scales with the chunk time
#: (measured in bench/results/host/).
DEFAULT_HOST_ISSUE_LEAD_FRACTION = 0.1

#: Ticket states returned by :meth:`H2DIssuer.states` (the native codes; the
#: same values as :class:`pdflash.protocols.TicketState`).
STATE_QUEUED = _native.STATE_QUEUED
STATE_RUNNING = _native.STATE_RUNNING
STATE_DONE = _native.STATE_DONE
STATE_FAILED = _native.STATE_FAILED
STATE_CANCELLED = _native.STATE_CANCELLED


def cuda_available() -> bool:
    """True when this build has the CUDA backend and a CUDA device is visible."""
    return bool(_native.built_with_cuda()) and _native.cuda_device_count() > 0


def native_live_counts() -> dict[str, int]:
    """Live native issuers, threads, pinned allocations and registrations
    (all zero once every issuer is closed and every buffer released)."""
    return dict(_native.live_counts())


def _release_region(native_ref: weakref.ReferenceType[Any], ptr: int, nbytes: int) -> None:
    # NOTE: a weak reference: a pinned buffer does not keep its issuer alive.
    native = native_ref()
    if native is not None:
        native.release_region(ptr, nbytes)


_I64 = np.dtype(np.int64)
_U64 = np.dtype(np.uint64)


def _as_i64(name: str, value: npt.ArrayLike, n: int | None = None) -> npt.NDArray[np.int64]:
    # Fast path (the common case of a per-block submit): already a 1-D
    # contiguous int64 array, used as is.
    if (
        type(value) is np.ndarray
        and value.dtype == _I64
        and value.ndim == 1
        and value.flags.c_contiguous
    ):
        return value
    arr = np.asarray(value)
    if arr.ndim == 0 and n is not None:
        # NOTE: one element: the native call applies it to every copy (no
        # n-element array to fill per submit).
        return np.array([int(arr)], dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.dtype != np.int64:
        if arr.dtype.kind not in "iu" and arr.size:
            raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
        arr = arr.astype(np.int64)
    return np.ascontiguousarray(arr)


class H2DIssuer:
    """Host-to-device copies in named priority bands (see the module docs).

    Args:
        backend: ``"cuda"``, ``"host"`` or None (CUDA when this build has it
            and a device is present, else host).
        device: CUDA device ordinal (CUDA backend).
        chunk_bytes: (at most 1 GiB) a copy is split into ``ceil(nbytes / chunk_bytes)``
            equal chunks (none larger than this); an on-demand copy waits
            about one window of chunks at most.
        window_bytes: bytes in flight on the copy stream (>= chunk_bytes): a
            chunk starts while in-flight bytes plus ``chunk_bytes`` fit.
        max_inflight_chunks: chunk limit of the window, for many small copies.
        emulated_link_gbps: host backend only: throttle the memcpy "link" to
            this bandwidth (GB/s, 1e9 B/s) so band physics shows on a CPU;
            None copies at memcpy speed.
        debug_log: record every submit/promote/cancel/start/end event
            (:meth:`debug_log`), for tests; costs memory per chunk.
        issue_lead_us: just-in-time issue (0: off; None: the backend's
            default: :data:`DEFAULT_CUDA_ISSUE_LEAD_US` on CUDA; on host
            :data:`DEFAULT_HOST_ISSUE_LEAD_FRACTION` of one chunk's time on
            the emulated link, off without one).
            With a two-chunk window a whole chunk waits queued behind the
            running one, so an urgent copy arriving waits ~1.5 chunks. With a
            lead L, one more chunk is queued only when the in-flight ones are
            estimated (link rate measured from finished chunks) to drain
            within L microseconds: the next chunk is chosen by band as late
            as possible while the copy engine never idles. L must exceed the
            worker's reaction time (a few us on CUDA; far more on a busy CPU,
            hence off on the host backend).
    """

    def __init__(
        self,
        *,
        backend: str | None = None,
        device: int = 0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        window_bytes: int = DEFAULT_WINDOW_BYTES,
        max_inflight_chunks: int = DEFAULT_MAX_INFLIGHT_CHUNKS,
        emulated_link_gbps: float | None = None,
        debug_log: bool = False,
        issue_lead_us: float | None = None,
    ) -> None:
        if backend is None:
            backend = "cuda" if cuda_available() else "host"
        if backend not in ("cuda", "host"):
            raise ValueError(f"backend must be 'cuda', 'host' or None, got {backend!r}")
        if backend == "cuda":
            if not _native.built_with_cuda():
                raise RuntimeError("backend='cuda' but pdflash was built without CUDA")
            if _native.cuda_device_count() == 0:
                raise RuntimeError("backend='cuda' but no CUDA device is visible")
            if emulated_link_gbps is not None:
                raise ValueError("emulated_link_gbps applies to the host backend only")
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
        if window_bytes < chunk_bytes:
            raise ValueError(
                f"window_bytes ({window_bytes}) must be >= chunk_bytes ({chunk_bytes})"
            )
        if emulated_link_gbps is not None and not (
            math.isfinite(emulated_link_gbps) and emulated_link_gbps > 0
        ):
            raise ValueError(f"emulated_link_gbps must be > 0, got {emulated_link_gbps}")
        if issue_lead_us is None:
            if backend == "cuda":
                issue_lead_us = DEFAULT_CUDA_ISSUE_LEAD_US
            elif emulated_link_gbps:
                chunk_us = chunk_bytes / (emulated_link_gbps * 1e3)
                issue_lead_us = DEFAULT_HOST_ISSUE_LEAD_FRACTION * chunk_us
            else:
                issue_lead_us = 0.0
        if not (math.isfinite(issue_lead_us) and issue_lead_us >= 0):
            raise ValueError(f"issue_lead_us must be >= 0, got {issue_lead_us}")
        self._native = _native.NativeIssuer(
            backend == "cuda",
            device,
            chunk_bytes,
            window_bytes,
            max_inflight_chunks,
            emulated_link_gbps or 0.0,
            debug_log,
            issue_lead_us * 1e-6,
        )
        self._backend = backend
        self._device = device
        self.chunk_bytes = chunk_bytes
        self.window_bytes = window_bytes
        self.max_inflight_chunks = max_inflight_chunks
        self.emulated_link_gbps = emulated_link_gbps
        self.issue_lead_us = issue_lead_us

    # ------------------------------------------------------------------ info
    @property
    def backend(self) -> str:
        """``"cuda"`` or ``"host"``."""
        return self._backend

    @property
    def device(self) -> int:
        return self._device

    @property
    def worker_tid(self) -> int:
        """The native worker thread's kernel id (Linux, once it has started;
        else 0): where :mod:`pdflash.hybrid.affinity` places it."""
        return int(self._native.worker_tid)

    @property
    def closed(self) -> bool:
        return bool(self._native.closed)

    # ---------------------------------------------------------------- copies
    def submit(
        self,
        src: npt.ArrayLike,
        dst: npt.ArrayLike,
        nbytes: npt.ArrayLike,
        keys: npt.ArrayLike,
        band: Band,
    ) -> npt.NDArray[np.int64]:
        """Queue N copies (src/dst addresses, byte counts, dedup keys) in one
        band with one native call (GIL released); returns N int64 tickets.

        ``nbytes`` may be a scalar (every copy that size). A key already
        queued or running is not copied twice: its ticket is returned and a
        more urgent band promotes its not-yet-started chunks. Key ``-1``
        never deduplicates. Each copy's source range must lie inside one
        source region (:meth:`alloc_pinned`, :meth:`register_host`,
        :meth:`register_source`) and its destination range inside one
        destination region (:meth:`register_destination`; on the host
        backend also the issuer's pinned buffers); otherwise ValueError names
        the copy, its range and the nearest region. A rejected call changes
        nothing (no copy of it is queued).
        """
        # NOTE: fast path, the engine's call (int64 address and key arrays, one
        # int size, a Band): straight to the native call, which checks
        # everything itself. Anything else (lists, other dtypes, a bad band)
        # is normalised below, with errors that name the argument; a rejected
        # call changes nothing, so trying twice is safe.
        if type(nbytes) is int or type(nbytes) is np.ndarray:
            try:
                # the casts only name what the native call then checks itself
                fast = self._native.submit(
                    cast("npt.NDArray[np.int64]", src),
                    cast("npt.NDArray[np.int64]", dst),
                    nbytes,
                    cast("npt.NDArray[np.int64]", keys),
                    band,
                )
                return fast
            except (TypeError, ValueError, OverflowError, BufferError):
                pass
        src_a = _as_i64("src", src)
        n = src_a.shape[0]
        dst_a = _as_i64("dst", dst)
        nbytes_a = _as_i64("nbytes", nbytes, n)
        keys_a = keys if type(keys) is np.ndarray else np.asarray(keys)
        if keys_a.dtype == _U64:
            keys_a = keys_a.view(np.int64)
        keys_a = _as_i64("keys", keys_a)
        band_i = int(band)
        if not 0 <= band_i <= 2:
            raise ValueError(f"band must be a pdflash.protocols.Band, got {band!r}")
        result: npt.NDArray[np.int64] = self._native.submit(src_a, dst_a, nbytes_a, keys_a, band_i)
        return result

    def states(self, tickets: npt.ArrayLike) -> npt.NDArray[np.uint8]:
        """Per-ticket state: ``STATE_QUEUED``, ``STATE_RUNNING``, ``STATE_DONE``,
        ``STATE_FAILED`` or ``STATE_CANCELLED``; ValueError on an unknown ticket."""
        out: npt.NDArray[np.uint8] = self._native.states(_as_i64("tickets", tickets))
        return out

    def poll(self, tickets: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        """True where the copy has finished (done, failed or cancelled), without
        blocking; :meth:`wait` raises for failed or cancelled ones."""
        return self.states(tickets) >= STATE_DONE

    def wait(self, tickets: npt.ArrayLike, timeout_s: float | None = None) -> None:
        """Block (GIL released) until all tickets finish. Raises
        :class:`CopyFailedError` (with the CUDA error text),
        :class:`CopyCancelledError`, or ``TimeoutError``. The blocked time is
        counted as exposed fetch time of the most urgent pending band."""
        self._native.wait(_as_i64("tickets", tickets), _timeout(timeout_s))

    def stream_wait(
        self, tickets: npt.ArrayLike, stream_handle: int, timeout_s: float | None = None
    ) -> None:
        """Make a CUDA stream (raw ``cudaStream_t``, e.g. torch's
        ``stream.cuda_stream``) wait for the tickets on the device, without a
        host sync once their last chunks are issued (a ticket still queued
        blocks the host until the issuer issues it). On the host backend
        this waits on the host. A copy that fails after the stream was told
        to wait is reported by :meth:`wait`/:meth:`poll`, not here."""
        self._native.stream_wait(
            _as_i64("tickets", tickets), int(stream_handle), _timeout(timeout_s)
        )

    def cancel(self, band: Band | None = None) -> int:
        """Cancel queued copies with no chunk started, of one band or all;
        returns how many. Started copies complete. The issuer stays usable."""
        if band is None:
            return int(self._native.cancel(-1))
        band_i = int(band)
        if band_i not in (0, 1, 2):
            raise ValueError(f"band must be a pdflash.protocols.Band or None, got {band!r}")
        return int(self._native.cancel(band_i))

    def cancel_unstarted(self, tickets: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        """Cancel the copies of ``tickets`` none of whose chunks has started:
        True where cancelled now; a started or finished copy runs on as
        before. ValueError on an unknown ticket (none is cancelled then)."""
        out: npt.NDArray[np.bool_] = self._native.cancel_unstarted(_as_i64("tickets", tickets))
        return out

    def reset(self) -> int:
        """Cancel everything not yet started (non-terminal); returns how many."""
        return self.cancel(None)

    # ----------------------------------------------------------------- stats
    def stats(self) -> dict[str, Any]:
        """Per-band counters and link busy time.

        ``bands[name]``: ``copies``/``bytes`` (completed), ``submitted``,
        ``dedup_hits``, ``promotions`` (into the band), ``cancellations``,
        ``failures``, ``blocked_wait_s`` (time callers were blocked in
        wait/stream_wait, charged to the most urgent pending band: exposed
        fetch seconds), ``queue_delay_p50_s``/``queue_delay_p99_s`` (submit to
        first chunk start over the band's last 65536 copies;
        :class:`~pdflash.metrics.NotMeasured` without samples).
        Top level: ``link_busy_s`` (summed chunk time on the link: CUDA event
        time, or the emulated link's time), ``uptime_s``, ``chunks``,
        ``queued_copies``, ``queued_bytes`` (not yet issued), ``inflight_chunks``,
        ``link_rate_estimate_bps``, ``inflight_bytes``, ``submit_calls``,
        ``submit_lock_wait_s``/``submit_locked_s`` (cumulative time submits
        waited for and held the issuer's lock), ``backend``, ``chunk_bytes``,
        ``window_bytes``.
        """
        raw: dict[str, Any] = self._native.stats()
        for name, band in raw["bands"].items():
            for q in ("queue_delay_p50_s", "queue_delay_p99_s"):
                if math.isnan(band[q]):
                    band[q] = NotMeasured(f"no {name} copy has started yet")
        raw["backend"] = self._backend
        raw["chunk_bytes"] = self.chunk_bytes
        raw["window_bytes"] = self.window_bytes
        return raw

    def link_state(self) -> LinkState:
        """The link now: what :meth:`stats` says of the queue, the chunks in
        flight and the link rate, without its per-band quantiles (which copy
        and sort each band's window of up to 65536 samples: ~0.3 ms a band
        once full). Cheap enough for every engine step."""
        queued, inflight, rate = self._native.link_state()
        return LinkState(int(queued), int(inflight), float(rate) if rate > 0 else None)

    def debug_log(self) -> npt.NDArray[np.void]:
        """Recorded events in one total order (``debug_log=True`` only):
        fields ``t_s, kind, band, ticket, chunk, bytes, ok``; kinds are
        ``pdflash_native._issuer.LOG_*``."""
        out: npt.NDArray[np.void] = self._native.debug_log()
        return out

    # ----------------------------------------------------------- host memory
    def alloc_pinned(self, nbytes: int) -> Any:
        """Page-locked host memory (``cudaHostAlloc`` on the CUDA backend, a
        page-aligned prefaulted allocation on host) as a ``PinnedBuffer``
        (``.ptr``, ``.nbytes``, buffer protocol): a copy source region, and on
        the host backend also a destination region (the host backend's
        stand-in for device memory; on CUDA copies go to device memory only).
        Freed with its last reference or ``free()``; before that, copies from
        or into it that have not started are cancelled and started ones
        waited for."""
        if nbytes <= 0:
            raise ValueError(f"nbytes must be > 0, got {nbytes}")
        release = functools.partial(_release_region, weakref.ref(self._native))
        buf = PinnedBuffer(nbytes, self._backend == "cuda", self._device, release)
        self._native.note_pinned_region(buf.ptr, nbytes)
        if self._backend == "host":
            self._native.note_destination_region(buf.ptr, nbytes)
        return buf

    def pinned_array(
        self, shape: int | tuple[int, ...], dtype: npt.DTypeLike = np.uint8
    ) -> npt.NDArray[Any]:
        """A NumPy array over fresh pinned memory (``torch.from_numpy`` can
        wrap it); the memory lives as long as the array."""
        dt = np.dtype(dtype)
        shape_t = (shape,) if isinstance(shape, int) else tuple(shape)
        count = int(np.prod(shape_t, dtype=np.int64))
        nbytes = count * dt.itemsize
        buf = self.alloc_pinned(max(nbytes, 1))
        flat = np.frombuffer(buf, dtype=np.uint8, count=nbytes)
        return flat.view(dt).reshape(shape_t)

    def register_host(self, ptr: int, nbytes: int) -> None:
        """Pin an existing host region (``cudaHostRegister``; bookkeeping only
        on the host backend) so it can be a copy source. Undone by
        :meth:`unregister_host` or :meth:`close`."""
        self._native.register_host(int(ptr), int(nbytes))

    def unregister_host(self, ptr: int) -> None:
        """Undo :meth:`register_host`: copies from the region that have not
        started are cancelled, started ones waited for, then it is unpinned."""
        self._native.unregister_host(int(ptr))

    def register_source(self, ptr: int, nbytes: int) -> None:
        """Make host memory that is already page-locked elsewhere (e.g. torch's
        ``pin_memory()``, a ``cudaHostRegister`` of the caller's) a copy
        source region. On the CUDA backend both ends must be pinned
        (ValueError otherwise); bookkeeping only on the host backend. Undone
        by :meth:`unregister_source` or :meth:`close`."""
        self._native.register_source(int(ptr), int(nbytes))

    def unregister_source(self, ptr: int) -> int:
        """Undo :meth:`register_source` (before the memory goes away): copies
        from it that have not started are cancelled (returns how many),
        started ones waited for."""
        return int(self._native.unregister_source(int(ptr)))

    def register_destination(self, ptr: int, nbytes: int) -> None:
        """Let copies write into ``[ptr, ptr + nbytes)``: device memory on the
        CUDA backend (checked at both ends: ValueError for host memory), any
        host memory the caller owns on the host backend. Undone by
        :meth:`unregister_destination` or :meth:`close`."""
        self._native.register_destination(int(ptr), int(nbytes))

    def unregister_destination(self, ptr: int) -> int:
        """Undo :meth:`register_destination` (before the memory is freed):
        copies into it that have not started are cancelled (returns how
        many), started ones waited for."""
        return int(self._native.unregister_destination(int(ptr)))

    # ------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Cancel queued copies, let in-flight chunks finish, stop the worker,
        free the stream/events/threads, unregister every host, source and
        destination region. Idempotent."""
        self._native.close()

    def __enter__(self) -> H2DIssuer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return (
            f"H2DIssuer(backend={self._backend!r}, chunk_bytes={self.chunk_bytes}, "
            f"window_bytes={self.window_bytes}, {state})"
        )


#: Seconds one pass of the link probe takes on an emulated (throttled) link.
LINK_PROBE_S = 0.25


def measure_link_gbps(issuer: H2DIssuer, device: torch.device, nbytes: int = 256 << 20) -> float:
    """Host->device bandwidth through ``issuer`` now (one bulk transfer of
    pinned memory split into 16 MiB copies in the BACKGROUND band, after an
    untimed first pass), in GB/s (1e9 B/s). Off CUDA the probe is at most
    32 MiB, and on an emulated link about :data:`LINK_PROBE_S` long."""
    import time

    import torch

    if device.type != "cuda":
        nbytes = min(nbytes, 32 << 20)
        emulated = issuer.emulated_link_gbps
        if emulated:
            nbytes = min(nbytes, max(1 << 20, int(emulated * 1e9 * LINK_PROBE_S)))
    src = issuer.pinned_array(nbytes, np.uint8)
    src[:] = 1
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    issuer.register_destination(dst.data_ptr(), nbytes)
    try:
        piece = 16 << 20
        n = -(-nbytes // piece)
        offsets = np.arange(n, dtype=np.int64) * piece
        sizes = np.minimum(piece, nbytes - offsets).astype(np.int64)
        keys = np.arange(n, dtype=np.int64) + (1 << 60)
        # the first pass pays first touch and stream creation; the second is timed
        elapsed = 0.0
        for attempt in range(2):
            t0 = time.perf_counter()
            tickets = issuer.submit(
                src.ctypes.data + offsets,
                dst.data_ptr() + offsets,
                sizes,
                keys + attempt * n,
                Band.BACKGROUND,
            )
            issuer.wait(tickets)
            elapsed = time.perf_counter() - t0
    finally:
        issuer.unregister_destination(dst.data_ptr())
    return nbytes / elapsed / 1e9


def _timeout(timeout_s: float | None) -> float:
    if timeout_s is None:
        return -1.0
    if not (timeout_s >= 0):
        raise ValueError(f"timeout_s must be >= 0 or None, got {timeout_s}")
    # NOTE: C++ turns the seconds into a steady_clock deadline; inf (or a
    # value past ~30 years) would overflow it, so it means "no timeout".
    if timeout_s > 1e9:
        return -1.0
    return float(timeout_s)
