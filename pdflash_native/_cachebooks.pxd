# Declarations of the expert cache's native books (see _cachebooks.pyx).
from libc.stdint cimport int32_t, int64_t, uint8_t


cdef class CacheBooks:
    # views of the cache's own arrays (bool arrays as uint8)
    cdef int64_t[::1] slot_of
    cdef int64_t[::1] expert_of
    cdef int32_t[::1] pins
    cdef int64_t[::1] ticket
    cdef int64_t[::1] key
    cdef int64_t[::1] band
    cdef uint8_t[::1] used
    cdef uint8_t[::1] counted
    cdef uint8_t[::1] by_prefetch
    cdef readonly Py_ssize_t num_ids
    cdef readonly Py_ssize_t num_slots
    cdef readonly int64_t num_experts
    cdef int64_t[::1] seen  # apply_access's scratch, one per expert of a layer
    cdef uint8_t[::1] mark  # the capacity queries' scratch, one per slot, kept all 0
    cdef object no_ids  # a read-only empty int64 array (nothing in flight)

    cdef bint _evictable(self, Py_ssize_t s) noexcept nogil
    cdef void _add_pins(self, const int64_t[:] slots, int32_t delta) noexcept nogil
    cdef object _evictable_list(self, const int64_t[:] exclude, bint ids)
    cdef Py_ssize_t _mark_excluded(self, const int64_t[:] exclude, uint8_t value) except -1
