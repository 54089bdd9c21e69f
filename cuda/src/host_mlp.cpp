// The host expert MLP (see include/pdflash/host_mlp.h for the math and the
// packed layout). Three variants of the dot products, chosen at run time
// (each compiled with a per-function target attribute: the library is built
// without -m flags so it loads on any x86-64 CPU): AMX BF16 tiles,
// AVX-512 BF16, and portable scalar C++. The scalar and AVX-512 loops
// accumulate each output column over the pairs in the same order, odd
// element of a pair first (as VDPBF16PS does), and share one exp
// polynomial, so they agree up to denormal handling (VDPBF16PS treats
// denormal inputs as zero); AMX sums each 16-pair step in its own order.
// The epilogues (biases, activation, bf16 rounding) are AVX-512 wherever
// AVX-512 or AMX runs. MXFP4 and FP8 tiles are decoded to the bf16 layout
// (dequant_scalar_* / dequant_avx, bit-identical; or in registers inside
// the AVX-512 and AMX loops) and then multiplied exactly as bf16 tiles are;
// FP8's column scales multiply the accumulators in the epilogues.
#include "pdflash/host_mlp.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define PDFLASH_MLP_X86 1
#include <cpuid.h>
#include <immintrin.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#define PDFLASH_AVX512BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))
#define PDFLASH_AMX __attribute__((target("amx-tile,amx-bf16,avx512f")))
#define PDFLASH_AMX_Q \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))
#else
#define PDFLASH_MLP_X86 0
#endif

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#define PDFLASH_MLP_FUTEX 1
#else
#define PDFLASH_MLP_FUTEX 0
#endif

namespace pdflash {

namespace {

constexpr int64_t kTileCols = 32;   // columns of one packed tile
constexpr int64_t kW1TileInter = 16;  // intermediate indices per W1 tile
constexpr int64_t kRowChunk = 16;   // rows computed per pass over a tile
constexpr int kRegRows = 8;         // rows whose accumulators fit in registers
constexpr int64_t kKBlock = 128;    // pairs per block when rows > kRegRows (16 KiB of W)
constexpr int64_t kPairAlign = 16;  // pairs of a tile: a whole number of AMX K steps

// Stored bytes of one pair row of a tile (64 weights) in each format.
constexpr int64_t stored_pair_bytes(WeightFormat f) {
  return f == WeightFormat::kMxfp4 ? 32 : f == WeightFormat::kFp8 ? 64 : 128;
}

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

// exp(x), Cephes' single-precision polynomial; the AVX-512 variant below
// runs the same operations in the same order.
constexpr float kExpHi = 88.3762626647949f;
constexpr float kExpLo = -88.3762626647949f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f;
constexpr float kP1 = 1.3981999507e-3f;
constexpr float kP2 = 8.3334519073e-3f;
constexpr float kP3 = 4.1665795894e-2f;
constexpr float kP4 = 1.6666665459e-1f;
constexpr float kP5 = 5.0000001201e-1f;

inline float exp_scalar(float x) {
  x = std::min(std::max(x, kExpLo), kExpHi);
  const float n = std::nearbyint(x * kLog2e);
  float r = std::fma(-n, kLn2Hi, x);
  r = std::fma(-n, kLn2Lo, r);
  float p = kP0;
  p = std::fma(p, r, kP1);
  p = std::fma(p, r, kP2);
  p = std::fma(p, r, kP3);
  p = std::fma(p, r, kP4);
  p = std::fma(p, r, kP5);
  const float r2 = r * r;
  float y = std::fma(p, r2, r);
  y = y + 1.0f;
  return std::ldexp(y, static_cast<int>(n));
}

inline float sigmoid_scalar(float z) { return 1.0f / (1.0f + exp_scalar(-z)); }

// The activation on one (gate, up) pair, fp32 in, fp32 out.
inline float act_scalar(const MlpShape& s, float gate, float up) {
  if (s.act == static_cast<int32_t>(MlpAct::kGptOssClamp)) {
    gate = std::min(gate, s.limit);
    up = std::min(std::max(up, -s.limit), s.limit);
    const float glu = gate * sigmoid_scalar(gate * s.alpha);
    return (up + 1.0f) * glu;
  }
  return gate * sigmoid_scalar(gate) * up;
}

// Everything one call needs, shared by the team.
struct Job {
  MlpShape shape;
  const MlpExpert* experts = nullptr;
  int64_t n_experts = 0;
  int64_t hidden_pairs = 0;
  int64_t inter_pad = 0;
  int64_t inter_pairs = 0;
  int64_t tiles1 = 0;  // W1 tiles per expert
  int64_t tiles2 = 0;  // W2 tiles per expert
  const uint16_t* xb = nullptr;  // bf16 [rows][2 * hidden_pairs]
  uint16_t* g = nullptr;         // bf16 [rows][inter_pad]
  void* out = nullptr;
  FloatType out_type = FloatType::kF32;
  int64_t out_stride = 0;
  bool avx = false;
  bool amx = false;  // AMX for row chunks of >= amx_min_rows rows
  int64_t amx_min_rows = 1;
  WeightFormat weights = WeightFormat::kBf16;  // the experts' stored weights
};

// ---- scalar -----------------------------------------------------------------

// acc[r][c] (+)= sum over pairs [p0, p1) of the tile's column c times row r.
void dot_scalar(const uint16_t* wt, const uint16_t* in, int64_t in_stride_pairs, int64_t nr,
                int64_t p0, int64_t p1, float* acc, bool init) {
  if (init) std::fill(acc, acc + nr * kTileCols, 0.0f);
  for (int64_t r = 0; r < nr; ++r) {
    const uint16_t* xr = in + 2 * r * in_stride_pairs;
    float* a = acc + r * kTileCols;
    for (int64_t p = p0; p < p1; ++p) {
      const float x0 = bf16_to_f32(xr[2 * p]);
      const float x1 = bf16_to_f32(xr[2 * p + 1]);
      const uint16_t* w = wt + p * kTileCols * 2;
      for (int64_t c = 0; c < kTileCols; ++c) {
        float t = a[c] + bf16_to_f32(w[2 * c + 1]) * x1;
        a[c] = t + bf16_to_f32(w[2 * c]) * x0;
      }
    }
  }
}

// MXFP4 codes of `npairs` pairs (a multiple of 16) and their scales -> the
// bf16 layout's pair rows in `out` (host_mlp.h); dequant_avx does the same.
void dequant_scalar_mxfp4(const uint8_t* q, const uint8_t* s, int64_t npairs, uint16_t* out) {
  static constexpr uint16_t kLut[16] = {0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040,
                                        0x4080, 0x40C0, 0x8000, 0xBF00, 0xBF80, 0xBFC0,
                                        0xC000, 0xC040, 0xC080, 0xC0C0};
  for (int64_t p = 0; p < npairs; ++p) {
    const uint8_t* qp = q + p * kTileCols;
    const uint8_t* sg = s + (p / kPairAlign) * kTileCols;
    uint16_t* o = out + p * kTileCols * 2;
    for (int64_t i = 0; i < 2 * kTileCols; ++i) {
      const unsigned code = i < kTileCols ? qp[i] & 0xFu : qp[i - kTileCols] >> 4;
      const int exp_add = (static_cast<int>(sg[i / 2]) - 127) * 128;
      o[i] = (code & 7u) ? static_cast<uint16_t>(kLut[code] + exp_add) : kLut[code];
    }
  }
}

// e4m3fn magnitudes (the code less its sign bit) -> their values' bf16 bits,
// exactly (every e4m3 value is a bf16 value): a normal one's exponent
// rebiased (7 -> 127) and mantissa moved, a subnormal one (exponent 0:
// m * 2^-9) from its own entries. 127 is NaN, refused when packed.
constexpr uint16_t e4m3_magnitude_bf16(unsigned mag) {
  constexpr uint16_t kSubnormal[8] = {0x0000, 0x3B00, 0x3B80, 0x3BC0,
                                      0x3C00, 0x3C20, 0x3C40, 0x3C60};
  return static_cast<uint16_t>((mag >> 3) ? (mag << 4) + (120u << 7) : kSubnormal[mag & 7u]);
}

struct E4m3Table {
  alignas(64) uint16_t bits[128];
};

constexpr E4m3Table make_e4m3_table() {
  E4m3Table t{};
  for (unsigned m = 0; m < 128; ++m) t.bits[m] = e4m3_magnitude_bf16(m);
  return t;
}

constexpr E4m3Table kE4m3Bf16 = make_e4m3_table();

// One e4m3fn byte -> its value's bf16 bits.
inline uint16_t e4m3_bf16(uint8_t b) {
  return static_cast<uint16_t>(kE4m3Bf16.bits[b & 0x7Fu] | ((b & 0x80u) << 8));
}

// FP8 codes of `npairs` pairs -> the bf16 layout's pair rows in `out` (the
// codes are stored in the layout's places, one byte each; their per-column
// scales are applied to the accumulators, not here).
void dequant_scalar_fp8(const uint8_t* q, int64_t npairs, uint16_t* out) {
  for (int64_t i = 0; i < npairs * kTileCols * 2; ++i) out[i] = e4m3_bf16(q[i]);
}

// ---- AVX-512 BF16 -------------------------------------------------------------

#if PDFLASH_MLP_X86
// R rows' accumulators of a tile's 32 columns (two registers a row): from 0
// or from acc, one pair row of weights (w0, w1: its two 64-byte halves)
// added, and stored back.
template <int R>
PDFLASH_AVX512BF16 inline void acc_load(__m512 (&a)[R][2], const float* acc, bool init) {
  for (int r = 0; r < R; ++r) {
    a[r][0] = init ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + r * kTileCols);
    a[r][1] = init ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + r * kTileCols + 16);
  }
}

