# cython: language_level=3, auto_pickle=False
"""The expert cache's books: one native call per bookkeeping step.

:class:`CacheBooks` holds typed views of an expert cache's arrays (the
cache's own numpy arrays: every write lands in them) and does each step of
its bookkeeping (a lookup, a pin update, an eviction's or a load's writes)
in one call instead of several numpy calls. Decisions stay with the cache
and its eviction policy; this only reads and writes the arrays. The
pure-Python reference is :class:`pdflash._reference.cachebooks.CacheBooks`
(same methods, same results; a differential test drives both).

Contracts: a method that raises changes nothing; every index that comes
from a caller is range-checked; an id or slot listed twice in one call is
handled as numpy's fancy indexing handles it (a pin added once, counts
taken before any write), so the reference's numpy code is the spec.

Not thread-safe: the cache is single-threaded (its BusyGuard).
"""

from cpython.buffer cimport (
    PyBUF_C_CONTIGUOUS,
    PyBUF_FORMAT,
    PyBUF_WRITABLE,
    PyBuffer_Release,
    PyObject_GetBuffer,
)
from libc.stdint cimport int32_t, int64_t, uint8_t
from libc.stdlib cimport free, malloc, qsort

import numpy as np


cdef inline int _check(const int64_t[:] values, int64_t limit, str what) except -1:
    cdef Py_ssize_t i
    for i in range(values.shape[0]):
        if values[i] < 0 or values[i] >= limit:
            raise IndexError(f"{what} {values[i]} out of range [0, {limit})")
    return 0


cdef int _bool_buffer(object arr, Py_buffer* view, int flags, str name) except -1:
    """``view`` of a C-contiguous numpy bool array (typed memoryviews do not
    take numpy's '?' format; this costs no ``.view`` call). Release it."""
    PyObject_GetBuffer(arr, view, flags | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS)
    if view.itemsize != 1 or view.format == NULL or view.format[0] != 63 or view.format[1] != 0:
        PyBuffer_Release(view)
        raise TypeError(f"{name} must be a bool numpy array")
    return 0


