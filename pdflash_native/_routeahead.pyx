# cython: language_level=3, auto_pickle=False
"""Route-ahead bookkeeping: hits, waste and misses of predicted expert sets.

Expert sets are ``(layers, experts)`` boolean/uint8 masks, or bitsets of
``words = ceil(experts / 64)`` uint64 words per layer (expert ``e`` is bit
``e % 64`` of word ``e // 64``). A batch is ``(requests, layers, ...)``; a
single ``(layers, ...)`` set is a batch of one. Every loop over experts runs
in C without the GIL; Python only validates shapes once per call.

Not thread-safe: one accumulator per engine thread.
"""

from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t
from libc.string cimport memset

from pdflash_native._bitops cimport (
    cpu_init,
    ctz64,
    pack8,
    pack16,
    popcount64,
    set_popcnt,
    uses_popcnt,
)

import numpy as np

cpu_init()

_COUNT_NAMES = (
    "req_predicted",
    "req_routed",
    "req_hits",
    "req_wasted",
    "req_missed",
    "predicted",
    "routed",
    "hits",
    "wasted",
    "missed",
    "resident_routed",
    "prefetch_issued",
    "prefetch_used",
    "prefetch_unused",
    "demand_loads",
    "late_used",
    "evicted_before_use",
)
assert len(_COUNT_NAMES) == NUM_COUNT_KINDS

#: Row names of :meth:`RouteAheadAccumulator.counters`: the counts, then
#: their byte twins (``<name>_bytes``) in the same order.
COUNTER_NAMES: tuple = _COUNT_NAMES + tuple(n + "_bytes" for n in _COUNT_NAMES)


def uses_popcnt_instruction():
    """True if the bitset bookkeeping uses the CPU's POPCNT instruction."""
    return bool(uses_popcnt())


def _set_popcnt_instruction(bint enabled):
    """Tests only: force the portable popcount (``False``) or re-detect the
    CPU (``True``), so both variants are checked on one machine."""
    set_popcnt(enabled)


def words_per_layer(int num_experts) -> int:
    """uint64 words per layer in a bitset of ``num_experts`` experts."""
    if num_experts <= 0:
        raise ValueError(f"num_experts must be positive, got {num_experts}")
    return (num_experts + 63) // 64


cdef void _pack_rows(const uint8_t* src, uint64_t* dst, Py_ssize_t rows,
                     Py_ssize_t num_experts, Py_ssize_t words) noexcept nogil:
    cdef Py_ssize_t r, e, w
    cdef const uint8_t* row
    cdef uint64_t word
    for r in range(rows):
        row = src + r * num_experts
        for w in range(words):
            dst[r * words + w] = 0
        e = 0
        while e + 16 <= num_experts:
            dst[r * words + (e >> 6)] |= pack16(row + e) << (e & 63)
            e += 16
        while e + 8 <= num_experts:
            dst[r * words + (e >> 6)] |= pack8(row + e) << (e & 63)
            e += 8
        while e < num_experts:
            if row[e] != 0:
                dst[r * words + (e >> 6)] |= (<uint64_t>1) << (e & 63)
            e += 1