template <int R>
PDFLASH_AVX512BF16 inline void acc_pair(__m512 (&a)[R][2], __m512i w0, __m512i w1,
                                        const uint32_t* in, int64_t in_stride_pairs, int64_t p) {
  for (int r = 0; r < R; ++r) {
    const __m512i xv = _mm512_set1_epi32(static_cast<int>(in[r * in_stride_pairs + p]));
    a[r][0] = _mm512_dpbf16_ps(a[r][0], (__m512bh)w0, (__m512bh)xv);
    a[r][1] = _mm512_dpbf16_ps(a[r][1], (__m512bh)w1, (__m512bh)xv);
  }
}

template <int R>
PDFLASH_AVX512BF16 inline void acc_store(__m512 (&a)[R][2], float* acc) {
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(acc + r * kTileCols, a[r][0]);
    _mm512_storeu_ps(acc + r * kTileCols + 16, a[r][1]);
  }
}

template <int R>
PDFLASH_AVX512BF16 void dot_avx_rows(const uint16_t* wt, const uint32_t* in,
                                     int64_t in_stride_pairs, int64_t p0, int64_t p1,
                                     float* acc, bool init) {
  __m512 a[R][2];
  acc_load<R>(a, acc, init);
  const uint16_t* w = wt + p0 * kTileCols * 2;
  for (int64_t p = p0; p < p1; ++p, w += kTileCols * 2) {
    acc_pair<R>(a, _mm512_loadu_si512(w), _mm512_loadu_si512(w + 32), in, in_stride_pairs, p);
  }
  acc_store<R>(a, acc);
}

// f(std::integral_constant<int, R>{}) for R = nr rows, 1..kRegRows (the
// register-resident row counts the AVX-512 loops are compiled for).
template <typename F>
inline void with_reg_rows(int nr, F&& f) {
  switch (nr) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, kRegRows>{}); break;
  }
}

PDFLASH_AVX512BF16 void dot_avx_group(const uint16_t* wt, const uint32_t* in,
                                      int64_t in_stride_pairs, int nr, int64_t p0, int64_t p1,
                                      float* acc, bool init) {
  with_reg_rows(nr, [&](auto rows) {
    dot_avx_rows<decltype(rows)::value>(wt, in, in_stride_pairs, p0, p1, acc, init);
  });
}

// Up to kRowChunk rows over all pairs: one pass in registers for <= 8 rows;
// otherwise K-blocks (the block's weights stay in L1 while every row group
// runs over them), accumulators in acc between blocks.
// (init: acc starts at 0; else the products are added to it)
PDFLASH_AVX512BF16 void dot_avx(const uint16_t* wt, const uint16_t* in, int64_t in_stride_pairs,
                                int64_t nr, int64_t npairs, float* acc, bool init) {
  const uint32_t* in32 = reinterpret_cast<const uint32_t*>(in);
  if (nr <= kRegRows) {
    dot_avx_group(wt, in32, in_stride_pairs, static_cast<int>(nr), 0, npairs, acc, init);
    return;
  }
  for (int64_t p0 = 0; p0 < npairs; p0 += kKBlock) {
    const int64_t p1 = std::min(npairs, p0 + kKBlock);
    for (int64_t r0 = 0; r0 < nr; r0 += kRegRows) {
      const int g = static_cast<int>(std::min<int64_t>(kRegRows, nr - r0));
      dot_avx_group(wt, in32 + r0 * in_stride_pairs, in_stride_pairs, g, p0, p1,
                    acc + r0 * kTileCols, init && p0 == 0);
    }
  }
}

