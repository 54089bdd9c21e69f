# Bit operations on 64-bit words, as inline C (no Python objects).
#
# NOTE: GCC/Clang builtins; with -mpopcnt (set for x86-64 in CMake) the
# popcount is one instruction, otherwise the compiler's portable sequence.
cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>
    #if defined(__SSE2__)
    #include <emmintrin.h>
    #endif
    #if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
    #error "pdflash_pack8 assumes a little-endian host"
    #endif
    static inline int pdflash_popcount64(uint64_t x) { return __builtin_popcountll(x); }
    static inline int pdflash_ctz64(uint64_t x) { return __builtin_ctzll(x); }
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
    """
    int popcount64 "pdflash_popcount64"(unsigned long long x) nogil
    int ctz64 "pdflash_ctz64"(unsigned long long x) nogil
    unsigned long long pack8 "pdflash_pack8"(const unsigned char* p) nogil
    unsigned long long pack16 "pdflash_pack16"(const unsigned char* p) nogil
