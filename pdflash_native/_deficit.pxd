# Declarations of the 2-D deficit verify scheduler core (see _deficit.pyx).
from libc.stdint cimport int64_t, uint8_t, uint64_t


cdef extern from *:
    """
    #include <stdint.h>
    #if defined(_MSC_VER)
    #include <intrin.h>
    static inline int pdflash_ctz64(unsigned long long x) { unsigned long i; _BitScanForward64(&i, x); return (int)i; }
    #define PDFLASH_POPCNT64(x) ((int)__popcnt64(x))
    #else
    static inline int pdflash_ctz64(unsigned long long x) { return __builtin_ctzll(x); }
    #define PDFLASH_POPCNT64(x) __builtin_popcountll(x)
    #endif

    /* Popcount of x & ~c over n words; may stop early (returning a partial
       count) once the count exceeds `stop` (stop < 0: never stop). */
    #define PDFLASH_ANDNOT_COUNT_BODY                                  \
        int64_t count = 0;                                             \
        for (int64_t w = 0; w < n; ++w) {                              \
            count += PDFLASH_POPCNT64(x[w] & ~c[w]);                   \
            if (stop >= 0 && (w & 3) == 3 && count > stop) return count; \
        }                                                              \
        return count;

    /* Bytes of x & ~c when every expert of word w has size wb[w]. */
    #define PDFLASH_ANDNOT_WEIGHTED_BODY                               \
        int64_t total = 0;                                             \
        for (int64_t w = 0; w < n; ++w) {                              \
            total += (int64_t)PDFLASH_POPCNT64(x[w] & ~c[w]) * wb[w];  \
            if (limit >= 0 && total > limit) return total;             \
        }                                                              \
        return total;

    static int64_t pdflash_andnot_weighted_generic(const uint64_t* x, const uint64_t* c, const int64_t* wb, int64_t n, int64_t limit) {
        PDFLASH_ANDNOT_WEIGHTED_BODY
    }
    static int64_t pdflash_andnot_count_generic(const uint64_t* x, const uint64_t* c, int64_t n, int64_t stop) {
        PDFLASH_ANDNOT_COUNT_BODY
    }
    #if defined(__GNUC__) && defined(__x86_64__)
    /* NOTE: built for the POPCNT instruction and chosen at run time, so the
       wheel still runs on x86-64 CPUs without it (libgcc's software popcount
       is several times slower in the hot loop). */
    __attribute__((target("popcnt")))
    static int64_t pdflash_andnot_count_popcnt(const uint64_t* x, const uint64_t* c, int64_t n, int64_t stop) {
        PDFLASH_ANDNOT_COUNT_BODY
    }
    __attribute__((target("popcnt")))
    static int64_t pdflash_andnot_weighted_popcnt(const uint64_t* x, const uint64_t* c, const int64_t* wb, int64_t n, int64_t limit) {
        PDFLASH_ANDNOT_WEIGHTED_BODY
    }
    static int pdflash_has_popcnt = 0;
    static void pdflash_cpu_init(void) {
        __builtin_cpu_init();
        pdflash_has_popcnt = __builtin_cpu_supports("popcnt") ? 1 : 0;
    }
    static inline int64_t pdflash_andnot_count(const uint64_t* x, const uint64_t* c, int64_t n, int64_t stop) {
        return pdflash_has_popcnt ? pdflash_andnot_count_popcnt(x, c, n, stop)
                                  : pdflash_andnot_count_generic(x, c, n, stop);
    }
    static inline int64_t pdflash_andnot_weighted(const uint64_t* x, const uint64_t* c, const int64_t* wb, int64_t n, int64_t limit) {
        return pdflash_has_popcnt ? pdflash_andnot_weighted_popcnt(x, c, wb, n, limit)
                                  : pdflash_andnot_weighted_generic(x, c, wb, n, limit);
    }
    static int pdflash_uses_popcnt(void) { return pdflash_has_popcnt; }
    static void pdflash_disable_popcnt(void) { pdflash_has_popcnt = 0; }
    #else
    static void pdflash_cpu_init(void) {}
    static inline int64_t pdflash_andnot_count(const uint64_t* x, const uint64_t* c, int64_t n, int64_t stop) {
        return pdflash_andnot_count_generic(x, c, n, stop);
    }
    static inline int64_t pdflash_andnot_weighted(const uint64_t* x, const uint64_t* c, const int64_t* wb, int64_t n, int64_t limit) {
        return pdflash_andnot_weighted_generic(x, c, wb, n, limit);
    }
    static int pdflash_uses_popcnt(void) { return 0; }
    static void pdflash_disable_popcnt(void) {}
    #endif
    """
    int pdflash_ctz64(unsigned long long x) nogil
    int64_t pdflash_andnot_count(const uint64_t* x, const uint64_t* c, int64_t n, int64_t stop) nogil
    int64_t pdflash_andnot_weighted(const uint64_t* x, const uint64_t* c, const int64_t* wb, int64_t n, int64_t limit) nogil
    void pdflash_cpu_init()
    int pdflash_uses_popcnt()
    void pdflash_disable_popcnt()


cdef class DeficitCore:
    cdef readonly Py_ssize_t num_flat
    cdef readonly Py_ssize_t num_words
    cdef readonly Py_ssize_t size
    cdef Py_ssize_t capacity
    cdef bint busy  # a step is running without the GIL
    cdef readonly int64_t token_budget
    cdef readonly int64_t byte_budget  # < 0: unbounded (token-only mode)
    cdef readonly int64_t max_requests  # 0: no cap
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