// MXFP4 codes -> the bf16 layout (host_mlp.h): e2m1 values as bf16 bits,
// their exponent raised by scale - 127 (zeros kept).
alignas(64) constexpr uint16_t kE2m1Bf16[32] = {
    0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
    0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0,
    0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
    0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0};

// The constants of the e2m1 -> bf16 lookup.
struct Mxfp4Avx {
  __m512i lut, dup0, dup1, low, mag, bias;
};

PDFLASH_AVX512BF16 inline Mxfp4Avx mxfp4_avx_consts() {
  alignas(64) uint16_t dup[2][32];
  for (int i = 0; i < 32; ++i) {
    dup[0][i] = static_cast<uint16_t>(i / 2);
    dup[1][i] = static_cast<uint16_t>(16 + i / 2);
  }
  return {_mm512_load_si512(kE2m1Bf16), _mm512_load_si512(dup[0]), _mm512_load_si512(dup[1]),
          _mm512_set1_epi16(0xF),       _mm512_set1_epi16(7),        _mm512_set1_epi16(127)};
}

// A group's 32 column scales -> the exponent offsets of a pair row's two
// halves (e0: columns 0-15, e1: 16-31; each column's twice, as its pair).
PDFLASH_AVX512BF16 inline void mxfp4_avx_scales(const Mxfp4Avx& k, const uint8_t* s, __m512i& e0,
                                                __m512i& e1) {
  const __m512i sc = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
  const __m512i e = _mm512_slli_epi16(_mm512_sub_epi16(sc, k.bias), 7);
  e0 = _mm512_permutexvar_epi16(k.dup0, e);
  e1 = _mm512_permutexvar_epi16(k.dup1, e);
}

// One pair row's 32 code bytes -> its 64 bf16 weights (w0, w1: the layout's
// two 64-byte halves).
PDFLASH_AVX512BF16 inline void mxfp4_avx_pair(const Mxfp4Avx& k, const uint8_t* q, __m512i e0,
                                              __m512i e1, __m512i& w0, __m512i& w1) {
  const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
  const __m512i c0 = _mm512_and_si512(v, k.low), c1 = _mm512_srli_epi16(v, 4);
  w0 = _mm512_permutexvar_epi16(c0, k.lut);
  w1 = _mm512_permutexvar_epi16(c1, k.lut);
  w0 = _mm512_mask_add_epi16(w0, _mm512_test_epi16_mask(c0, k.mag), w0, e0);
  w1 = _mm512_mask_add_epi16(w1, _mm512_test_epi16_mask(c1, k.mag), w1, e1);
}

// FP8 (e4m3fn) codes -> bf16 bits, 32 lanes at a time (e4m3_bf16's table:
// its four quarters, two 64-entry lookups chosen by the magnitude's bit 6).
struct Fp8Avx {
  __m512i t0, t1, t2, t3, bit6, sign;
};

PDFLASH_AVX512BF16 inline Fp8Avx fp8_avx_consts() {
  return {_mm512_load_si512(kE4m3Bf16.bits), _mm512_load_si512(kE4m3Bf16.bits + 32),
          _mm512_load_si512(kE4m3Bf16.bits + 64), _mm512_load_si512(kE4m3Bf16.bits + 96),
          _mm512_set1_epi16(0x40), _mm512_set1_epi16(static_cast<int16_t>(0x8000))};
}

PDFLASH_AVX512BF16 inline __m512i fp8_avx_32(const Fp8Avx& k, const uint8_t* q) {
  const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
  // the lookups read index bits 5..0 (bit 5 picks the table): magnitudes
  // 0-63 from t0/t1, 64-127 from t2/t3
  const __m512i lo = _mm512_permutex2var_epi16(k.t0, v, k.t1);
  const __m512i hi = _mm512_permutex2var_epi16(k.t2, v, k.t3);
  const __m512i w = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(v, k.bit6), lo, hi);
  // w | (v << 8 & 0x8000): the sign bit
  return _mm512_ternarylogic_epi32(w, _mm512_slli_epi16(v, 8), k.sign, 0xF8);
}

// Decoders of a tile's stored pair rows to the bf16 layout's (w0, w1: its two
// 64-byte halves), for the loops below: kPairBytes stored bytes a pair row;
// kGroupScales: group() takes each 16-pair group's 32 column scales first.
struct Mxfp4AvxDecoder {
  static constexpr int64_t kPairBytes = kTileCols;
  static constexpr bool kGroupScales = true;
  Mxfp4Avx k;
  __m512i e0, e1;
  PDFLASH_AVX512BF16 void init() { k = mxfp4_avx_consts(); }
  PDFLASH_AVX512BF16 void group(const uint8_t* s) { mxfp4_avx_scales(k, s, e0, e1); }
  PDFLASH_AVX512BF16 void pair(const uint8_t* q, __m512i& w0, __m512i& w1) const {
    mxfp4_avx_pair(k, q, e0, e1, w0, w1);
  }
};

struct Fp8AvxDecoder {
  static constexpr int64_t kPairBytes = 2 * kTileCols;
  static constexpr bool kGroupScales = false;
  Fp8Avx k;
  PDFLASH_AVX512BF16 void init() { k = fp8_avx_consts(); }
  PDFLASH_AVX512BF16 void group(const uint8_t*) {}
  PDFLASH_AVX512BF16 void pair(const uint8_t* q, __m512i& w0, __m512i& w1) const {
    w0 = fp8_avx_32(k, q);
    w1 = fp8_avx_32(k, q + 32);
  }
};

// Stored pair rows [0, npairs) (a multiple of 16) -> the bf16 layout in `out`.
template <typename D>
PDFLASH_AVX512BF16 void dequant_avx(const uint8_t* q, const uint8_t* s, int64_t npairs,
                                    uint16_t* out) {
  D d;
  d.init();
  for (int64_t g = 0; g < npairs; g += kPairAlign) {
    if constexpr (D::kGroupScales) d.group(s + (g / kPairAlign) * kTileCols);
    for (int64_t p = g; p < g + kPairAlign; ++p) {
      __m512i w0, w1;
      d.pair(q + p * D::kPairBytes, w0, w1);
      _mm512_store_si512(out + p * kTileCols * 2, w0);
      _mm512_store_si512(out + p * kTileCols * 2 + 32, w1);
    }
  }
}