cdef class CacheBooks:
    """The books over a cache's arrays (see :mod:`pdflash.cache.expert_cache`).

    ``used``, ``counted`` and ``by_prefetch`` are bool arrays; the others
    int64 except ``pins`` (int32). All one-dimensional and C-contiguous.
    """

    def __init__(
        self, slot_of, expert_of, pins, ticket, key, band, used, counted, by_prefetch,
        int64_t num_experts,
    ):
        for name, arr in (("used", used), ("counted", counted), ("by_prefetch", by_prefetch)):
            if not isinstance(arr, np.ndarray) or arr.dtype != np.bool_:
                raise TypeError(f"{name} must be a bool numpy array")
        self.slot_of = slot_of
        self.expert_of = expert_of
        self.pins = pins
        self.ticket = ticket
        self.key = key
        self.band = band
        # views of the same memory: the cache's bool arrays stay bool
        self.used = used.view(np.uint8)
        self.counted = counted.view(np.uint8)
        self.by_prefetch = by_prefetch.view(np.uint8)
        self.num_ids = self.slot_of.shape[0]
        self.num_slots = self.expert_of.shape[0]
        for name, n in (
            ("pins", self.pins.shape[0]), ("ticket", self.ticket.shape[0]),
            ("key", self.key.shape[0]), ("band", self.band.shape[0]),
            ("used", self.used.shape[0]), ("counted", self.counted.shape[0]),
            ("by_prefetch", self.by_prefetch.shape[0]),
        ):
            if n != self.num_slots:
                raise ValueError(f"{name} has {n} entries for {self.num_slots} slots")
        if num_experts < 1 or self.num_ids % num_experts:
            raise ValueError(f"num_experts {num_experts} does not divide {self.num_ids} ids")
        self.num_experts = num_experts
        self.seen = np.zeros(num_experts, dtype=np.int64)
        self.no_ids = np.zeros(0, dtype=np.int64)
        self.no_ids.flags.writeable = False
        self.mark = np.zeros(self.num_slots, dtype=np.uint8)

    # -- ids ---------------------------------------------------------------

    def first_bad_id(self, const int64_t[:] ids):
        """Position of the first id outside ``[0, num_ids)``; -1 if none."""
        cdef Py_ssize_t i
        cdef int64_t n = self.num_ids
        for i in range(ids.shape[0]):
            if ids[i] < 0 or ids[i] >= n:
                return i
        return -1

    @staticmethod
    def strictly_increasing(const int64_t[:] ids):
        cdef Py_ssize_t i
        for i in range(1, ids.shape[0]):
            if ids[i] <= ids[i - 1]:
                return False
        return True

    # -- copies in flight --------------------------------------------------

    def inflight(self):
        """The slots whose copy is in flight and their tickets."""
        cdef Py_ssize_t s, n = 0
        for s in range(self.num_slots):
            if self.ticket[s] >= 0:
                n += 1
        if n == 0:  # the common case: no allocation
            return self.no_ids, self.no_ids
        busy = np.empty(n, dtype=np.int64)
        tickets = np.empty(n, dtype=np.int64)
        cdef int64_t[::1] b = busy
        cdef int64_t[::1] t = tickets
        n = 0
        for s in range(self.num_slots):
            if self.ticket[s] >= 0:
                b[n] = s
                t[n] = self.ticket[s]
                n += 1
        return busy, tickets

    def settle(self, const int64_t[:] busy, const uint8_t[:] states, int done_code):
        """Clear the tickets of ``busy`` slots whose state is ``done_code``;
        return the unpinned ones whose state is past it (failed/cancelled)."""
        cdef Py_ssize_t i, n = busy.shape[0], nbad = 0
        if states.shape[0] != n:
            raise ValueError(f"{states.shape[0]} states for {n} slots")
        _check(busy, self.num_slots, "slot")
        for i in range(n):
            if states[i] > done_code and self.pins[busy[i]] == 0:
                nbad += 1
        bad = np.empty(nbad, dtype=np.int64)
        cdef int64_t[::1] out = bad
        nbad = 0
        for i in range(n):
            if states[i] > done_code and self.pins[busy[i]] == 0:
                out[nbad] = busy[i]
                nbad += 1
        for i in range(n):
            if states[i] == done_code:
                self.ticket[busy[i]] = -1
        return bad

    # -- capacity ----------------------------------------------------------

    cdef bint _evictable(self, Py_ssize_t s) noexcept nogil:
        return self.expert_of[s] >= 0 and self.pins[s] == 0 and self.ticket[s] < 0

    cdef Py_ssize_t _mark_excluded(self, const int64_t[:] exclude, uint8_t value) except -1:
        """Set the scratch mark of each held ``exclude`` id's slot to ``value``."""
        cdef Py_ssize_t i
        cdef int64_t s
        for i in range(exclude.shape[0]):
            s = self.slot_of[exclude[i]]
            if s >= 0:
                self.mark[s] = value
        return 0

    def available(self, const int64_t[:] exclude):
        """Free slots plus evictable ones (held, unpinned, no copy in
        flight), not counting the slots of ``exclude`` ids."""
        cdef Py_ssize_t s, n = 0
        _check(exclude, self.num_ids, "expert")
        self._mark_excluded(exclude, 1)
        for s in range(self.num_slots):
            if self.expert_of[s] < 0 or (self._evictable(s) and not self.mark[s]):
                n += 1
        self._mark_excluded(exclude, 0)
        return n

    def evictable(self, const int64_t[:] exclude):
        """The evictable slots (see :meth:`available`), ascending."""
        return self._evictable_list(exclude, False)

    def evictable_ids(self, const int64_t[:] exclude):
        """The experts of :meth:`evictable`'s slots, in that order."""
        return self._evictable_list(exclude, True)

    cdef object _evictable_list(self, const int64_t[:] exclude, bint ids):
        cdef Py_ssize_t s, n = 0
        _check(exclude, self.num_ids, "expert")
        self._mark_excluded(exclude, 1)
        for s in range(self.num_slots):
            if self._evictable(s) and not self.mark[s]:
                n += 1
        out = np.empty(n, dtype=np.int64)
        cdef int64_t[::1] o = out
        n = 0
        for s in range(self.num_slots):
            if self._evictable(s) and not self.mark[s]:
                o[n] = self.expert_of[s] if ids else s
                n += 1
        self._mark_excluded(exclude, 0)
        return out

    def copy_args(self, const int64_t[:] slots, int64_t first_key, int64_t base, int64_t nbytes):
        """The issuer's arguments for copies into ``slots`` (range-checked):
        ``(keys first_key.., destinations base + slot * nbytes, sizes)``."""
        cdef Py_ssize_t i, n = slots.shape[0]
        _check(slots, self.num_slots, "slot")
        keys = np.empty(n, dtype=np.int64)
        dst = np.empty(n, dtype=np.int64)
        sizes = np.empty(n, dtype=np.int64)
        cdef int64_t[::1] kv = keys
        cdef int64_t[::1] dv = dst
        cdef int64_t[::1] sv = sizes
        for i in range(n):
            kv[i] = first_key + i
            dv[i] = base + slots[i] * nbytes
            sv[i] = nbytes
        return keys, dst, sizes

    def free_slots(self, Py_ssize_t n):
        """Up to ``n`` free slots, ascending."""
        cdef Py_ssize_t s, k = 0
        if n < 0:
            n = 0
        out = np.empty(min(n, self.num_slots), dtype=np.int64)
        cdef int64_t[::1] o = out
        for s in range(self.num_slots):
            if k >= n:
                break
            if self.expert_of[s] < 0:
                o[k] = s
                k += 1
        return out[:k]

    # -- acquire -----------------------------------------------------------

    def all_held(self, const int64_t[:] ids):
        """Every id holds a slot (its copy may be in flight)."""
        cdef Py_ssize_t i
        _check(ids, self.num_ids, "expert")
        for i in range(ids.shape[0]):
            if self.slot_of[ids[i]] < 0:
                return False
        return True

    def split_present(self, const int64_t[:] ids):
        """``(slot_of[ids], the ids without a slot)``."""
        cdef Py_ssize_t i, n = ids.shape[0], nmiss = 0
        _check(ids, self.num_ids, "expert")
        slots = np.empty(n, dtype=np.int64)
        cdef int64_t[::1] sv = slots
        for i in range(n):
            sv[i] = self.slot_of[ids[i]]
            if sv[i] < 0:
                nmiss += 1
        missing = np.empty(nmiss, dtype=np.int64)
        cdef int64_t[::1] mv = missing
        nmiss = 0
        for i in range(n):
            if sv[i] < 0:
                mv[nmiss] = ids[i]
                nmiss += 1
        return slots, missing

    cdef void _add_pins(self, const int64_t[:] slots, int32_t delta) noexcept nogil:
        """``pins[slots[slots >= 0]] += delta`` as numpy does it: once per
        distinct slot, however often it is listed."""
        cdef Py_ssize_t i
        cdef int64_t s
        for i in range(slots.shape[0]):
            s = slots[i]
            if s >= 0 and not self.mark[s]:
                self.mark[s] = 1
                self.pins[s] += delta
        for i in range(slots.shape[0]):
            if slots[i] >= 0:
                self.mark[slots[i]] = 0

    def pin_present(self, const int64_t[:] slots, int32_t delta):
        """Add ``delta`` to the pins of the slots ``>= 0`` of ``slots``
        (once per distinct slot)."""
        cdef Py_ssize_t i
        for i in range(slots.shape[0]):
            if slots[i] >= self.num_slots:
                raise IndexError(f"slot {slots[i]} out of range [0, {self.num_slots})")
        self._add_pins(slots, delta)

    def commit_access(self, const int64_t[:] ids, const int64_t[:] slots_before):
        """An acquire's access: ``(hits in flight, fresh slots)``; marks the
        slots of ``ids`` used. ``slots_before``: ``slot_of[ids]`` before the
        misses were loaded (-1 for them)."""
        cdef Py_ssize_t i
        cdef int64_t s, inflight = 0, fresh = 0
        _check(ids, self.num_ids, "expert")
        for i in range(slots_before.shape[0]):
            s = slots_before[i]
            if s >= self.num_slots:
                raise IndexError(f"slot {s} out of range [0, {self.num_slots})")
        for i in range(ids.shape[0]):
            s = self.slot_of[ids[i]]
            if s < 0:
                raise IndexError(f"slot {s} out of range [0, {self.num_slots})")
        for i in range(slots_before.shape[0]):
            s = slots_before[i]
            if s >= 0 and self.ticket[s] >= 0:
                inflight += 1
        for i in range(ids.shape[0]):  # counted before any is marked, as numpy does
            s = self.slot_of[ids[i]]
            if not self.used[s] and self.counted[s]:
                fresh += 1
        for i in range(ids.shape[0]):
            self.used[self.slot_of[ids[i]]] = 1
        return inflight, fresh

    def out_tickets(self, const int64_t[:] ids):
        """``(slot_of[ids], their tickets)`` (a copy)."""
        cdef Py_ssize_t i, n = ids.shape[0]
        cdef int64_t s
        _check(ids, self.num_ids, "expert")
        slots = np.empty(n, dtype=np.int64)
        tickets = np.empty(n, dtype=np.int64)
        cdef int64_t[::1] sv = slots
        cdef int64_t[::1] tv = tickets
        for i in range(n):
            s = self.slot_of[ids[i]]
            sv[i] = s
            # NOTE: numpy's index -1 (not resident) reads the last slot
            tv[i] = self.ticket[s if s >= 0 else self.num_slots + s]
        return slots, tickets

    # -- pins of whole layers and releases --------------------------------

    def pin_checked(self, const int64_t[:] ids):
        """Pin every id's slot; if one holds none, pin nothing and return
        its position: ``(first bad position or -1, slot_of[ids])``."""
        cdef Py_ssize_t i, n = ids.shape[0], bad = -1
        _check(ids, self.num_ids, "expert")
        slots = np.empty(n, dtype=np.int64)
        cdef int64_t[::1] sv = slots
        for i in range(n):
            sv[i] = self.slot_of[ids[i]]
            if sv[i] < 0 and bad < 0:
                bad = i
        if bad < 0:
            self._add_pins(sv, 1)
        return bad, slots

    def unpin_checked(self, const int64_t[:] ids):
        """Unpin every id's slot; if one holds no slot or no pin, change
        nothing and return its position."""
        cdef Py_ssize_t i, n = ids.shape[0], bad = -1
        _check(ids, self.num_ids, "expert")
        slots = np.empty(n, dtype=np.int64)
        cdef int64_t[::1] sv = slots
        for i in range(n):
            sv[i] = self.slot_of[ids[i]]
            if bad < 0 and (sv[i] < 0 or self.pins[sv[i]] <= 0):
                bad = i
        if bad < 0:
            self._add_pins(sv, -1)
        return bad, slots

    def promotable(self, const int64_t[:] slots, int64_t band):
        """The slots of ``slots`` (those ``< 0`` skipped) whose copy is in
        flight at a band after ``band``, in order."""
        cdef Py_ssize_t i, n = 0
        cdef int64_t s
        for i in range(slots.shape[0]):
            if slots[i] >= self.num_slots:
                raise IndexError(f"slot {slots[i]} out of range [0, {self.num_slots})")
        for i in range(slots.shape[0]):
            s = slots[i]
            if s >= 0 and self.ticket[s] >= 0 and self.band[s] > band:
                n += 1
        out = np.empty(n, dtype=np.int64)
        cdef int64_t[::1] o = out
        n = 0
        for i in range(slots.shape[0]):
            s = slots[i]
            if s >= 0 and self.ticket[s] >= 0 and self.band[s] > band:
                o[n] = s
                n += 1
        return out

    # -- evictions and loads -----------------------------------------------

    def evict(self, const int64_t[:] slots):
        """Empty ``slots``: ``(their ids, how many were loaded since the last
        reset and never used, how many of those were prefetched)``."""
        cdef Py_ssize_t i, n = slots.shape[0]
        cdef int64_t s, g, unused = 0, prefetched = 0
        _check(slots, self.num_slots, "slot")
        ids = np.empty(n, dtype=np.int64)
        cdef int64_t[::1] iv = ids
        for i in range(n):
            g = self.expert_of[slots[i]]
            if g < 0 or g >= self.num_ids:
                raise IndexError(f"expert {g} out of range [0, {self.num_ids})")
            iv[i] = g
        for i in range(n):
            s = slots[i]
            if self.counted[s] and not self.used[s]:
                unused += 1
                if self.by_prefetch[s]:
                    prefetched += 1
        for i in range(n):
            self.slot_of[iv[i]] = -1
            self.expert_of[slots[i]] = -1
        return ids, unused, prefetched

    def load(
        self, const int64_t[:] ids, const int64_t[:] slots, const int64_t[:] tickets,
        const int64_t[:] keys, int64_t band, bint prefetched,
    ):
        """Give ``ids`` the free ``slots`` with their copies' tickets and keys."""
        cdef Py_ssize_t i, n = ids.shape[0]
        cdef int64_t s
        if slots.shape[0] != n or tickets.shape[0] != n or keys.shape[0] != n:
            raise ValueError(
                f"{n} ids, {slots.shape[0]} slots, {tickets.shape[0]} tickets, "
                f"{keys.shape[0]} keys"
            )
        _check(ids, self.num_ids, "expert")
        _check(slots, self.num_slots, "slot")
        for i in range(n):
            s = slots[i]
            self.slot_of[ids[i]] = s
            self.expert_of[s] = ids[i]
            self.ticket[s] = tickets[i]
            self.key[s] = keys[i]
            self.band[s] = band
            self.used[s] = 0
            self.counted[s] = 1
            self.by_prefetch[s] = prefetched

    # -- deferred accesses -------------------------------------------------

    def inflight_row(self, int64_t layer):
        """``[1, experts]``: per expert of ``layer``, its copy is in flight
        (a non-resident expert reads slot 0's state, as the numpy code
        always did)."""
        cdef Py_ssize_t e
        cdef int64_t s, base = layer * self.num_experts
        cdef Py_buffer view
        cdef uint8_t* o
        if layer < 0 or base >= self.num_ids:
            raise IndexError(f"layer {layer} out of range")
        out = np.empty((1, self.num_experts), dtype=np.bool_)
        _bool_buffer(out, &view, PyBUF_WRITABLE, "out")
        o = <uint8_t*>view.buf
        for e in range(self.num_experts):
            s = self.slot_of[base + e]
            o[e] = self.ticket[s if s > 0 else 0] >= 0
        PyBuffer_Release(&view)
        return out

    def apply_access(self, int64_t layer, const int64_t[:] routed, inflight):
        """One deferred access of ``layer`` (expert indices ``routed``, any
        order, repeats allowed): ``(the distinct routed ids still holding a
        slot, how many of them were in flight, fresh slots)``; marks their
        slots used."""
        cdef Py_ssize_t i, e, n = 0
        cdef int64_t r, s, base = layer * self.num_experts, n_inflight = 0, fresh = 0
        cdef int64_t E = self.num_experts
        cdef Py_buffer view
        cdef const uint8_t* fl
        if layer < 0 or base >= self.num_ids:
            raise IndexError(f"layer {layer} out of range")
        for i in range(routed.shape[0]):
            r = routed[i]
            if r < 0 or r >= E:
                raise ValueError(f"routed expert {r} out of range [0, {E})")
        _bool_buffer(inflight, &view, 0, "inflight")
        fl = <const uint8_t*>view.buf
        if view.len != E:
            PyBuffer_Release(&view)
            raise ValueError(f"{view.len} in-flight flags for {E} experts")
        cdef int64_t[::1] c = self.seen
        c[:] = 0
        for i in range(routed.shape[0]):
            c[routed[i]] = 1
        for e in range(E):
            if c[e] and self.slot_of[base + e] >= 0:
                n += 1
        ids = np.empty(n, dtype=np.int64)
        cdef int64_t[::1] iv = ids
        n = 0
        for e in range(E):
            if not c[e]:
                continue
            s = self.slot_of[base + e]
            if s < 0:  # dropped since (failed copy): not counted
                continue
            iv[n] = base + e
            n += 1
            if fl[e]:
                n_inflight += 1
            if not self.used[s] and self.counted[s]:
                fresh += 1
            self.used[s] = 1
        PyBuffer_Release(&view)
        return ids, n_inflight, fresh


