# Bit operations on 64-bit words, as inline C (no Python objects): the one
# home of popcount, ctz, mask packing and the and-not bitset kernels for
# every native module.
#
# NOTE: the build passes no -mpopcnt/-march, so the wheel runs on any x86-64
# CPU. The POPCNT instruction is chosen at run time instead: the word-loop
# kernels exist twice (portable and target("popcnt")), and the single-word
# popcount64 is one POPCNT in inline asm behind a well-predicted flag test
# (a target("popcnt") function could not be inlined into portable callers).
# The flag is per extension module (static): each module calls cpu_init()
# at import; until then it uses the portable code, which is always correct.
from libc.stdint cimport int64_t, uint64_t


cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>
    #if defined(_MSC_VER)
    #include <intrin.h>
    #endif
    #if defined(__SSE2__)
    #include <emmintrin.h>
    #endif
    #if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
    #error "pdflash_pack8 assumes a little-endian host"
    #endif

    /* Portable popcount for compilers without a builtin. */
    static inline int pdflash_popcount64_swar(uint64_t x) {
        x = x - ((x >> 1) & 0x5555555555555555ULL);
        x = (x & 0x3333333333333333ULL) + ((x >> 2) & 0x3333333333333333ULL);
        x = (x + (x >> 4)) & 0x0f0f0f0f0f0f0f0fULL;
        return (int)((x * 0x0101010101010101ULL) >> 56);
    }

    #if defined(__GNUC__) && defined(__x86_64__)
    #define PDFLASH_POPCNT_DISPATCH 1
    #define PDFLASH_POPCNT_TARGET __attribute__((target("popcnt")))
    #define PDFLASH_POPCNT_HW(x) __builtin_popcountll(x)  /* inside PDFLASH_POPCNT_TARGET */
    #define PDFLASH_POPCNT_SW(x) __builtin_popcountll(x)
    #elif defined(_MSC_VER) && defined(_M_X64)
    #define PDFLASH_POPCNT_DISPATCH 1
    #define PDFLASH_POPCNT_TARGET
    #define PDFLASH_POPCNT_HW(x) ((int)__popcnt64(x))
    #define PDFLASH_POPCNT_SW(x) pdflash_popcount64_swar(x)
    #elif defined(__GNUC__)
    #define PDFLASH_POPCNT_DISPATCH 0
    #define PDFLASH_POPCNT_SW(x) __builtin_popcountll(x)
    #else
    #define PDFLASH_POPCNT_DISPATCH 0
    #define PDFLASH_POPCNT_SW(x) pdflash_popcount64_swar(x)
    #endif

    #if defined(_MSC_VER)
    static inline int pdflash_ctz64(uint64_t x) { unsigned long i; _BitScanForward64(&i, x); return (int)i; }
    #else
    static inline int pdflash_ctz64(uint64_t x) { return __builtin_ctzll(x); }
    #endif

    /* 1: this module uses the POPCNT instruction (set by pdflash_cpu_init). */
    static int pdflash_has_popcnt = 0;

    static void pdflash_cpu_init(void) {
    #if defined(__GNUC__) && defined(__x86_64__)
        __builtin_cpu_init();
        pdflash_has_popcnt = __builtin_cpu_supports("popcnt") ? 1 : 0;
    #elif defined(_MSC_VER) && defined(_M_X64)
        int info[4];
        __cpuid(info, 1);
        pdflash_has_popcnt = (info[2] >> 23) & 1;  /* CPUID.01H:ECX.POPCNT */
    #endif
    }
    static int pdflash_uses_popcnt(void) { return pdflash_has_popcnt; }
    /* Tests only: 0 forces the portable code, 1 re-detects the CPU. */
    static void pdflash_set_popcnt(int enabled) {
        if (enabled) pdflash_cpu_init(); else pdflash_has_popcnt = 0;
    }

    static inline int pdflash_popcount64(uint64_t x) {
    #if defined(__GNUC__) && defined(__x86_64__)
        if (__builtin_expect(pdflash_has_popcnt, 1)) {
            uint64_t r;
            /* xor first: breaks POPCNT's false dependency on its output
               register on several Intel cores (what GCC emits as well). */
            __asm__("xorl %k0, %k0\\n\\tpopcntq %1, %0" : "=&r"(r) : "rm"(x) : "cc");
            return (int)r;
        }
        /* inline, not libgcc's __popcountdi2: a call in the cold branch
           would cost the hot loop its caller-saved registers */
        return pdflash_popcount64_swar(x);
    #elif defined(_MSC_VER) && defined(_M_X64)
        return pdflash_has_popcnt ? (int)__popcnt64(x) : pdflash_popcount64_swar(x);
    #else
        return PDFLASH_POPCNT_SW(x);
    #endif
    }

    /* Pack 8 mask bytes (any nonzero byte is true) into 8 bits, byte i -> bit i. */
    static inline uint64_t pdflash_pack8(const uint8_t* p) {
        uint64_t x;
        memcpy(&x, p, 8);
        /* high bit of each byte := (byte != 0) */
        x = (((x & 0x7f7f7f7f7f7f7f7fULL) + 0x7f7f7f7f7f7f7f7fULL) | x) & 0x8080808080808080ULL;
        /* gather the 8 high bits into the top byte (little-endian byte order) */
        return ((x >> 7) * 0x0102040810204080ULL) >> 56;
    }
    /* Pack 16 mask bytes into 16 bits (byte i -> bit i). */
    static inline uint64_t pdflash_pack16(const uint8_t* p) {
    #if defined(__SSE2__)
        __m128i v = _mm_loadu_si128((const __m128i*)p);
        int zero = _mm_movemask_epi8(_mm_cmpeq_epi8(v, _mm_setzero_si128()));
        return (uint64_t)(~zero & 0xffff);
    #else
        return pdflash_pack8(p) | (pdflash_pack8(p + 8) << 8);
    #endif
    }

    /* Popcount of x & ~c over n words; may stop early (returning a partial
       count) once the count exceeds `stop` (stop < 0: never stop). */
    #define PDFLASH_ANDNOT_COUNT_BODY(POPCNT)                          \\
        int64_t count = 0;                                             \\
        for (int64_t w = 0; w < n; ++w) {                              \\
            count += POPCNT(x[w] & ~c[w]);                             \\
            if (stop >= 0 && (w & 3) == 3 && count > stop) return count; \\
        }                                                              \\
        return count;

    /* Bytes of x & ~c when every expert of word w has size wb[w]; may stop
       early once the total exceeds `limit` (limit < 0: never stop). */
    #define PDFLASH_ANDNOT_WEIGHTED_BODY(POPCNT)                       \\
        int64_t total = 0;                                             \\
        for (int64_t w = 0; w < n; ++w) {                              \\
            total += (int64_t)POPCNT(x[w] & ~c[w]) * wb[w];            \\
            if (limit >= 0 && total > limit) return total;             \\
        }                                                              \\
        return total;

    static int64_t pdflash_andnot_count_portable(const uint64_t* x, const uint64_t* c, int64_t n, int64_t stop) {
        PDFLASH_ANDNOT_COUNT_BODY(PDFLASH_POPCNT_SW)
    }
    static int64_t pdflash_andnot_weighted_portable(const uint64_t* x, const uint64_t* c, const int64_t* wb, int64_t n, int64_t limit) {
        PDFLASH_ANDNOT_WEIGHTED_BODY(PDFLASH_POPCNT_SW)
    }
    #if PDFLASH_POPCNT_DISPATCH
    PDFLASH_POPCNT_TARGET
    static int64_t pdflash_andnot_count_popcnt(const uint64_t* x, const uint64_t* c, int64_t n, int64_t stop) {
        PDFLASH_ANDNOT_COUNT_BODY(PDFLASH_POPCNT_HW)
    }
    PDFLASH_POPCNT_TARGET
    static int64_t pdflash_andnot_weighted_popcnt(const uint64_t* x, const uint64_t* c, const int64_t* wb, int64_t n, int64_t limit) {
        PDFLASH_ANDNOT_WEIGHTED_BODY(PDFLASH_POPCNT_HW)
    }
    #endif
    static inline int64_t pdflash_andnot_count(const uint64_t* x, const uint64_t* c, int64_t n, int64_t stop) {
    #if PDFLASH_POPCNT_DISPATCH
        if (pdflash_has_popcnt) return pdflash_andnot_count_popcnt(x, c, n, stop);
    #endif
        return pdflash_andnot_count_portable(x, c, n, stop);
    }
    static inline int64_t pdflash_andnot_weighted(const uint64_t* x, const uint64_t* c, const int64_t* wb, int64_t n, int64_t limit) {
    #if PDFLASH_POPCNT_DISPATCH
        if (pdflash_has_popcnt) return pdflash_andnot_weighted_popcnt(x, c, wb, n, limit);
    #endif
        return pdflash_andnot_weighted_portable(x, c, wb, n, limit);
    }
    """
    void cpu_init "pdflash_cpu_init"() nogil
    int uses_popcnt "pdflash_uses_popcnt"() nogil
    void set_popcnt "pdflash_set_popcnt"(int enabled) nogil
    int popcount64 "pdflash_popcount64"(unsigned long long x) nogil
    int ctz64 "pdflash_ctz64"(unsigned long long x) nogil
    unsigned long long pack8 "pdflash_pack8"(const unsigned char* p) nogil
    unsigned long long pack16 "pdflash_pack16"(const unsigned char* p) nogil
    int64_t andnot_count "pdflash_andnot_count"(
        const uint64_t* x, const uint64_t* c, int64_t n, int64_t stop) nogil
    int64_t andnot_weighted "pdflash_andnot_weighted"(
        const uint64_t* x, const uint64_t* c, const int64_t* wb, int64_t n,
        int64_t limit) nogil