// dot_avx_rows for stored (quantized) tiles, every pair of the tile,
// decoded in registers (R <= kRegRows rows: each weight is used by every
// row at once).
template <int R, typename D>
PDFLASH_AVX512BF16 void dot_avx_rows_q(const uint8_t* q, const uint8_t* s, const uint32_t* in,
                                       int64_t in_stride_pairs, int64_t npairs, float* acc) {
  D d;
  d.init();
  __m512 a[R][2];
  acc_load<R>(a, acc, true);
  for (int64_t g = 0; g < npairs; g += kPairAlign) {
    if constexpr (D::kGroupScales) d.group(s + (g / kPairAlign) * kTileCols);
    for (int64_t p = g; p < g + kPairAlign; ++p) {
      __m512i w0, w1;
      d.pair(q + p * D::kPairBytes, w0, w1);
      acc_pair<R>(a, w0, w1, in, in_stride_pairs, p);
    }
  }
  acc_store<R>(a, acc);
}

template <typename D>
PDFLASH_AVX512BF16 void dot_avx_q(const uint8_t* q, const uint8_t* s, const uint16_t* in,
                                  int64_t in_stride_pairs, int nr, int64_t npairs, float* acc) {
  const uint32_t* in32 = reinterpret_cast<const uint32_t*>(in);
  with_reg_rows(nr, [&](auto rows) {
    dot_avx_rows_q<decltype(rows)::value, D>(q, s, in32, in_stride_pairs, npairs, acc);
  });
}

PDFLASH_AVX512BF16 inline __m512 exp_avx(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kExpLo)), _mm512_set1_ps(kExpHi));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kP0);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP5));
  const __m512 r2 = _mm512_mul_ps(r, r);
  __m512 y = _mm512_fmadd_ps(p, r2, r);
  y = _mm512_add_ps(y, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}

PDFLASH_AVX512BF16 inline __m512 sigmoid_avx(__m512 z) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 e = exp_avx(_mm512_sub_ps(_mm512_setzero_ps(), z));
  return _mm512_div_ps(one, _mm512_add_ps(one, e));
}

PDFLASH_AVX512BF16 inline __m512 act_avx(const MlpShape& s, __m512 gate, __m512 up) {
  if (s.act == static_cast<int32_t>(MlpAct::kGptOssClamp)) {
    const __m512 lim = _mm512_set1_ps(s.limit);
    gate = _mm512_min_ps(gate, lim);
    up = _mm512_min_ps(_mm512_max_ps(up, _mm512_sub_ps(_mm512_setzero_ps(), lim)), lim);
    const __m512 glu = _mm512_mul_ps(gate, sigmoid_avx(_mm512_mul_ps(gate, _mm512_set1_ps(s.alpha))));
    return _mm512_mul_ps(_mm512_add_ps(up, _mm512_set1_ps(1.0f)), glu);
  }
  return _mm512_mul_ps(_mm512_mul_ps(gate, sigmoid_avx(gate)), up);
}

PDFLASH_AVX512BF16 inline __m256i to_bf16_avx(__m512 v) {
  return (__m256i)_mm512_cvtneps_pbh(v);
}

// ---- AMX BF16 ---------------------------------------------------------------

// Tiles: 0, 1 = C (the tile's columns 0-15 and 16-31, fp32), 2 = A (rows x
// 16 pairs of the input), 3, 4 = B (16 pairs x 16 columns: the packed
// layout's pair rows are 128 bytes, B0 their first 64 bytes, B1 the rest).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// GCC's tile intrinsics are asm statements that name only their pointers
// (ldtilecfg: the config's first 8 bytes; tileloadd: none of the rows), so
// the compiler may sink, or drop as dead, the stores that fill the memory
// they read: a stack buffer filled just before its tile load, or a config
// whose stack slot it reuses. This empty statement reads the N bytes at p
// and orders every memory access around it; call it between the stores
// and the tile instruction that reads them.
template <size_t N>
inline void tile_reads(const void* p) {
  __asm__ volatile("" : : "m"(*static_cast<const char (*)[N]>(p)) : "memory");
}

// The tiles configured for nr rows, the C tiles zeroed.
PDFLASH_AMX inline void amx_begin(int64_t nr) {
  TileConfig cfg;
  for (int t = 0; t < 5; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = static_cast<uint8_t>(t < 3 ? nr : 16);
  }
  tile_reads<sizeof(TileConfig)>(&cfg);
  _tile_loadconfig(&cfg);
  _tile_zero(0);
  _tile_zero(1);
}

// One 16-pair step: A from `a` (rows `a_stride` bytes apart), B from 16
// bf16 pair rows at `b` (128 bytes each: B0 their first 64 bytes, B1 the rest).
PDFLASH_AMX inline void amx_step(const uint16_t* a, long a_stride, const uint16_t* b) {
  _tile_loadd(2, a, a_stride);
  _tile_loadd(3, b, 128);
  _tile_loadd(4, b + 32, 128);
  _tile_dpbf16ps(0, 2, 3);
  _tile_dpbf16ps(1, 2, 4);
}

PDFLASH_AMX inline void amx_end(float* acc) {
  _tile_stored(0, acc, kTileCols * 4);
  _tile_stored(1, acc + 16, kTileCols * 4);
}

PDFLASH_AMX void dot_amx(const uint16_t* wt, const uint16_t* in, int64_t in_stride_pairs,
                         int64_t nr, int64_t npairs, float* acc) {
  amx_begin(nr);
  const long a_stride = static_cast<long>(in_stride_pairs * 4);
  for (int64_t p = 0; p < npairs; p += kPairAlign) {
    amx_step(in + 2 * p, a_stride, wt + p * kTileCols * 2);
  }
  amx_end(acc);
}

// dot_amx for stored (quantized) tiles: each 16-pair step's B rows are
// decoded into a 2 KiB buffer (the bf16 layout) right before its tile
// loads, so the tile products run exactly as dot_amx's on the decoded
// weights.
template <typename D>
PDFLASH_AMX_Q void dot_amx_q(const uint8_t* q, const uint8_t* s, const uint16_t* in,
                             int64_t in_stride_pairs, int64_t nr, int64_t npairs, float* acc) {
  alignas(64) uint16_t step[kPairAlign * kTileCols * 2];
  D d;
  d.init();
  amx_begin(nr);
  const long a_stride = static_cast<long>(in_stride_pairs * 4);
  for (int64_t p = 0; p < npairs; p += kPairAlign) {
    if constexpr (D::kGroupScales) d.group(s + (p / kPairAlign) * kTileCols);
    for (int64_t i = 0; i < kPairAlign; ++i) {
      __m512i w0, w1;
      d.pair(q + (p + i) * D::kPairBytes, w0, w1);
      _mm512_store_si512(step + i * kTileCols * 2, w0);
      _mm512_store_si512(step + i * kTileCols * 2 + 32, w1);
    }
    tile_reads<sizeof(step)>(step);
    amx_step(in + 2 * p, a_stride, step);
  }
  amx_end(acc);
}