def _as_mask_array(object mask, str name):
    arr = np.asarray(mask)
    if arr.dtype == np.bool_:
        arr = arr.view(np.uint8)
    elif arr.dtype != np.uint8:
        raise TypeError(f"{name} must be a bool or uint8 mask, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr)


def pack_masks(object masks):
    """Pack ``(..., experts)`` bool/uint8 masks (nonzero = member) into
    ``(..., words)`` uint64 bitsets."""
    arr = _as_mask_array(masks, "masks")
    if arr.ndim < 1 or arr.shape[arr.ndim - 1] == 0:
        raise ValueError(f"masks must have a non-empty last (experts) axis, got shape {arr.shape}")
    cdef Py_ssize_t num_experts = arr.shape[arr.ndim - 1]
    cdef Py_ssize_t words = (num_experts + 63) // 64
    cdef Py_ssize_t rows = arr.size // num_experts
    out = np.empty(arr.shape[:arr.ndim - 1] + (words,), dtype=np.uint64)
    cdef const uint8_t[::1] src = arr.reshape(-1)
    cdef uint64_t[::1] dst = out.reshape(-1)
    if rows:
        with nogil:
            _pack_rows(&src[0], &dst[0], rows, num_experts, words)
    return out


def routed_bitsets_from_topk(object topk_ids, object token_request, int num_requests,
                             int num_experts):
    """Per-request routed sets from a forward's top-k routing.

    ``topk_ids``: int64 ``(layers, tokens, k)`` expert ids per token;
    ``token_request``: int64 ``(tokens,)`` the request index of each token in
    ``[0, num_requests)``, or -1 for a token to leave out (padding, or beyond
    the horizon). Returns uint64 bitsets ``(num_requests, layers, words)``.
    """
    ids = np.ascontiguousarray(topk_ids)
    owner = np.ascontiguousarray(token_request)
    if ids.dtype != np.int64 or owner.dtype != np.int64:
        raise TypeError(
            f"topk_ids and token_request must be int64, got {ids.dtype} and {owner.dtype}")
    if ids.ndim != 3:
        raise ValueError(f"topk_ids must be (layers, tokens, k), got shape {ids.shape}")
    if owner.ndim != 1 or owner.shape[0] != ids.shape[1]:
        raise ValueError(
            f"token_request must be ({ids.shape[1]},) to match topk_ids, got {owner.shape}")
    if num_requests < 0 or num_experts <= 0:
        raise ValueError(
            f"need num_requests >= 0 and num_experts > 0, got {num_requests}, {num_experts}")
    cdef Py_ssize_t L = ids.shape[0], T = ids.shape[1], K = ids.shape[2]
    cdef Py_ssize_t W = (num_experts + 63) // 64
    out = np.zeros((num_requests, L, W), dtype=np.uint64)
    if ids.size == 0:
        return out
    cdef const int64_t[:, :, ::1] idv = ids
    cdef const int64_t[::1] ownv = owner
    cdef uint64_t[::1] outv = out.reshape(-1)
    cdef uint64_t* dst = &outv[0] if out.size else NULL
    cdef const int64_t* src = &idv[0, 0, 0]
    cdef Py_ssize_t l, t, k
    cdef int64_t r, e, bad_expert = 0, bad_request = 0
    cdef bint expert_ok = True, request_ok = True
    cdef int64_t E = num_experts, R = num_requests
    with nogil:
        # NOTE: ids are range-checked in the same pass that scatters them (a
        # separate numpy min/max pass costs as much as the scatter).
        for t in range(T):
            r = ownv[t]
            if r < -1 or r >= R:
                bad_request = r
                request_ok = False
                break
        if request_ok:
            for l in range(L):
                for t in range(T):
                    r = ownv[t]
                    if r < 0:
                        continue
                    for k in range(K):
                        e = src[(l * T + t) * K + k]
                        if e < 0 or e >= E:
                            bad_expert = e
                            expert_ok = False
                            break
                        dst[(r * L + l) * W + (e >> 6)] |= (<uint64_t>1) << (e & 63)
                    if not expert_ok:
                        break
                if not expert_ok:
                    break
    if not request_ok:
        raise ValueError(f"token_request {bad_request} out of range [-1, {num_requests})")
    if not expert_ok:
        raise ValueError(f"expert id {bad_expert} out of range [0, {num_experts})")
    return out


cdef inline void _add(int64_t* C, Py_ssize_t L, Py_ssize_t layer, int kind, uint64_t bits,
                      int64_t nbytes) noexcept nogil:
    C[kind * L + layer] += popcount64(bits)
    C[(NUM_COUNT_KINDS + kind) * L + layer] += nbytes


cdef class RouteAheadAccumulator:
    """Monotone per-layer counters of route-ahead hits, waste and misses.

    ``expert_nbytes`` is one int (every expert the same size) or an int64
    ``(layers, experts)`` array. ``decay`` in (0, 1] is the per-step factor of
    the frequency estimate: after each step ``freq = decay * freq + n``, with
    ``n`` the number of the step's requests that routed to the expert.
    """

    def __init__(self, int num_layers, int num_experts, object expert_nbytes,
                 double decay=0.9):
        if num_layers <= 0:
            raise ValueError(f"num_layers must be positive, got {num_layers}")
        if num_experts <= 0:
            raise ValueError(f"num_experts must be positive, got {num_experts}")
        if not (0.0 < decay <= 1.0):
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        nb = np.asarray(expert_nbytes)
        if nb.dtype.kind not in "iu":
            raise TypeError(f"expert_nbytes must be integers, got dtype {nb.dtype}")
        nb = nb.astype(np.int64)
        if nb.ndim == 0:
            nb = np.full((num_layers, num_experts), int(nb), dtype=np.int64)
        elif nb.shape != (num_layers, num_experts):
            raise ValueError(
                f"expert_nbytes must be an int or shape {(num_layers, num_experts)}, "
                f"got shape {nb.shape}")
        if (nb < 0).any():
            raise ValueError(f"expert_nbytes must be >= 0, got {int(nb.min())}")
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.words = (num_experts + 63) // 64
        self.decay = decay
        self._nbytes = np.ascontiguousarray(nb)
        uniform = np.where((nb == nb[:, :1]).all(axis=1), nb[:, 0], -1)
        self._layer_nbytes = np.ascontiguousarray(uniform, dtype=np.int64)
        self._counters = np.zeros((NUM_COUNTERS, num_layers), dtype=np.int64)
        self._freq = np.zeros((num_layers, num_experts), dtype=np.float32)
        self._step_counts = np.zeros(num_layers * num_experts, dtype=np.int32)
        self._planes = np.zeros(num_layers * self.words * COUNT_PLANES, dtype=np.uint64)
        self._pending = np.zeros((num_layers, self.words), dtype=np.uint64)
        self._step_pred = np.zeros((num_layers, self.words), dtype=np.uint64)
        self._step_routed = np.zeros((num_layers, self.words), dtype=np.uint64)
        self._no_resident = np.zeros((num_layers, self.words), dtype=np.uint64)
        self._scratch_pred = np.zeros(0, dtype=np.uint64)
        self._scratch_routed = np.zeros(0, dtype=np.uint64)
        self._scratch_resident = np.zeros((num_layers, self.words), dtype=np.uint64)
        self.steps = 0
        self.requests = 0

    # ------------------------------------------------------------------ input

    def _mask_batch(self, object mask, str name):
        arr = _as_mask_array(mask, name)
        expect = (self.num_layers, self.num_experts)
        if arr.ndim == 2 and arr.shape == expect:
            return arr.reshape((1,) + expect)
        if arr.ndim == 3 and arr.shape[1:] == expect:
            return arr
        raise ValueError(
            f"{name} must have shape {expect} or (requests, {expect[0]}, {expect[1]}), "
            f"got {arr.shape}")

    def _bitset_batch(self, object bits, str name, bint batched):
        arr = np.ascontiguousarray(bits)
        if arr.dtype != np.uint64:
            raise TypeError(f"{name} must be uint64 bitsets, got dtype {arr.dtype}")
        expect = (self.num_layers, self.words)
        if arr.ndim == 2 and arr.shape == expect:
            arr = arr.reshape((1,) + expect)
        elif not (batched and arr.ndim == 3 and arr.shape[1:] == expect):
            want = f"{expect} or (requests, {expect[0]}, {expect[1]})" if batched else str(expect)
            raise ValueError(f"{name} must have shape {want}, got {arr.shape}")
        tail_bits = self.num_experts % 64
        if tail_bits and arr.size:
            stray = arr[..., -1] >> np.uint64(tail_bits)
            if stray.any():
                raise ValueError(
                    f"{name} has bits set beyond expert {self.num_experts - 1} "
                    f"(num_experts={self.num_experts})")
        return arr

    def update_masks(self, predicted, routed, resident=None):
        """One step from masks: ``predicted`` and ``routed`` are bool/uint8
        ``(layers, experts)`` or ``(requests, layers, experts)`` (request r's
        predicted and routed sets); ``resident`` is the ``(layers, experts)``
        set resident on the device before the step (None: nothing resident).
        """
        p = self._mask_batch(predicted, "predicted")
        u = self._mask_batch(routed, "routed")
        if p.shape[0] != u.shape[0]:
            raise ValueError(
                f"predicted has {p.shape[0]} requests but routed has {u.shape[0]}")
        cdef Py_ssize_t R = p.shape[0]
        cdef Py_ssize_t L = self.num_layers, E = self.num_experts, W = self.words
        if resident is not None:
            res = _as_mask_array(resident, "resident")
            if res.shape != (L, E):
                raise ValueError(f"resident must have shape {(L, E)}, got {res.shape}")
        if self._scratch_pred.shape[0] < R * L * W:
            self._scratch_pred = np.empty(R * L * W, dtype=np.uint64)
            self._scratch_routed = np.empty(R * L * W, dtype=np.uint64)
        cdef uint64_t[::1] pb = self._scratch_pred
        cdef uint64_t[::1] ub = self._scratch_routed
        cdef uint64_t[:, ::1] rb = self._no_resident
        cdef const uint8_t[::1] pv = p.reshape(-1)
        cdef const uint8_t[::1] uv = u.reshape(-1)
        cdef const uint8_t[::1] resv
        if resident is not None:
            resv = res.reshape(-1)
            rb = self._scratch_resident
            with nogil:
                _pack_rows(&resv[0], &rb[0, 0], L, E, W)
        if R == 0:
            return
        with nogil:
            _pack_rows(&pv[0], &pb[0], R * L, E, W)
            _pack_rows(&uv[0], &ub[0], R * L, E, W)
            self._accumulate(&pb[0], &ub[0], &rb[0, 0], R)

    def update_bitsets(self, predicted, routed, resident=None):
        """One step from uint64 bitsets: ``predicted`` and ``routed`` are
        ``(layers, words)`` or ``(requests, layers, words)``; ``resident`` is
        ``(layers, words)`` or None (nothing resident)."""
        p = self._bitset_batch(predicted, "predicted", True)
        u = self._bitset_batch(routed, "routed", True)
        if p.shape[0] != u.shape[0]:
            raise ValueError(
                f"predicted has {p.shape[0]} requests but routed has {u.shape[0]}")
        res = self._no_resident if resident is None else self._bitset_batch(
            resident, "resident", False)[0]
        cdef Py_ssize_t R = p.shape[0]
        if R == 0:
            return
        cdef const uint64_t[:, :, ::1] pv = p
        cdef const uint64_t[:, :, ::1] uv = u
        cdef const uint64_t[:, ::1] rv = res
        with nogil:
            self._accumulate(&pv[0, 0, 0], &uv[0, 0, 0], &rv[0, 0], R)

    # -------------------------------------------------------------- hot loop

    cdef int64_t _set_bytes(self, uint64_t bits, Py_ssize_t layer,
                            Py_ssize_t word) noexcept nogil:
        cdef int64_t common = self._layer_nbytes[layer]
        if common >= 0:
            return popcount64(bits) * common
        cdef int64_t total = 0
        cdef Py_ssize_t base = word * 64
        while bits:
            total += self._nbytes[layer, base + ctz64(bits)]
            bits &= bits - 1
        return total

    cdef void _accumulate(self, const uint64_t* pred, const uint64_t* routed,
                          const uint64_t* resident, Py_ssize_t num_requests) noexcept nogil:
        cdef Py_ssize_t L = self.num_layers, E = self.num_experts, W = self.words
        cdef Py_ssize_t r, l, w, idx, base
        cdef uint64_t p, u, h, wa, m, res, pend, issued, x, carry
        cdef uint64_t* planes = &self._planes[0]
        cdef uint64_t* plane
        cdef int k
        cdef int64_t nh, nw, nm, bh, bw, bm
        cdef int64_t* C = &self._counters[0, 0]
        cdef int32_t* counts = &self._step_counts[0]
        cdef uint64_t* sp = &self._step_pred[0, 0]
        cdef uint64_t* su = &self._step_routed[0, 0]
        cdef uint64_t* pending = &self._pending[0, 0]
        cdef float* freq = &self._freq[0, 0]
        cdef float decay = <float>self.decay
        cdef int B = NUM_COUNT_KINDS  # offset of the bytes twin of a count

        memset(sp, 0, L * W * sizeof(uint64_t))
        memset(su, 0, L * W * sizeof(uint64_t))
        memset(planes, 0, L * W * COUNT_PLANES * sizeof(uint64_t))
        # Request scope: each request's own P_r against its own U_r.
        for r in range(num_requests):
            for l in range(L):
                base = (r * L + l) * W
                nh = nw = nm = bh = bw = bm = 0
                for w in range(W):
                    p = pred[base + w]
                    u = routed[base + w]
                    h = p & u
                    wa = p & ~u
                    m = u & ~p
                    nh += popcount64(h)
                    nw += popcount64(wa)
                    nm += popcount64(m)
                    bh += self._set_bytes(h, l, w)
                    bw += self._set_bytes(wa, l, w)
                    bm += self._set_bytes(m, l, w)
                    sp[l * W + w] |= p
                    su[l * W + w] |= u
                    # NOTE: per-expert counts as a bit-sliced (vertical) counter:
                    # a ripple-carry add of u across bit planes, ~2 planes on
                    # average, instead of one increment per set bit.
                    plane = planes + (l * W + w) * COUNT_PLANES
                    carry = u
                    k = 0
                    while carry:
                        x = plane[k] & carry
                        plane[k] ^= carry
                        carry = x
                        k += 1
                C[REQ_PREDICTED * L + l] += nh + nw
                C[REQ_ROUTED * L + l] += nh + nm
                C[REQ_HITS * L + l] += nh
                C[REQ_WASTED * L + l] += nw
                C[REQ_MISSED * L + l] += nm
                C[(B + REQ_PREDICTED) * L + l] += bh + bw
                C[(B + REQ_ROUTED) * L + l] += bh + bm
                C[(B + REQ_HITS) * L + l] += bh
                C[(B + REQ_WASTED) * L + l] += bw
                C[(B + REQ_MISSED) * L + l] += bm
        # Batch scope: the union over requests, what the copy engine moves.
        for l in range(L):
            for w in range(W):
                idx = l * W + w
                p = sp[idx]
                u = su[idx]
                res = resident[idx]
                pend = pending[idx]
                issued = p & ~res
                _add(C, L, l, PREDICTED, p, self._set_bytes(p, l, w))
                _add(C, L, l, ROUTED, u, self._set_bytes(u, l, w))
                _add(C, L, l, HITS, p & u, self._set_bytes(p & u, l, w))
                _add(C, L, l, WASTED, p & ~u, self._set_bytes(p & ~u, l, w))
                _add(C, L, l, MISSED, u & ~p, self._set_bytes(u & ~p, l, w))
                _add(C, L, l, RESIDENT_ROUTED, u & res, self._set_bytes(u & res, l, w))
                _add(C, L, l, PREFETCH_ISSUED, issued, self._set_bytes(issued, l, w))
                _add(C, L, l, PREFETCH_USED, issued & u, self._set_bytes(issued & u, l, w))
                _add(C, L, l, PREFETCH_UNUSED, issued & ~u, self._set_bytes(issued & ~u, l, w))
                x = u & ~p & ~res
                _add(C, L, l, DEMAND_LOADS, x, self._set_bytes(x, l, w))
                _add(C, L, l, LATE_USED, pend & u, self._set_bytes(pend & u, l, w))
                # NOTE: a prefetch stays "pending" until a later step routes to
                # it or record_eviction() drops it; only then is it waste.
                pending[idx] = (pend & ~u) | (issued & ~u)
        for idx in range(L * W):
            l = idx // W
            w = idx % W
            plane = planes + idx * COUNT_PLANES
            for k in range(COUNT_PLANES):
                x = plane[k]
                while x:
                    counts[l * E + w * 64 + ctz64(x)] += (<int32_t>1) << k
                    x &= x - 1
        for idx in range(L * E):
            freq[idx] = freq[idx] * decay + <float>counts[idx]
            counts[idx] = 0
        self.steps += 1
        self.requests += num_requests

    # ------------------------------------------------------------- evictions

    def record_eviction(self, flat_ids):
        """Experts (flat ids ``layer * experts + expert``) just evicted from
        the device. Those prefetched and not yet used count as
        ``evicted_before_use``; returns their total bytes."""
        ids = np.asarray(flat_ids)
        if ids.size == 0:
            return 0
        if ids.dtype.kind not in "iu":
            raise TypeError(f"flat_ids must be integers, got dtype {ids.dtype}")
        ids = np.ascontiguousarray(ids.reshape(-1), dtype=np.int64)
        total = self.num_layers * self.num_experts
        if ids.min() < 0 or ids.max() >= total:
            bad = ids[(ids < 0) | (ids >= total)][0]
            raise ValueError(f"expert id {int(bad)} out of range [0, {total})")
        cdef const int64_t[::1] idv = ids
        cdef Py_ssize_t i, n = ids.shape[0], l, e
        cdef Py_ssize_t L = self.num_layers, E = self.num_experts, W = self.words
        cdef uint64_t bit
        cdef int64_t count = 0, nbytes = 0
        cdef int64_t* C = &self._counters[0, 0]
        cdef uint64_t* pending = &self._pending[0, 0]
        with nogil:
            for i in range(n):
                l = idv[i] // E
                e = idv[i] % E
                bit = (<uint64_t>1) << (e & 63)
                if pending[l * W + (e >> 6)] & bit:
                    pending[l * W + (e >> 6)] &= ~bit
                    C[EVICTED_BEFORE_USE * L + l] += 1
                    C[(NUM_COUNT_KINDS + EVICTED_BEFORE_USE) * L + l] += self._nbytes[l, e]
                    nbytes += self._nbytes[l, e]
        return nbytes

    # ---------------------------------------------------------------- output

    def counters(self):
        """A copy of the int64 ``(len(COUNTER_NAMES), layers)`` counter table."""
        return np.array(self._counters, dtype=np.int64, copy=True)

    def frequency(self):
        """A copy of the float32 ``(layers, experts)`` decayed routing counts."""
        return np.array(self._freq, dtype=np.float32, copy=True)

    def pending(self):
        """The ``(layers, experts)`` bool set prefetched and not yet used."""
        raw = np.asarray(self._pending).view(np.uint8)
        bits = np.unpackbits(raw, axis=1, bitorder="little")
        return bits[:, : self.num_experts].astype(np.bool_)

    def reset(self):
        """Zero every counter, the frequency estimate and the pending set."""
        self._counters[:, :] = 0
        self._freq[:, :] = 0
        self._pending[:, :] = 0
        self.steps = 0
        self.requests = 0
