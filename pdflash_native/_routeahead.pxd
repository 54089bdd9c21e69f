from libc.stdint cimport int32_t, int64_t, uint64_t

# Row indices of the (NUM_COUNTERS, num_layers) counter table; names in
# _routeahead.COUNTER_NAMES, same order. "req_*": each request's own predicted
# set P_r against its own routed set U_r, summed over requests. The rest: the
# union over the step's requests (what the copy engine moves), against the
# resident set before the step.
cdef enum:
    REQ_PREDICTED = 0
    REQ_ROUTED
    REQ_HITS
    REQ_WASTED
    REQ_MISSED
    PREDICTED
    ROUTED
    HITS
    WASTED
    MISSED
    RESIDENT_ROUTED
    PREFETCH_ISSUED
    PREFETCH_USED
    PREFETCH_UNUSED
    DEMAND_LOADS
    LATE_USED
    EVICTED_BEFORE_USE
    NUM_COUNT_KINDS
    # each count has a bytes twin at index + NUM_COUNT_KINDS
    NUM_COUNTERS = 2 * NUM_COUNT_KINDS
    # bit planes of the per-step routed counts: counts up to 2**32 - 1 requests
    COUNT_PLANES = 32


cdef class RouteAheadAccumulator:
    cdef readonly int num_layers
    cdef readonly int num_experts
    cdef readonly int words
    cdef readonly double decay
    cdef readonly long long steps
    cdef readonly long long requests
    cdef int64_t[:, ::1] _counters       # (NUM_COUNTERS, L)
    cdef int64_t[:, ::1] _nbytes         # (L, E)
    cdef int64_t[::1] _layer_nbytes      # (L,) the layer's common size, or -1
    cdef float[:, ::1] _freq             # (L, E)
    cdef int32_t[::1] _step_counts       # (L * E) requests routing each expert this step
    cdef uint64_t[::1] _planes           # (L * W * COUNT_PLANES) bit-sliced step counts
    cdef uint64_t[:, ::1] _pending       # (L, W) prefetched, not yet used
    cdef uint64_t[:, ::1] _step_pred     # (L, W) scratch: union of P_r
    cdef uint64_t[:, ::1] _step_routed   # (L, W) scratch: union of U_r
    cdef uint64_t[:, ::1] _no_resident   # (L, W) zeros, for resident=None
    cdef object _scratch_pred
    cdef object _scratch_routed
    cdef object _scratch_resident

    cdef int64_t _set_bytes(self, uint64_t bits, Py_ssize_t layer, Py_ssize_t word) noexcept nogil
    cdef void _accumulate(
        self,
        const uint64_t* pred,
        const uint64_t* routed,
        const uint64_t* resident,
        Py_ssize_t num_requests,
    ) noexcept nogil