PDFLASH_AMX void amx_release() { _tile_release(); }

// AMX needs the CPU's AMX-TILE and AMX-BF16, the OS's XSAVE support of the
// tile state, and (Linux) the process's permission, requested once.
bool amx_usable() {
  static std::once_flag once;
  static bool ok = false;
  std::call_once(once, [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return;
    const bool amx_bf16 = (d >> 22) & 1u, amx_tile = (d >> 24) & 1u;
    if (!amx_bf16 || !amx_tile) return;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1u)) return;  // OSXSAVE
    uint32_t lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if (((lo >> 17) & 3u) != 3u) return;  // XTILECFG and XTILEDATA
#if defined(__linux__)
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) return;
#endif
    ok = true;
  });
  return ok;
}

// W1's epilogue on the accumulators of rows [r0, r0 + nr): biases, the
// activation, g as bf16.
PDFLASH_AVX512BF16 void w1_epilogue_avx(const Job& j, const MlpExpert& e, int64_t t, int64_t r0,
                                        int64_t nr, const float* cs, const float* acc) {
  const __m512 bg = e.b1 ? _mm512_loadu_ps(e.b1 + t * kW1TileInter) : _mm512_setzero_ps();
  const __m512 bu =
      e.b1 ? _mm512_loadu_ps(e.b1 + j.inter_pad + t * kW1TileInter) : _mm512_setzero_ps();
  // FP8's column scales (products then sums, as the scalar epilogue rounds)
  const __m512 sg = cs ? _mm512_loadu_ps(cs) : _mm512_set1_ps(1.0f);
  const __m512 su = cs ? _mm512_loadu_ps(cs + 16) : _mm512_set1_ps(1.0f);
  for (int64_t r = 0; r < nr; ++r) {
    const __m512 gate = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(acc + r * kTileCols), sg), bg);
    const __m512 up = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(acc + r * kTileCols + 16), su), bu);
    _mm256_storeu_si256(
        reinterpret_cast<__m256i*>(j.g + (r0 + r) * j.inter_pad + t * kW1TileInter),
        to_bf16_avx(act_avx(j.shape, gate, up)));
  }
}
#endif  // PDFLASH_MLP_X86

// ---- one tile's products, either format -------------------------------------

// Rows [0, nr) of `in` times pairs [0, npairs) of bf16 tile rows `wt` into
// acc (init: from 0), by the job's ISA for this many rows.
void dot_bf16(const Job& j, const uint16_t* wt, const uint16_t* in, int64_t in_pairs,
              int64_t nr, int64_t npairs, float* acc, bool init) {
#if PDFLASH_MLP_X86
  if (init && j.amx && nr >= j.amx_min_rows) {  // dot_amx starts from 0
    dot_amx(wt, in, in_pairs, nr, npairs, acc);
    return;
  }
  if (j.avx) {
    dot_avx(wt, in, in_pairs, nr, npairs, acc, init);
    return;
  }
#endif
  dot_scalar(wt, in, in_pairs, nr, 0, npairs, acc, init);
}

// acc[r][c] = row r of `in` times the tile's column c over its `npairs`
// pairs: the bf16 tile `wt`, or the stored codes `q` (and MXFP4's scales
// `s`), decoded per AMX step (AMX), in registers (AVX-512, up to kRegRows
// rows) or kKBlock pairs at a time into an L1 buffer of this thread (more
// rows with AVX-512, scalar).
void dot_tile(const Job& j, const uint16_t* wt, const uint8_t* q, const uint8_t* s,
              const uint16_t* in, int64_t in_pairs, int64_t nr, int64_t npairs, float* acc) {
  if (q == nullptr) {
    dot_bf16(j, wt, in, in_pairs, nr, npairs, acc, true);
    return;
  }
  const bool mx = j.weights == WeightFormat::kMxfp4;
#if PDFLASH_MLP_X86
  if (j.amx && nr >= j.amx_min_rows) {
    if (mx) {
      dot_amx_q<Mxfp4AvxDecoder>(q, s, in, in_pairs, nr, npairs, acc);
    } else {
      dot_amx_q<Fp8AvxDecoder>(q, s, in, in_pairs, nr, npairs, acc);
    }
    return;
  }
  if (j.avx && nr <= kRegRows) {
    const int n = static_cast<int>(nr);
    if (mx) {
      dot_avx_q<Mxfp4AvxDecoder>(q, s, in, in_pairs, n, npairs, acc);
    } else {
      dot_avx_q<Fp8AvxDecoder>(q, s, in, in_pairs, n, npairs, acc);
    }
    return;
  }
#endif
  alignas(64) static thread_local uint16_t block[kKBlock * kTileCols * 2];
  const int64_t pair_bytes = stored_pair_bytes(j.weights);
  for (int64_t p0 = 0; p0 < npairs; p0 += kKBlock) {
    const int64_t np = std::min(kKBlock, npairs - p0);
    const uint8_t* qb = q + p0 * pair_bytes;
    const uint8_t* sb = mx ? s + (p0 / kPairAlign) * kTileCols : nullptr;
#if PDFLASH_MLP_X86
    if (j.avx) {
      if (mx) {
        dequant_avx<Mxfp4AvxDecoder>(qb, sb, np, block);
      } else {
        dequant_avx<Fp8AvxDecoder>(qb, sb, np, block);
      }
      dot_bf16(j, block, in + 2 * p0, in_pairs, nr, np, acc, p0 == 0);
      continue;
    }
#endif
    if (mx) {
      dequant_scalar_mxfp4(qb, sb, np, block);
    } else {
      dequant_scalar_fp8(qb, np, block);
    }
    dot_bf16(j, block, in + 2 * p0, in_pairs, nr, np, acc, p0 == 0);
  }
}

// One tile's stored weights: bf16 values `wt`, or codes `q` with MXFP4's
// group scales `s` or FP8's column scales `cs` (host_mlp.h).
struct TileWeights {
  const uint16_t* wt = nullptr;
  const uint8_t* q = nullptr;
  const uint8_t* s = nullptr;
  const float* cs = nullptr;
};

