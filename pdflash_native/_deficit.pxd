# Declarations of the 2-D deficit verify scheduler core (see _deficit.pyx).
from libc.stdint cimport int64_t, uint8_t, uint64_t


cdef class DeficitCore:
    cdef readonly Py_ssize_t num_flat
    cdef readonly Py_ssize_t num_words
    cdef readonly Py_ssize_t size
    cdef Py_ssize_t capacity
    cdef bint busy  # a step is running without the GIL
    cdef readonly int64_t token_budget
    cdef readonly int64_t byte_budget  # < 0: unbounded (token-only mode)
    cdef readonly int64_t max_requests  # 0: no cap
    cdef readonly int64_t fixed_bytes  # F of the marginal rule; < 0: M is hard
    cdef readonly double quantum
    cdef readonly int64_t lap
    cdef readonly int64_t cursor_seq
    cdef readonly bint visit_open  # the request at cursor_seq continues its visit
    cdef int64_t uniform_bytes  # >= 0: every expert has this size (popcount path)
    cdef bint word_uniform  # every bitset word's experts share one size ...
    cdef int64_t[::1] word_bytes  # ... this one (weighted popcount path)

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
    cdef int64_t[::1] cand_lower  # lower bound of a candidate's marginal bytes ...
    cdef int64_t[::1] cand_used_at  # ... and the batch's bytes when it was taken
    cdef uint8_t[::1] served
    cdef double[::1] quanta
    cdef int64_t[::1] out_index
    cdef int64_t[::1] out_requested
    cdef int64_t[::1] out_grant
    cdef int64_t[::1] out_marginal
    cdef double[::1] out_cost
    cdef int64_t[::1] union_ids
    cdef uint8_t[::1] union_mask
    # the same buffers as ndarrays, so accessors return cheap slices
    cdef object a_deficit, a_tokens, a_quanta, a_union_ids, a_union_mask
    cdef object a_out_index, a_out_requested, a_out_grant, a_out_marginal, a_out_cost
    cdef readonly Py_ssize_t batch_size
    cdef readonly Py_ssize_t union_size
    cdef readonly bint oversize
    cdef readonly bint cap_reached
    cdef readonly Py_ssize_t passes  # scan passes in the last step
    cdef readonly int violation  # 0, or the first self-check the last step failed
    cdef readonly Py_ssize_t examined  # candidate examinations in the last step

    cdef void _grow(self)
    cdef int _check_idle(self) except -1
    cdef Py_ssize_t _step(self) noexcept nogil
    cdef void _finish_union(self, Py_ssize_t batch) noexcept nogil
    cdef int _self_check(self, Py_ssize_t num_cand) noexcept nogil
