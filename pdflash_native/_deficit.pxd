# Declarations of the 2-D deficit verify scheduler core (see _deficit.pyx).
from libc.stdint cimport int64_t, uint8_t, uint64_t


cdef extern from *:
    """
    #if defined(_MSC_VER)
    #include <intrin.h>
    static inline int pdflash_popcount64(unsigned long long x) { return (int)__popcnt64(x); }
    static inline int pdflash_ctz64(unsigned long long x) { unsigned long i; _BitScanForward64(&i, x); return (int)i; }
    #else
    static inline int pdflash_popcount64(unsigned long long x) { return __builtin_popcountll(x); }
    static inline int pdflash_ctz64(unsigned long long x) { return __builtin_ctzll(x); }
    #endif
    """
    int pdflash_popcount64(unsigned long long x) nogil
    int pdflash_ctz64(unsigned long long x) nogil


cdef class DeficitCore:
    cdef readonly Py_ssize_t num_flat
    cdef readonly Py_ssize_t num_words
    cdef readonly Py_ssize_t size
    cdef Py_ssize_t capacity
    cdef readonly int64_t token_budget
    cdef readonly int64_t byte_budget  # < 0: unbounded (token-only mode)
    cdef readonly int64_t max_requests  # 0: no cap
    cdef readonly double quantum
    cdef readonly int64_t lap
    cdef readonly int64_t cursor_seq
    cdef int64_t uniform_bytes  # >= 0: every expert has this size (popcount path)

    # per request, in ring order (index 0 .. size-1)
    cdef int64_t[::1] seq
    cdef double[::1] weight
    cdef double[::1] deficit
    cdef int64_t[::1] credit_lap
    cdef int64_t[::1] tokens  # 1 + drafts; 0 = no pending demand
    cdef uint64_t[:, ::1] bits

    cdef uint64_t[::1] resident
    cdef int64_t[::1] expert_bytes

    # per-step scratch and results (reused; never reallocated per step)
    cdef uint64_t[::1] covered
    cdef uint64_t[::1] union_bits
    cdef int64_t[::1] candidates
    cdef uint8_t[::1] served
    cdef double[::1] quanta
    cdef int64_t[::1] out_index
    cdef int64_t[::1] out_requested
    cdef int64_t[::1] out_grant
    cdef int64_t[::1] out_marginal
    cdef double[::1] out_cost
    cdef int64_t[::1] union_ids
    cdef uint8_t[::1] union_mask
    cdef readonly Py_ssize_t batch_size
    cdef readonly Py_ssize_t union_size
    cdef readonly bint oversize
    cdef readonly bint cap_reached

    cdef void _grow(self)
    cdef Py_ssize_t _step(self) noexcept nogil
    cdef void _finish_union(self, Py_ssize_t batch) noexcept nogil