TileWeights tile_weights(const Job& j, const uint16_t* w, const uint8_t* q, const uint8_t* s,
                         const float* cs, int64_t t, int64_t in_pairs) {
  TileWeights tw;
  switch (j.weights) {
    case WeightFormat::kBf16: tw.wt = w + t * in_pairs * kTileCols * 2; break;
    case WeightFormat::kMxfp4:
      tw.q = q + t * in_pairs * stored_pair_bytes(j.weights);
      tw.s = s + t * (in_pairs / kPairAlign) * kTileCols;
      break;
    case WeightFormat::kFp8:
      tw.q = q + t * in_pairs * stored_pair_bytes(j.weights);
      tw.cs = cs + t * kTileCols;
      break;
  }
  return tw;
}

// ---- one tile of each phase ----------------------------------------------------

// W1 tile t of expert e: the gate and up products of 16 intermediate
// indices for every row, biases, the activation, g stored as bf16.
void w1_tile(const Job& j, const MlpExpert& e, int64_t t, float* acc) {
  const MlpShape& s = j.shape;
  const int64_t in_pairs = j.hidden_pairs;
  const TileWeights tw = tile_weights(j, e.w1, e.q1, e.s1, e.c1, t, in_pairs);
  for (int64_t r0 = e.row_begin; r0 < e.row_end; r0 += kRowChunk) {
    const int64_t nr = std::min(kRowChunk, e.row_end - r0);
    const uint16_t* in = j.xb + r0 * 2 * in_pairs;
    dot_tile(j, tw.wt, tw.q, tw.s, in, in_pairs, nr, in_pairs, acc);
#if PDFLASH_MLP_X86
    if (j.avx) {
      w1_epilogue_avx(j, e, t, r0, nr, tw.cs, acc);
      continue;
    }
#endif
    for (int64_t r = 0; r < nr; ++r) {
      uint16_t* gr = j.g + (r0 + r) * j.inter_pad + t * kW1TileInter;
      for (int64_t c = 0; c < kW1TileInter; ++c) {
        float gate = acc[r * kTileCols + c];
        float up = acc[r * kTileCols + 16 + c];
        if (tw.cs) {
          gate = gate * tw.cs[c];
          up = up * tw.cs[16 + c];
        }
        if (e.b1) {
          gate = gate + e.b1[t * kW1TileInter + c];
          up = up + e.b1[j.inter_pad + t * kW1TileInter + c];
        }
        gr[c] = f32_to_bf16(act_scalar(s, gate, up));
      }
    }
  }
}

// W2 tile t of expert e: 32 output columns for every row, bias, stored.
void w2_tile(const Job& j, const MlpExpert& e, int64_t t, float* acc) {
  const int64_t in_pairs = j.inter_pairs;
  const int64_t hidden = j.shape.hidden;
  const TileWeights tw = tile_weights(j, e.w2, e.q2, e.s2, e.c2, t, in_pairs);
  const int64_t c0 = t * kTileCols;
  const int64_t ncols = std::min(kTileCols, hidden - c0);
  for (int64_t r0 = e.row_begin; r0 < e.row_end; r0 += kRowChunk) {
    const int64_t nr = std::min(kRowChunk, e.row_end - r0);
    const uint16_t* in = j.g + r0 * j.inter_pad;
    dot_tile(j, tw.wt, tw.q, tw.s, in, in_pairs, nr, in_pairs, acc);
    // the epilogue is a few hundred elements: scalar for both variants
    for (int64_t r = 0; r < nr; ++r) {
      float* a = acc + r * kTileCols;
      const int64_t row = r0 + r;
      if (tw.cs) {
        for (int64_t c = 0; c < ncols; ++c) a[c] = a[c] * tw.cs[c];
      }
      if (j.out_type == FloatType::kF32) {
        float* o = static_cast<float*>(j.out) + row * j.out_stride + c0;
        for (int64_t c = 0; c < ncols; ++c) o[c] = e.b2 ? a[c] + e.b2[c0 + c] : a[c];
      } else {
        uint16_t* o = static_cast<uint16_t*>(j.out) + row * j.out_stride + c0;
        for (int64_t c = 0; c < ncols; ++c) o[c] = f32_to_bf16(e.b2 ? a[c] + e.b2[c0 + c] : a[c]);
      }
    }
  }
}

// Claims a phase's items (expert, tile) one at a time from `next` until
// none is left, counting each finished one in `finished`: a thread that
// starts late (a parked worker waking up) or runs slower takes fewer, so the
// phase ends when the work does. Each item is one tile's contiguous
// weights, a sequential stream whoever reads it.
template <typename F>
void run_items(const Job& j, int64_t tiles, int64_t n, std::atomic<int64_t>& next,
               std::atomic<int64_t>& finished, float* acc, F tile) {
  for (int64_t k = next.fetch_add(1, std::memory_order_relaxed); k < n;
       k = next.fetch_add(1, std::memory_order_relaxed)) {
    const MlpExpert& e = j.experts[k / tiles];
    if (e.row_end > e.row_begin) tile(j, e, k % tiles, acc);
    finished.fetch_add(1, std::memory_order_release);
  }
}

inline void cpu_relax() {
#if PDFLASH_MLP_X86
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

}  // namespace

int64_t mlp_inter_pad(int64_t inter) {
  const int64_t m = 2 * kPairAlign;
  return (inter + m - 1) / m * m;
}

int64_t mlp_hidden_pairs(int64_t hidden) {
  return ((hidden + 1) / 2 + kPairAlign - 1) / kPairAlign * kPairAlign;
}

int64_t mlp_w1_elems(int64_t hidden, int64_t inter) {
  return (mlp_inter_pad(inter) / kW1TileInter) * mlp_hidden_pairs(hidden) * kTileCols * 2;
}

int64_t mlp_w2_elems(int64_t hidden, int64_t inter) {
  return ((hidden + kTileCols - 1) / kTileCols) * (mlp_inter_pad(inter) / 2) * kTileCols * 2;
}

int64_t mlp_mxfp4_code_bytes(int64_t elems) { return elems / 2; }
int64_t mlp_mxfp4_scale_bytes(int64_t elems) { return elems / (kPairAlign * 2); }
int64_t mlp_w1_tiles(int64_t inter) { return mlp_inter_pad(inter) / kW1TileInter; }
int64_t mlp_w2_tiles(int64_t hidden) { return (hidden + kTileCols - 1) / kTileCols; }

bool cpu_has_amx_bf16() {
#if PDFLASH_MLP_X86
  return cpu_has_avx512_bf16() && amx_usable();
#else
  return false;
#endif
}