# -- the layer-cyclic policy's victims over an LRU base -----------------------

cdef struct _Rank:
    int64_t far  # minus the layers until the expert's layer runs again
    int64_t predicted
    int64_t last_use
    int64_t expert


cdef int _by_rank(const void* a, const void* b) noexcept nogil:
    cdef const _Rank* x = <const _Rank*>a
    cdef const _Rank* y = <const _Rank*>b
    if x.far != y.far:
        return -1 if x.far < y.far else 1
    if x.predicted != y.predicted:
        return -1 if x.predicted < y.predicted else 1
    if x.last_use != y.last_use:
        return -1 if x.last_use < y.last_use else 1
    if x.expert != y.expert:
        return -1 if x.expert < y.expert else 1
    return 0


def layer_cyclic_lru_victims(
    const int64_t[:] candidates, const int64_t[:] last_use, predicted,
    int64_t num_layers, int64_t num_experts, int64_t current_layer, Py_ssize_t n,
):
    """:class:`pdflash.cache.eviction.LayerCyclicPolicy`'s victims over its
    LRU base: the ``n`` candidates (distinct flat ids) whose layer runs again
    farthest from ``current_layer``, then unpredicted before predicted
    (``predicted``: bool per flat id, or empty: none), then least recently
    used (``last_use`` per flat id), then the smaller id, in that order."""
    cdef Py_ssize_t i, m = candidates.shape[0]
    cdef int64_t g, layer, num_ids = last_use.shape[0]
    cdef int64_t[::1] ov
    cdef Py_buffer view
    cdef const uint8_t* pred
    cdef Py_ssize_t npred
    cdef _Rank* ranks
    if n <= 0 or m == 0:
        return np.zeros(0, dtype=np.int64)
    for i in range(m):
        g = candidates[i]
        if g < 0 or g >= num_ids or g >= num_layers * num_experts:
            raise IndexError(f"expert {g} out of range [0, {num_ids})")
    _bool_buffer(predicted, &view, 0, "predicted")
    pred = <const uint8_t*>view.buf
    npred = view.len
    if npred != 0 and npred != num_ids:
        PyBuffer_Release(&view)
        raise ValueError(f"{npred} predicted flags for {num_ids} ids")
    ranks = <_Rank*>malloc(m * sizeof(_Rank))
    if ranks == NULL:
        PyBuffer_Release(&view)
        raise MemoryError()
    try:
        for i in range(m):
            g = candidates[i]
            layer = g // num_experts
            ranks[i].far = -(layer - current_layer if layer > current_layer
                             else num_layers - current_layer + layer)
            ranks[i].predicted = pred[g] if npred else 0
            ranks[i].last_use = last_use[g]
            ranks[i].expert = g
        with nogil:
            qsort(ranks, m, sizeof(_Rank), _by_rank)
        if n > m:
            n = m
        out = np.empty(n, dtype=np.int64)
        ov = out
        for i in range(n):
            ov[i] = ranks[i].expert
        return out
    finally:
        free(ranks)
        PyBuffer_Release(&view)
