"""Pure-Python reference of the H2D issuer's band-selection rule.

Used by differential tests only (never as a fallback for the native issuer):
:class:`BandOrderModel` replays the native issuer's debug log (one total
order of submit / promote / cancel / chunk start / chunk end / finish events)
and checks every chunk start against the rule the C++ worker must follow:

* the next chunk comes from the most urgent band that has queued chunks
  (``ON_DEMAND`` > ``ROUTE_AHEAD`` > ``BACKGROUND``), FIFO within a band by
  the time a copy entered the band (a promoted copy joins the tail of its new
  band), chunks of one copy in order;
* a copy of ``n`` bytes is split into ``k = ceil(n / chunk_bytes)`` equal
  chunks (:func:`split_piece_bytes`; the last one may be shorter);
* a chunk starts only if the window admits it: nothing in flight, or fewer
  than ``max_inflight_chunks`` in flight and in-flight bytes plus a full
  ``chunk_bytes`` within ``window_bytes`` (whatever the chunk's own size, so
  a two-chunk window holds two chunks of a copy split into smaller ones);
* chunks finish in start order (one copy stream).

So no lower-band chunk starts while a higher-band chunk is queued; only the
chunks already in the window can delay an urgent copy.

:class:`CopyRegions` is the reference of which batches ``submit`` accepts:
the issuer never touches memory it was not given.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pdflash.protocols import Band

# Mirrors pdflash_native._issuer.LOG_* (kept literal: the reference must not
# depend on the module it checks).
LOG_SUBMIT = 0
LOG_PROMOTE = 1
LOG_CANCEL = 2
LOG_START = 3
LOG_END = 4
LOG_FINISH = 5

NUM_BANDS = len(Band)


class ModelViolation(AssertionError):
    """The native issuer did something the reference rule forbids."""


@dataclass
class _Copy:
    ticket: int
    band: int
    nbytes: int
    next_chunk: int = 0
    issued_bytes: int = 0
    inflight: int = 0
    failed: bool = False

    def has_queued(self) -> bool:
        return not self.failed and self.issued_bytes < self.nbytes


@dataclass(frozen=True)
class LogRecord:
    kind: int
    band: int
    ticket: int
    chunk: int
    nbytes: int
    ok: bool


def records_from_log(log: Any) -> list[LogRecord]:
    """Convert the native structured log array to :class:`LogRecord`s."""
    return [
        LogRecord(
            int(e["kind"]),
            int(e["band"]),
            int(e["ticket"]),
            int(e["chunk"]),
            int(e["bytes"]),
            bool(e["ok"]),
        )
        for e in log
    ]


def split_piece_bytes(nbytes: int, chunk_bytes: int) -> int:
    """Chunk size of a copy: ``k = ceil(nbytes / chunk_bytes)`` equal pieces,
    rounded up to the alignment of ``chunk_bytes`` (its lowest set bit, at
    most 64 KiB), so never above ``chunk_bytes``; the last piece takes the
    rest (``nbytes - (k - 1) * piece``, at most ``piece``)."""
    if nbytes <= chunk_bytes:
        return nbytes
    k = -(-nbytes // chunk_bytes)
    align = min(chunk_bytes & -chunk_bytes, 64 << 10)
    piece = -(-nbytes // k)
    return -(-piece // align) * align


def next_chunk_size(nbytes: int, issued_bytes: int, chunk_bytes: int) -> int:
    return min(split_piece_bytes(nbytes, chunk_bytes), nbytes - issued_bytes)


class BandOrderModel:
    """Replays issuer events and raises :class:`ModelViolation` on the first
    one that breaks the band rule."""

    def __init__(self, chunk_bytes: int, window_bytes: int, max_inflight_chunks: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.window_bytes = window_bytes
        self.max_inflight_chunks = max_inflight_chunks
        self.queues: list[deque[int]] = [deque() for _ in range(NUM_BANDS)]
        self.copies: dict[int, _Copy] = {}
        self.inflight: deque[tuple[int, int, int]] = deque()  # (ticket, chunk, bytes)
        self.finished: dict[int, bool] = {}  # ticket -> ok
        self.cancelled: set[int] = set()
        self.starts: list[tuple[int, int, int]] = []  # (ticket, chunk, band) in order
        self.index = 0

    # -- the rule -------------------------------------------------------
    def pick(self) -> _Copy | None:
        """The copy whose next chunk the rule starts next, if any."""
        for q in self.queues:
            if q:
                return self.copies[q[0]]
        return None

    def admits(self) -> bool:
        if not self.inflight:
            return True
        inflight_bytes = sum(b for _, _, b in self.inflight)
        return (
            len(self.inflight) < self.max_inflight_chunks
            and inflight_bytes + self.chunk_bytes <= self.window_bytes
        )

    def queued_bytes_by_band(self) -> list[int]:
        return [
            sum(self.copies[t].nbytes - self.copies[t].issued_bytes for t in q) for q in self.queues
        ]

    # -- replay ---------------------------------------------------------
    def _fail(self, msg: str) -> None:
        raise ModelViolation(f"event {self.index}: {msg}")

    def _remove_from_queue(self, c: _Copy) -> None:
        q = self.queues[c.band]
        if c.ticket in q:
            q.remove(c.ticket)

    def apply(self, e: LogRecord) -> None:
        if e.kind == LOG_SUBMIT:
            if e.ticket in self.copies or e.ticket in self.finished:
                self._fail(f"ticket {e.ticket} submitted twice")
            c = _Copy(e.ticket, e.band, e.nbytes)
            expected_chunks = -(-e.nbytes // self.chunk_bytes)
            if e.chunk != expected_chunks:
                self._fail(f"ticket {e.ticket}: {e.chunk} chunks, expected {expected_chunks}")
            self.copies[e.ticket] = c
            self.queues[e.band].append(e.ticket)
        elif e.kind == LOG_PROMOTE:
            c = self._live(e.ticket)
            if not e.band < c.band:
                self._fail(f"ticket {e.ticket} 'promoted' from band {c.band} to {e.band}")
            if not c.has_queued():
                self._fail(f"ticket {e.ticket} promoted with nothing queued")
            self._remove_from_queue(c)
            c.band = e.band
            self.queues[e.band].append(c.ticket)
        elif e.kind == LOG_CANCEL:
            c = self._live(e.ticket)
            self._remove_from_queue(c)
            if c.inflight:
                self._fail(f"ticket {e.ticket} cancelled with chunks in flight")
            del self.copies[e.ticket]
            self.cancelled.add(e.ticket)
        elif e.kind == LOG_START:
            self._start(e)
        elif e.kind == LOG_END:
            self._end(e)
        elif e.kind == LOG_FINISH:
            c = self._live(e.ticket)
            if c.inflight:
                self._fail(f"ticket {e.ticket} finished with chunks in flight")
            if e.ok and (c.failed or c.issued_bytes != c.nbytes):
                self._fail(f"ticket {e.ticket} reported done but not fully copied")
            if not e.ok and not c.failed:
                self._fail(f"ticket {e.ticket} reported failed without a failed chunk")
            self._remove_from_queue(c)
            del self.copies[e.ticket]
            self.finished[e.ticket] = e.ok
        else:
            self._fail(f"unknown event kind {e.kind}")
        self.index += 1

    def _live(self, ticket: int) -> _Copy:
        c = self.copies.get(ticket)
        if c is None:
            self._fail(f"ticket {ticket} is not live")
            raise AssertionError  # unreachable; _fail raises
        return c

    def _start(self, e: LogRecord) -> None:
        want = self.pick()
        if want is None:
            self._fail(f"chunk of ticket {e.ticket} started with nothing queued")
            return
        queued = self.queued_bytes_by_band()
        if any(queued[b] for b in range(e.band)):
            self._fail(
                f"band {e.band} chunk started while more urgent bands hold {queued[: e.band]} "
                "queued bytes"
            )
        if e.ticket != want.ticket:
            self._fail(
                f"started ticket {e.ticket} (band {e.band}); the rule picks ticket "
                f"{want.ticket} (band {want.band})"
            )
        if e.band != want.band or e.chunk != want.next_chunk:
            self._fail(
                f"ticket {e.ticket}: chunk {e.chunk} in band {e.band}, expected chunk "
                f"{want.next_chunk} in band {want.band}"
            )
        size = next_chunk_size(want.nbytes, want.issued_bytes, self.chunk_bytes)
        if e.nbytes != size:
            self._fail(f"ticket {e.ticket} chunk {e.chunk}: {e.nbytes} bytes, expected {size}")
        if not self.admits():
            self._fail(
                f"ticket {e.ticket} chunk {e.chunk} started with a full window "
                f"({len(self.inflight)} chunks in flight)"
            )
        want.next_chunk += 1
        want.issued_bytes += size
        want.inflight += 1
        if want.issued_bytes == want.nbytes:
            self.queues[want.band].popleft()
        self.inflight.append((e.ticket, e.chunk, size))
        self.starts.append((e.ticket, e.chunk, e.band))

    def _end(self, e: LogRecord) -> None:
        key = (e.ticket, e.chunk, e.nbytes)
        if self.inflight and self.inflight[0] == key:
            self.inflight.popleft()
        elif not e.ok and self.inflight and self.inflight[-1] == key:
            self.inflight.pop()  # the enqueue itself failed: it never ran
        else:
            self._fail(f"chunk {e.chunk} of ticket {e.ticket} ended out of start order")
        c = self._live(e.ticket)
        c.inflight -= 1
        if not e.ok and not c.failed:
            c.failed = True
            self._remove_from_queue(c)  # its remaining chunks are dropped

    def replay(self, events: Iterable[LogRecord]) -> BandOrderModel:
        for e in events:
            self.apply(e)
        return self


class CopyRegions:
    """Reference of the issuer's memory rule: a copy of ``n`` bytes from
    ``src`` to ``dst`` is accepted only when ``n > 0``, neither pointer is
    null, ``[src, src + n)`` lies inside ONE source region and
    ``[dst, dst + n)`` inside ONE destination region (regions may overlap or
    repeat; a range across two adjacent regions is outside both).

    :meth:`check` returns the copy the native submit names when it rejects a
    batch, in its order: first any copy with ``n <= 0`` or a null pointer
    (checked over the whole batch before the lock), then, copy by copy, the
    source range, then the destination range.
    """

    def __init__(self) -> None:
        self.sources: list[tuple[int, int]] = []  # (begin, end)
        self.destinations: list[tuple[int, int]] = []

    def add_source(self, begin: int, nbytes: int) -> None:
        self.sources.append((begin, begin + nbytes))

    def add_destination(self, begin: int, nbytes: int) -> None:
        self.destinations.append((begin, begin + nbytes))

    @staticmethod
    def inside(regions: list[tuple[int, int]], ptr: int, nbytes: int) -> bool:
        return any(b <= ptr and ptr + nbytes <= e for b, e in regions)

    def check(self, src: list[int], dst: list[int], nbytes: list[int]) -> tuple[int, str] | None:
        """None when the batch is accepted, else ``(copy index, what)`` with
        ``what`` one of ``"nbytes"``, ``"null"``, ``"source"``,
        ``"destination"``."""
        for i, (s, d, n) in enumerate(zip(src, dst, nbytes, strict=True)):
            if n <= 0:
                return i, "nbytes"
            if s == 0 or d == 0:
                return i, "null"
        for i, (s, d, n) in enumerate(zip(src, dst, nbytes, strict=True)):
            if not self.inside(self.sources, s, n):
                return i, "source"
            if not self.inside(self.destinations, d, n):
                return i, "destination"
        return None