bool cpu_has_avx512_bf16() {
#if PDFLASH_MLP_X86
  __builtin_cpu_init();
  // GCC's check includes the OS's XSAVE support of the AVX-512 state
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

struct HostMlpRunner::Impl {
  int threads = 1;
  std::chrono::microseconds spin{0};
  std::vector<std::thread> workers;
  // Each worker's kernel thread id (Linux; 0 until it has started), so the
  // caller can place the team on cores (sched_setaffinity takes a thread id).
  std::unique_ptr<std::atomic<int64_t>[]> tids;
  std::mutex call_mutex;  // one call at a time
  // Workers wait for the epoch to change: spin, then park. On Linux they
  // park on a futex on the epoch itself, all woken by one call with no mutex
  // to re-take one after another (a condition variable elsewhere).
  std::atomic<uint32_t> epoch{0};
  std::atomic<int> parked{0};
  std::atomic<bool> stop{false};
  std::mutex m;  // the condition variable's (no futex)
  std::condition_variable cv;
  const Job* job = nullptr;
  // The call in progress: its epoch while workers may join it (-1: none),
  // the workers inside it, and per phase the next unclaimed and the
  // finished items. A call ends when its work is done: a worker that wakes
  // after that finds the call closed and never touches its job.
  std::atomic<int64_t> open_epoch{-1};
  std::atomic<int> active{0};
  std::atomic<int64_t> next1{0}, next2{0}, finished1{0}, finished2{0};
  std::atomic<int64_t> calls{0};
  std::atomic<int32_t> last_isa{static_cast<int32_t>(MlpIsa::kAuto)};
  std::vector<uint16_t> xb, g;

  // Starts the next epoch and wakes parked workers.
  void publish() {
#if PDFLASH_MLP_FUTEX
    static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "futex word");
    epoch.fetch_add(1, std::memory_order_seq_cst);
    if (parked.load(std::memory_order_seq_cst) > 0)
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&epoch), FUTEX_WAKE_PRIVATE, INT_MAX,
              nullptr, nullptr, 0);
#else
    {
      std::lock_guard<std::mutex> lk(m);
      epoch.fetch_add(1, std::memory_order_seq_cst);
    }
    cv.notify_all();
#endif
  }

  // Blocks while the epoch is still `seen` (spurious returns allowed).
  void park(uint32_t seen) {
    parked.fetch_add(1, std::memory_order_seq_cst);
#if PDFLASH_MLP_FUTEX
    if (epoch.load(std::memory_order_seq_cst) == seen)
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&epoch), FUTEX_WAIT_PRIVATE, seen, nullptr,
              nullptr, 0);
#else
    {
      std::unique_lock<std::mutex> lk(m);
      cv.wait(lk, [&] { return epoch.load(std::memory_order_acquire) != seen; });
    }
#endif
    parked.fetch_sub(1, std::memory_order_seq_cst);
  }

  static void wait_until(const std::atomic<int64_t>& v, int64_t target) {
    for (int i = 0; v.load(std::memory_order_acquire) < target; ++i) {
      // more threads than free cores: let a descheduled one run
      if (i < 4096) cpu_relax(); else std::this_thread::yield();
    }
  }

  void execute() {
    const Job& j = *job;
    alignas(64) float acc[kRowChunk * kTileCols];
    const int64_t n1 = j.n_experts * j.tiles1, n2 = j.n_experts * j.tiles2;
    run_items(j, j.tiles1, n1, next1, finished1, acc, w1_tile);
    wait_until(finished1, n1);  // phase 2 reads every row of g
    run_items(j, j.tiles2, n2, next2, finished2, acc, w2_tile);
#if PDFLASH_MLP_X86
    if (j.amx) amx_release();  // the tile state off this thread (cheaper switches)
#endif
  }

  void worker(int index) {
#if defined(__linux__)
    tids[index].store(static_cast<int64_t>(syscall(SYS_gettid)), std::memory_order_release);
#else
    (void)index;
#endif
    uint32_t seen = 0;
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + spin;
      int i = 0;
      while (epoch.load(std::memory_order_acquire) == seen) {
        if ((++i & 255) == 0 && std::chrono::steady_clock::now() > until) break;
        cpu_relax();
      }
      while (epoch.load(std::memory_order_acquire) == seen) park(seen);
      seen = epoch.load(std::memory_order_acquire);
      if (stop.load(std::memory_order_acquire)) return;
      active.fetch_add(1, std::memory_order_seq_cst);
      if (open_epoch.load(std::memory_order_seq_cst) == static_cast<int64_t>(seen)) execute();
      active.fetch_sub(1, std::memory_order_release);
    }
  }

  void stop_workers() {
    stop.store(true, std::memory_order_release);
    publish();
    for (auto& w : workers) w.join();
    workers.clear();
  }
};

HostMlpRunner::HostMlpRunner(int threads, int spin_us) : impl_(new Impl) {
  if (threads < 1) throw std::invalid_argument("threads must be >= 1");
  if (spin_us < 0) throw std::invalid_argument("spin_us must be >= 0");
  impl_->threads = threads;
  impl_->spin = std::chrono::microseconds(spin_us);
  impl_->tids.reset(new std::atomic<int64_t>[threads > 1 ? threads - 1 : 1]);
  for (int t = 0; t < threads - 1; ++t) impl_->tids[t].store(0);
  try {
    for (int t = 1; t < threads; ++t)
      impl_->workers.emplace_back(&Impl::worker, impl_.get(), t - 1);
  } catch (...) {
    impl_->stop_workers();
    throw;
  }
#if defined(__linux__)
  // every worker's id is known once the team exists (each stores it first thing)
  for (int t = 0; t < threads - 1; ++t)
    while (impl_->tids[t].load(std::memory_order_acquire) == 0) std::this_thread::yield();
#endif
}

HostMlpRunner::~HostMlpRunner() {
  std::lock_guard<std::mutex> call(impl_->call_mutex);
  impl_->stop_workers();
}

int HostMlpRunner::threads() const { return impl_->threads; }
std::vector<int64_t> HostMlpRunner::worker_tids() const {
  std::vector<int64_t> out;
#if defined(__linux__)
  for (int t = 0; t < impl_->threads - 1; ++t) out.push_back(impl_->tids[t].load());
#endif
  return out;
}
int64_t HostMlpRunner::calls() const { return impl_->calls.load(); }
MlpIsa HostMlpRunner::last_isa() const { return static_cast<MlpIsa>(impl_->last_isa.load()); }

void HostMlpRunner::run(const MlpShape& shape, const MlpExpert* experts, int64_t n_experts,
                        const void* x, FloatType x_type, int64_t x_stride, void* out,
                        FloatType out_type, int64_t out_stride, int64_t rows, MlpIsa isa,
                        int64_t amx_min_rows) {
  if (shape.hidden < 1 || shape.inter < 1) throw std::invalid_argument("hidden and inter must be >= 1");
  if (shape.act != static_cast<int32_t>(MlpAct::kSwigluSilu) &&
      shape.act != static_cast<int32_t>(MlpAct::kGptOssClamp))
    throw std::invalid_argument("unknown activation " + std::to_string(shape.act));
  if (n_experts < 0 || rows < 0) throw std::invalid_argument("negative count");
  if (x_stride < shape.hidden || out_stride < shape.hidden)
    throw std::invalid_argument("a row stride is below hidden");
  if (x_type != FloatType::kF32 && x_type != FloatType::kBF16) throw std::invalid_argument("x type");
  if (out_type != FloatType::kF32 && out_type != FloatType::kBF16)
    throw std::invalid_argument("out type");
  if (amx_min_rows < 1) throw std::invalid_argument("amx_min_rows must be >= 1");
  if (shape.weights < static_cast<int32_t>(WeightFormat::kBf16) ||
      shape.weights > static_cast<int32_t>(WeightFormat::kFp8))
    throw std::invalid_argument("unknown weight format " + std::to_string(shape.weights));
  const auto weights = static_cast<WeightFormat>(shape.weights);
  bool avx = false, amx = false;
  if (isa == MlpIsa::kAvx512Bf16) {
    if (!cpu_has_avx512_bf16())
      throw std::invalid_argument("this CPU has no AVX-512 BF16 (avx512_bf16)");
    avx = true;
  } else if (isa == MlpIsa::kAmxBf16) {
    if (!cpu_has_amx_bf16())
      throw std::invalid_argument("this CPU (or OS) offers no AMX BF16 with AVX-512 BF16");
    avx = amx = true;
  } else if (isa == MlpIsa::kAuto) {
    avx = cpu_has_avx512_bf16();
    amx = avx && cpu_has_amx_bf16();
  } else if (isa != MlpIsa::kScalar) {
    throw std::invalid_argument("unknown isa " + std::to_string(static_cast<int>(isa)));
  }
  int64_t prev = 0, rows_max = 0;
  for (int64_t e = 0; e < n_experts; ++e) {
    const MlpExpert& ex = experts[e];
    rows_max = std::max(rows_max, std::min(kRowChunk, ex.row_end - ex.row_begin));
    if (ex.row_begin != prev || ex.row_end < ex.row_begin || ex.row_end > rows)
      throw std::invalid_argument("expert " + std::to_string(e) + ": rows [" +
                                  std::to_string(ex.row_begin) + ", " + std::to_string(ex.row_end) +
                                  ") do not continue the previous expert's within " +
                                  std::to_string(rows) + " rows");
    const bool has = weights == WeightFormat::kMxfp4 ? (ex.q1 && ex.s1 && ex.q2 && ex.s2)
                     : weights == WeightFormat::kFp8 ? (ex.q1 && ex.c1 && ex.q2 && ex.c2)
                                                     : (ex.w1 && ex.w2);
    if (!has) throw std::invalid_argument("expert " + std::to_string(e) + " has no weights");
    prev = ex.row_end;
  }
  if (prev != rows) throw std::invalid_argument("the experts' rows do not cover every row");
  if (rows == 0 || n_experts == 0) return;
  if (x == nullptr || out == nullptr) throw std::invalid_argument("null x or out");

  std::lock_guard<std::mutex> call(impl_->call_mutex);
  Impl& im = *impl_;
  Job j;
  j.shape = shape;
  j.experts = experts;
  j.n_experts = n_experts;
  j.hidden_pairs = mlp_hidden_pairs(shape.hidden);
  j.inter_pad = mlp_inter_pad(shape.inter);
  j.inter_pairs = j.inter_pad / 2;
  j.tiles1 = j.inter_pad / kW1TileInter;
  j.tiles2 = (shape.hidden + kTileCols - 1) / kTileCols;
  j.out = out;
  j.out_type = out_type;
  j.out_stride = out_stride;
  j.avx = avx;
  j.amx = amx;
  j.amx_min_rows = amx_min_rows;
  j.weights = weights;
  // x as bf16 rows of whole pairs (an odd width gets a zero), and g: small
  const int64_t xw = 2 * j.hidden_pairs;
  im.xb.assign(static_cast<size_t>(rows * xw), 0);
  im.g.resize(static_cast<size_t>(rows * j.inter_pad));
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* d = im.xb.data() + r * xw;
    if (x_type == FloatType::kBF16) {
      std::memcpy(d, static_cast<const uint16_t*>(x) + r * x_stride, shape.hidden * 2);
    } else {
      const float* s = static_cast<const float*>(x) + r * x_stride;
      for (int64_t c = 0; c < shape.hidden; ++c) d[c] = f32_to_bf16(s[c]);
    }
  }
  j.xb = im.xb.data();
  j.g = im.g.data();
  im.job = &j;
  im.next1.store(0, std::memory_order_relaxed);
  im.next2.store(0, std::memory_order_relaxed);
  im.finished1.store(0, std::memory_order_relaxed);
  im.finished2.store(0, std::memory_order_relaxed);
  if (im.threads > 1) {
    // only the caller changes the epoch: the one publish() starts
    const uint32_t next_epoch = im.epoch.load(std::memory_order_relaxed) + 1u;
    im.open_epoch.store(static_cast<int64_t>(next_epoch), std::memory_order_seq_cst);
    im.publish();
  }
  im.execute();
  Impl::wait_until(im.finished2, n_experts * j.tiles2);
  // close the call, then wait only for the workers already inside it (they
  // find nothing left to claim); one waking later sees it closed
  im.open_epoch.store(-1, std::memory_order_seq_cst);
  for (int i = 0; im.active.load(std::memory_order_seq_cst) > 0; ++i) {
    if (i < 4096) cpu_relax(); else std::this_thread::yield();
  }
  im.job = nullptr;
  im.calls.fetch_add(1);
  const bool ran_amx = amx && rows_max >= amx_min_rows;
  im.last_isa.store(static_cast<int32_t>(ran_amx ? MlpIsa::kAmxBf16
                                         : avx   ? MlpIsa::kAvx512Bf16
                                                 : MlpIsa::kScalar));
}

}  // namespace pdflash
