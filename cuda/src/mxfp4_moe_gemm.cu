// The grouped MXFP4 expert GEMM of pdflash.models.fused_moe_triton.grouped_qgemm
// (fmt mxfp4, bf16 activations, fp32 accumulation, bf16 output) as a
// hand-written CUDA kernel (sm_80+; tuned on sm_90; the wgmma variants need
// sm_90a). The API and its error codes: cuda/include/pdflash/mxfp4_moe_gemm.h.
// Python seam: pdflash.models.mxfp4_cuda_gemm (via pdflash_native._mxfp4gemm);
// a CPU model of the per-lane index math: tests/models/mxfp4_cuda_model.py.
//
//   out[r] = epilogue(x[x_rows[r]] @ W[slot(r)]^T + bias[slot(r)])
//
// W: blocks [S, N, K/32, 16] uint8 (two e2m1 codes per byte, low nibble =
// lower k) and scales [S, N, K/32] uint8 e8m0 (2^(s-127)); tiles (slot, start,
// end) int32 per tile, slot -1 = dead; a tile covers sorted rows
// [start, min(start + block_m, end)). Epilogues: act 0 (none, + bias),
// act 1 (gpt-oss clamped SwiGLU) and act 2 (silu(gate) * up), both over gate
// rows g0 + j*step and up rows u0 + j*step, output width n_out.
//
// Design (memory-bound at 16..256 tokens; the point is bytes in flight and a
// cheap dequant):
// * mma.sync m16n8k16 bf16 with WEIGHTS AS A (16 weight rows = M) and TOKENS
//   AS B (8 tokens = N), looping over the tile's live 8-token sub-tiles with
//   the dequantized A fragment reused.
// * A dot product is invariant under a consistent permutation of k. Lane
//   (g = lane/4, t = lane%4) owns, per 128-k chunk, the whole 32-value block t
//   of its rows g and g+8 (16 contiguous bytes each, cp.async 16 B). Each
//   32-bit word of a block holds 8 codes (nibble i = k 8w+i); the register
//   pairs (nibble i, nibble i+4) are what a few shifts/masks give cheaply
//   (sign to bf16 bit 15/31, magnitude to bits 6..8/22..24, i.e. the value
//   times 2^-126 incl. the e=0 subnormal), and the mma k-steps are assigned so
//   that each thread's A registers are exactly those pairs. B must hold x at
//   the same physical k: the activations are staged per chunk in shared
//   memory in that permuted order (8-groups stored as x0 x4 x1 x5 x2 x6 x3 x7,
//   XOR-swizzled), so each B fragment pair of k-steps is one LDS.128.
// * Scale: one bf16x2 multiply by 2^(s-1-D) per register (exact), D a
//   per-CTA power of two (0 unless a scale byte > 128; the min / max scale
//   byte of the CTA's rows is scanned once) undone on the fp32 accumulator.
//   CTAs whose rows have any scale outside that exact range (s < D + 2 or
//   s > 252; or a spread > 64 with D > 0: never in released checkpoints) take
//   a slower path: times 2^126
//   (the exact e2m1 value), then times the bf16 2^(s-127) (subnormal for s = 0,
//   inf for 255): the reference's value * 2^(s-127) bits, inf / NaN included.
//   Both rely on bf16x2 multiplies keeping subnormal inputs (value * 2^-126 is
//   subnormal for |value| = 0.5), as vLLM's Marlin fp4 dequant does.
// * Weight bytes: a STAGES-deep cp.async ring in shared memory, each thread
//   copying exactly the bytes it later consumes (no barrier needed for it).
//   Activations: loaded one chunk ahead into registers (L2/L1), permuted with
//   prmt and stored to a double-buffered shared tile; one __syncthreads per
//   chunk. Scales of the CTA's rows are staged in shared memory once: for
//   the usual layouts (down: consecutive rows; gpt-oss gate/up interleaved
//   0/1 step 2) a CTA's rows are contiguous, so its scale bytes are one
//   contiguous range fetched by cp.async together with the first weight
//   chunks; other layouts fall back to byte loads.
// * Grid: (tiles, column blocks); WARPS warps per CTA, MT m16 tiles per warp.
//
// The wgmma kind (Cfg::KIND == kKindWgmma; sm_90a only): the same lanes,
// dequant, scale paths and epilogue, but each warpgroup (4 warps, one m16
// tile each = 64 weight rows) issues wgmma.mma_async m64nNk16 with A (the
// dequantized weights) from registers and B (x) read by the tensor cores
// straight from shared memory through a matrix descriptor: no LDS / mma.sync
// issue per 8-token sub-tile, and x read once per warpgroup instead of once
// per warp. N = 8 x (live sub-tiles), one compile-time case per count. x is
// staged per chunk in the same permuted k order, as wgmma core matrices
// (8 tokens x 16 bytes; K-major, no swizzle): k-step ks = 2w + h owns a
// region of XTOK * 32 + 16 bytes (the 16 spread the staging stores over the
// banks), in it core matrix (token group, k half) at (group * 2 + half) * 128.
// Per chunk: dequant into registers, barrier, wgmma.fence, 8 wgmmas, commit,
// wait; the D fragment is mma.sync's per 8 columns, so the epilogue is shared.
//
// The kind kKindWgmmaPx: the wgmma kind with x given already in that staged
// order (the header's chunk-permuted layout), so each core-matrix row is 16
// contiguous bytes of global memory: x comes by cp.async into a STAGES-deep
// ring beside the weights, issued after each chunk's barrier, instead of
// through registers, prmt and shared stores a chunk ahead.
//
// The kind kKindWgmmaRc: the wgmma kind reading blocks whose code words the
// caller repacked (the header's table), so the dequant's integer work per
// word drops from 15.5 instructions to 9 (repacked_pair_bits); the same bf16
// registers, so the same bits.
//
// Built by cuda/CMakeLists.txt (pdflash_mxfp4gemm; sm_90a code for the
// wgmma variants where the architectures include 90, which also defines
// PDFLASH_MXFP4_GEMM_SM90A); the probe (bench/h200/mxfp4_cuda/probe.py)
// builds it alone:
//   nvcc -arch=sm_90a -DPDFLASH_MXFP4_GEMM_SM90A=1 -O3 --shared -Xcompiler -fPIC
//        -I cuda/include mxfp4_moe_gemm.cu

#include "pdflash/mxfp4_moe_gemm.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <atomic>

namespace mxcuda {

struct Params {
  const __nv_bfloat16* x;
  long long stride_xm;  // elements
  const int* x_rows;
  const uint8_t* w;
  long long stride_ws, stride_wn;  // bytes
  long long stride_wc;             // bytes from a row's 128-k chunk to its next (64: natural)
  const uint8_t* sc;
  long long stride_ss, stride_sn;  // bytes (scale k stride must be 1)
  const __nv_bfloat16* bias;       // may be null
  long long stride_bs;             // elements
  __nv_bfloat16* out;
  long long stride_om;  // elements
  const int* tile_slot;
  const int* tile_start;
  const int* tile_end;
  int block_m;
  int N;    // weight rows
  int K;    // inputs
  int KB;   // K / 32
  int NC;   // 128-k chunks
  int scale_contig;  // a CTA's rows are one contiguous run of scale rows (pitch KB)
  int n_out;
  int act;
  int g0, u0, step;
  float alpha, limit;
  int out_perm;  // out_layout == PDFLASH_MXFP4_OUT_CHUNK_PERMUTED
};

// where output column j goes: j, or (out_perm) its place in the header's
// chunk-permuted layout, k = 32 t + 8 w + 4 e + 2 h + d of a 128-chunk at
// 32 w + 16 h + 8 d + 2 t + e
__device__ __forceinline__ int out_column(const Params& p, int j) {
  if (!p.out_perm) return j;
  const int k = j & 127;
  return (j & ~127) | (((k >> 3) & 3) << 5) | (((k >> 1) & 1) << 4) | ((k & 1) << 3) |
         ((k >> 5) << 1) | ((k >> 2) & 1);
}

// ---------------------------------------------------------------- PTX helpers
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}

// the same with an L2 prefetch-size hint (PF = 64 / 128 / 256 bytes; 0 = none)
template <int PF>
__device__ __forceinline__ void cp_async16_pf(uint32_t dst, const void* src, int src_bytes) {
  if constexpr (PF == 256) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes));
  } else if constexpr (PF == 128) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes));
  } else if constexpr (PF == 64) {
    asm volatile("cp.async.cg.shared.global.L2::64B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes));
  } else {
    cp_async16(dst, src, src_bytes);
  }
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t d;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  // mul.bf16x2 is sm_90+; a * b + (-0) is a * b with the same single
  // rounding (and the sign of a zero product kept)
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
#else
  asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
#endif
  return d;
}

__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], uint32_t a0, uint32_t a1,
                                               uint32_t a2, uint32_t a3, uint32_t b0,
                                               uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// ---------------------------------------------------------------- wgmma (sm_90a)
// Device passes with the sm_90a features compile the wgmma kernels; every
// other pass (sm_80, sm_89, the compute_90 PTX kept for newer GPUs, ...)
// compiles them as a trap, and the launcher never starts them there
// (kind_runs_on). The asm below is guarded too, so no pass sees an
// instruction its target lacks.
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
constexpr bool kWgmmaInThisPass = false;
#else
constexpr bool kWgmmaInThisPass = true;
#endif

__device__ __forceinline__ void wgmma_fence() {
#ifdef __CUDA_ARCH_FEAT_SM90_ALL
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wgmma_commit() {
#ifdef __CUDA_ARCH_FEAT_SM90_ALL
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

template <int N>
__device__ __forceinline__ void wgmma_wait() {
#ifdef __CUDA_ARCH_FEAT_SM90_ALL
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

// generic-proxy shared-memory stores -> visible to wgmma's (async proxy) reads
__device__ __forceinline__ void fence_proxy_async_smem() {
#ifdef __CUDA_ARCH_FEAT_SM90_ALL
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// B operand layout in shared memory (K-major, no swizzle): the 8 x 16-byte
// core matrices of k half kh (LBO: the leading, k, direction) and token group
// n / 8 (SBO: the stride, token, direction) of one k-step
constexpr uint32_t kWgmmaLboBytes = 128;
constexpr uint32_t kWgmmaSboBytes = 256;

// matrix descriptor: start address >> 4 (bits 0..13), LBO >> 4 (16..29),
// SBO >> 4 (32..45); base offset 0, no swizzle (bits 62..63 = 0)
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr) {
  return (uint64_t)((addr & 0x3FFFFu) >> 4) | ((uint64_t)(kWgmmaLboBytes >> 4) << 16) |
         ((uint64_t)(kWgmmaSboBytes >> 4) << 32);
}

// D[64 x 8 NS] += A[64 x 16] * B[16 x 8 NS] for NS live 8-token sub-tiles:
// A from registers (per warp the mma.m16n8k16 A fragment of its 16 rows), B
// from shared memory (descriptor desc); d[4 i .. 4 i + 3] is the m16n8
// accumulator fragment of token columns 8 i .. 8 i + 7 (as mma.sync's).
// Accumulates (scale-d 1), no negation (scale-a / scale-b 1), B not
// transposed (K-major). The PTX names every accumulator register, so each
// NS has its own operand list (generated below).
template <int NS>
struct WgmmaM64;

#define MXCUDA_WG_ACC4(i) "+f"(d[4 * i]), "+f"(d[4 * i + 1]), "+f"(d[4 * i + 2]), "+f"(d[4 * i + 3])
#define MXCUDA_WG_ACC_1 MXCUDA_WG_ACC4(0)
#define MXCUDA_WG_ACC_2 MXCUDA_WG_ACC_1, MXCUDA_WG_ACC4(1)
#define MXCUDA_WG_ACC_3 MXCUDA_WG_ACC_2, MXCUDA_WG_ACC4(2)
#define MXCUDA_WG_ACC_4 MXCUDA_WG_ACC_3, MXCUDA_WG_ACC4(3)
#define MXCUDA_WG_ACC_5 MXCUDA_WG_ACC_4, MXCUDA_WG_ACC4(4)
#define MXCUDA_WG_ACC_6 MXCUDA_WG_ACC_5, MXCUDA_WG_ACC4(5)
#define MXCUDA_WG_ACC_7 MXCUDA_WG_ACC_6, MXCUDA_WG_ACC4(6)
#define MXCUDA_WG_ACC_8 MXCUDA_WG_ACC_7, MXCUDA_WG_ACC4(7)
// the accumulators' operand numbers (%0 .. %(4 NS - 1)) as PTX text
#define MXCUDA_WG_REG_1 "%0, %1, %2, %3"
#define MXCUDA_WG_REG_2 MXCUDA_WG_REG_1 ", %4, %5, %6, %7"
#define MXCUDA_WG_REG_3 MXCUDA_WG_REG_2 ", %8, %9, %10, %11"
#define MXCUDA_WG_REG_4 MXCUDA_WG_REG_3 ", %12, %13, %14, %15"
#define MXCUDA_WG_REG_5 MXCUDA_WG_REG_4 ", %16, %17, %18, %19"
#define MXCUDA_WG_REG_6 MXCUDA_WG_REG_5 ", %20, %21, %22, %23"
#define MXCUDA_WG_REG_7 MXCUDA_WG_REG_6 ", %24, %25, %26, %27"
#define MXCUDA_WG_REG_8 MXCUDA_WG_REG_7 ", %28, %29, %30, %31"
// (NS, N = 8 NS, operand numbers of a0..a3, of the descriptor: they follow
// the 4 NS accumulators)
#define MXCUDA_WGMMA_SHAPES(X)             \
  X(1, 8, "%4, %5, %6, %7", "%8")          \
  X(2, 16, "%8, %9, %10, %11", "%12")      \
  X(3, 24, "%12, %13, %14, %15", "%16")    \
  X(4, 32, "%16, %17, %18, %19", "%20")    \
  X(5, 40, "%20, %21, %22, %23", "%24")    \
  X(6, 48, "%24, %25, %26, %27", "%28")    \
  X(7, 56, "%28, %29, %30, %31", "%32")    \
  X(8, 64, "%32, %33, %34, %35", "%36")

#ifdef __CUDA_ARCH_FEAT_SM90_ALL
#define MXCUDA_WGMMA_ASM(NS, N, A_OPS, DESC_OP)                                             \
  asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16 {" MXCUDA_WG_REG_##NS \
               "}, {" A_OPS "}, " DESC_OP ", 1, 1, 1, 0;\n"                                  \
               : MXCUDA_WG_ACC_##NS                                                          \
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
#else
#define MXCUDA_WGMMA_ASM(NS, N, A_OPS, DESC_OP) \
  (void)d, (void)a0, (void)a1, (void)a2, (void)a3, (void)desc;
#endif

#define MXCUDA_WGMMA_CASE(NS, N, A_OPS, DESC_OP)                                             \
  template <>                                                                                \
  struct WgmmaM64<NS> {                                                                      \
    static __device__ __forceinline__ void run(float* d, uint32_t a0, uint32_t a1,           \
                                               uint32_t a2, uint32_t a3, uint64_t desc) {    \
      MXCUDA_WGMMA_ASM(NS, N, A_OPS, DESC_OP)                                                \
    }                                                                                        \
  };
MXCUDA_WGMMA_SHAPES(MXCUDA_WGMMA_CASE)
#undef MXCUDA_WGMMA_CASE
#undef MXCUDA_WGMMA_ASM
#undef MXCUDA_WGMMA_SHAPES

// ---------------------------------------------------------------- dequant
// Nibbles I (bits 4I..4I+3) and I+4 (bits 4I+16..4I+19) of a word as a bf16x2
// (low half = nibble I) of value * 2^-126: sign -> bit 15/31, the 3 magnitude
// bits -> bits 6..8 / 22..24 (exponent low 2 bits + mantissa top bit; e = 0
// gives the subnormal m * 2^-127 = value * 2^-126 too).
//
// Written so that only the masks and the final merge need the integer ALU
// pipe: left shifts as multiplies (ptxas may issue them as IMAD.SHL on the FMA
// pipe), one shared right shift per word (q >> 8, CSE'd across I = 2, 3), and
// the sign merged by one LOP3 (em | (sg_src & 0x80008000)).
template <int I>
__device__ __forceinline__ uint32_t e2m1_pair_bits(uint32_t q) {
  uint32_t em, sg_src;
  if constexpr (I == 0) {
    em = (q & 0x00070007u) * 64u;  // bits 0..2 / 16..18 -> 6..8 / 22..24
    sg_src = q * 4096u;            // bit 3 / 19 -> 15 / 31
  } else if constexpr (I == 1) {
    em = (q & 0x00700070u) * 4u;  // bits 4..6 -> 6..8
    sg_src = q * 256u;            // bit 7 -> 15
  } else if constexpr (I == 2) {
    em = ((q >> 8) & 0x00070007u) * 64u;  // bits 8..10 -> 6..8
    sg_src = q * 16u;                     // bit 11 -> 15
  } else {
    em = ((q >> 8) & 0x00700070u) * 4u;  // bits 12..14 -> 6..8
    sg_src = q;                          // bit 15 -> 15
  }
  return em | (sg_src & 0x80008000u);
}

// bf16x2 of 2^(s-127) for e8m0 s: s << 7 per half (s = 0: the subnormal
// 2^-127 = 0x0040; s = 255: +inf = 0x7f80)
__device__ __forceinline__ uint32_t e8m0_bf16x2(uint32_t s) {
  return (s == 0u ? 0x0040u : (s << 7)) * 0x00010001u;
}

// The same bf16x2 from a word whose 32 bits the caller repacked (the header's
// PDFLASH_MXFP4_KIND_WGMMA_RC layout): nibble I's role bits (m, e0, e1, s)
// sit where one rotate (two for pair 3) and one mask put them, so a pair
// costs 1 / 2 / 2 / 4 integer instructions (pairs 0..3) instead of 4 / 4 /
// 4 / 3 plus a shared shift. Pairs 0..2's sources are rotations by 0, 4 and
// 10 of {6, 7, 8, 15} (+16 for the high half); no fourth rotation fits the
// bits left over, so pair 3 takes m, e0, s by one rotation and e1 by another.
template <int I>
__device__ __forceinline__ uint32_t repacked_pair_bits(uint32_t q) {
  if constexpr (I == 0) {
    return q & 0x81C081C0u;
  } else if constexpr (I == 1) {
    return __funnelshift_r(q, q, 4) & 0x81C081C0u;
  } else if constexpr (I == 2) {
    return __funnelshift_r(q, q, 10) & 0x81C081C0u;
  } else {
    // m, e0, s from bits 4, 5, 13 (+16) by a left rotation of 2; e1 from bit
    // 14 (+16) by a right rotation of 6
    return (__funnelshift_l(q, q, 2) & 0x80C080C0u) | (__funnelshift_r(q, q, 6) & 0x01000100u);
  }
}

// A register (pair of nibbles I, I+4 of q) times its block's scale.
// Fast (SLOW = false): one multiply by f = 2^(s-1-D) (exact: the product is a
// normal bf16 for D + 2 <= s <= 252). Slow (any s): times 2^126 (the exact
// e2m1 values, normal) then times f = 2^(s-127) (subnormal for s = 0, inf for
// s = 255): the reference's value * 2^(s-127) rounded to bf16 (exact down to
// 2^-128; inf / NaN where it has them).
// (RC: q repacked, repacked_pair_bits.)
template <bool SLOW, int I, bool RC = false>
__device__ __forceinline__ uint32_t dequant_pair(uint32_t q, uint32_t f) {
  uint32_t bits;
  if constexpr (RC)
    bits = repacked_pair_bits<I>(q);
  else
    bits = e2m1_pair_bits<I>(q);
  if constexpr (SLOW) return bf16x2_mul(bf16x2_mul(bits, 0x7e807e80u), f);
  return bf16x2_mul(bits, f);
}

// A registers of k-step ks (0..7) of a chunk from the thread's two words of
// weights (rows g and g + 8; q[r] = its 16 bytes) and their scale factors:
// k-steps 2w (pairs 0, 1) and 2w + 1 (pairs 2, 3) of word w, in mma.sync's A
// fragment order (row g, row g + 8, row g, row g + 8)
template <bool SLOW, bool RC>
__device__ __forceinline__ void dequant_kstep(int ks, const uint4 (&q)[2], const uint32_t (&f)[2],
                                              uint32_t (&a)[4]) {
  const int w = ks >> 1;
  const uint32_t q0 = (w == 0) ? q[0].x : (w == 1) ? q[0].y : (w == 2) ? q[0].z : q[0].w;
  const uint32_t q1 = (w == 0) ? q[1].x : (w == 1) ? q[1].y : (w == 2) ? q[1].z : q[1].w;
  if ((ks & 1) == 0) {
    a[0] = dequant_pair<SLOW, 0, RC>(q0, f[0]);
    a[1] = dequant_pair<SLOW, 0, RC>(q1, f[1]);
    a[2] = dequant_pair<SLOW, 1, RC>(q0, f[0]);
    a[3] = dequant_pair<SLOW, 1, RC>(q1, f[1]);
  } else {
    a[0] = dequant_pair<SLOW, 2, RC>(q0, f[0]);
    a[1] = dequant_pair<SLOW, 2, RC>(q1, f[1]);
    a[2] = dequant_pair<SLOW, 3, RC>(q0, f[0]);
    a[3] = dequant_pair<SLOW, 3, RC>(q1, f[1]);
  }
}

// ---------------------------------------------------------------- config
constexpr int kKindMmaSync = PDFLASH_MXFP4_KIND_MMA_SYNC;  // mma.sync m16n8k16, B by LDS
constexpr int kKindWgmma = PDFLASH_MXFP4_KIND_WGMMA;       // wgmma m64nNk16, B by descriptor
// the same wgmma, x already in the staged k order in global memory (the
// caller's chunk-permuted copy): x copied by cp.async into a STAGES-deep ring
constexpr int kKindWgmmaPx = PDFLASH_MXFP4_KIND_WGMMA_PX;
// the wgmma kind with the weights' codes repacked (repacked_pair_bits)
constexpr int kKindWgmmaRc = PDFLASH_MXFP4_KIND_WGMMA_RC;

template <int WARPS_, int MT_, int NSM_, int STAGES_, int MINB_, int PF_, int KIND_>
struct Cfg {
  static constexpr int KIND = KIND_;      // kKindMmaSync, kKindWgmma, kKindWgmmaPx or kKindWgmmaRc
  static constexpr bool WG = KIND != kKindMmaSync;  // wgmma, B from shared memory
  static constexpr bool PX = KIND == kKindWgmmaPx;  // x pre-permuted, by cp.async
  static constexpr bool RC = KIND == kKindWgmmaRc;  // codes repacked (repacked_pair_bits)
  static constexpr int PF = PF_;          // cp.async L2 prefetch hint for the weights (bytes)
  static constexpr int WARPS = WARPS_;    // warps per CTA
  static constexpr int MT = MT_;          // m16 weight tiles per warp
  static constexpr int NSM = NSM_;        // max 8-token sub-tiles (block_m <= 8 * NSM)
  static constexpr int STAGES = STAGES_;  // cp.async ring depth (chunks)
  static constexpr int MINB = MINB_;      // __launch_bounds__ min blocks per SM
  static constexpr int THREADS = WARPS * 32;
  static constexpr int WR = WARPS * MT * 16;  // weight rows per CTA
  static constexpr int XTOK = NSM * 8;        // staged tokens
  static constexpr int XUNITS = XTOK * 16;    // 16-byte units per chunk
  // x loads per thread and chunk: mma.sync, 16-byte units; wgmma, (token,
  // word w) units of 4 x 16 bytes (the k = 32 t + 8 w .. + 7 for t = 0..3)
  // (PX: 16-byte cp.async units, XTOK x 16 of them a chunk)
  static constexpr int XU = KIND == kKindMmaSync || PX ? (XUNITS + THREADS - 1) / THREADS
                                                       : (XTOK * 4 + THREADS - 1) / THREADS;
  static constexpr int XREGS = PX ? 1 : KIND == kKindMmaSync ? XU : 4 * XU;  // uint4 x registers
  // each x staging unit's source row pointer made once per CTA (a unit's
  // token is the same in every chunk) instead of per chunk from s_xrow, where
  // the pointers fit: 2.0-5.2% less time a projection pair on an H100
  // (bench/h200/mxfp4_cuda/README.md); at 4 units (8 warps, 64 tokens,
  // mma.sync) the kernel would spill
  static constexpr bool XHOIST = XU <= 2 && !PX;
  static constexpr int WBUF_BYTES = STAGES * MT * 2 * THREADS * 16;
  // wgmma: one region per k-step (8 per chunk) of XTOK * 32 bytes (core
  // matrices (8 tokens x 8 k) of 128 bytes: [token group][k half]) + 16
  // bytes that spread the staging stores over the banks
  static constexpr int XREG_BYTES = XTOK * 32 + 16;
  static constexpr int XBUF_BYTES =
      KIND == kKindMmaSync ? XTOK * 256 : 8 * XREG_BYTES;  // one chunk of permuted x
  // x buffers: mma.sync, chunk c & 1; wgmma, c % 3 (a wait_group depth of
  // MXCUDA_WGMMA_PENDING = 1 leaves chunk c - 1's buffer in use); PX, the
  // cp.async ring, c % STAGES
  static constexpr int NXB = PX ? STAGES : KIND == kKindMmaSync ? 2 : 3;
  static_assert(!WG || (MT == 1 && WARPS % 4 == 0),
                "wgmma: one m16 tile per warp, whole warpgroups");
};

template <class C>
__host__ __device__ constexpr int scale_bytes(int KB) {
  return ((C::WR * KB + 15) / 16) * 16;
}

template <class C>
__host__ __device__ constexpr int smem_bytes(int KB) {
  return C::WBUF_BYTES + C::NXB * C::XBUF_BYTES + scale_bytes<C>(KB) + C::XTOK * 4 + 16;
}

// the wgmma kinds' x buffer: byte offset of token tok's 16 bytes of k-step
// ks, k half `half` (row tok & 7 of core matrix (tok >> 3, half) in the
// k-step's region); store_x and issue_x both write there
template <class C>
__device__ __forceinline__ int x_stage_offset(int ks, int half, int tok) {
  const int row = (tok >> 3) * kWgmmaSboBytes + (tok & 7) * 16;  // token tok's 16-byte row
  return ks * C::XREG_BYTES + half * kWgmmaLboBytes + row;
}

// weight row of mma row (g + 8 r) of global m-tile `mtile`, -1 past the output
__device__ __forceinline__ int weight_row(const Params& p, int mtile, int g, int r) {
  if (p.act != 0) {
    const int j = mtile * 8 + g;
    if (j >= p.n_out) return -1;
    const int row = (r == 0 ? p.g0 : p.u0) + j * p.step;
    return row < p.N ? row : -1;
  }
  const int row = mtile * 16 + g + 8 * r;
  return row < p.N ? row : -1;
}

template <bool B>
struct Bool {
  static constexpr bool value = B;
};
template <int N>
struct Int {
  static constexpr int value = N;
};

// wgmma groups a warp may leave in flight at the end of a chunk (0 or 1). With
// 1, chunk c + 1's dequant would overlap chunk c's wgmmas, but ptxas then
// serializes the wgmmas (C7513: the next chunk's A registers are defined
// inside the open pipeline stage); 0 leaves that overlap to the other warps
// and CTAs of the SM.
#ifndef MXCUDA_WGMMA_PENDING
#define MXCUDA_WGMMA_PENDING 0
#endif

// ---------------------------------------------------------------- kernel
template <class C>
__global__ void __launch_bounds__(C::THREADS, C::MINB) mxfp4_moe_kernel(const Params p) {
  if constexpr (C::WG && !kWgmmaInThisPass) {
    __trap();  // no sm_90a code in this pass; the launcher never starts it here
    return;
  }
  constexpr int MT = C::MT, NSM = C::NSM, STAGES = C::STAGES, THREADS = C::THREADS;
  extern __shared__ __align__(16) uint8_t smem[];
  const int tile = blockIdx.x;
  const int slot = p.tile_slot[tile];
  if (slot < 0) return;  // dead tile
  const int start = p.tile_start[tile];
  const int nrows = min(p.block_m, p.tile_end[tile] - start);
  if (nrows <= 0) return;
  const int nsl = (nrows + 7) >> 3;  // live 8-token sub-tiles

  uint8_t* wbuf = smem;
  uint8_t* xbuf = wbuf + C::WBUF_BYTES;
  uint8_t* s_scale = xbuf + C::NXB * C::XBUF_BYTES;
  int* s_xrow = reinterpret_cast<int*>(s_scale + scale_bytes<C>(p.KB));
  int* s_mm = s_xrow + C::XTOK;  // [0] = min scale byte, [1] = max

  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int mtile0 = blockIdx.y * (C::WARPS * MT) + warp * MT;  // this warp's first m-tile
  const long long slot64 = slot;
  const uint32_t wbuf_s = smem_u32(wbuf);

  // ---- this thread's weight rows (mt, r: mma rows g / g + 8) and their scale rows
  // contiguous scale layout: shared row = global row - row_lo (pitch KB);
  // fallback: shared row = (warp * MT + mt) * 16 + g + 8 r
  // (act: rows 2j + {0, 1} for j in [blockIdx.y * WR / 2, + WR / 2): the same start)
  const int row_lo = blockIdx.y * C::WR;
  const uint8_t* wsrc[MT][2];
  bool wlive[MT][2];
  int soff[MT][2];  // byte offset of the thread's scale row in s_scale
  bool warp_live = false;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = weight_row(p, mtile0 + mt, g, r);
      wlive[mt][r] = row >= 0;
      wsrc[mt][r] = p.w + slot64 * p.stride_ws + (long long)(row < 0 ? 0 : row) * p.stride_wn +
                    t * 16;
      const int srow = p.scale_contig ? (row < 0 ? 0 : row - row_lo)
                                      : (warp * MT + mt) * 16 + g + 8 * r;
      soff[mt][r] = srow * p.KB;
    }
    warp_live |= weight_row(p, mtile0 + mt, 0, 0) >= 0;  // m-tile has a live row
  }

  // ---- scale bytes of the CTA's rows: cp.async (group 0) when contiguous + aligned
  const uint8_t* sbase = p.sc + slot64 * p.stride_ss;
  int scale_len = 0;  // bytes of staged scales to scan for min / max
  bool scale_bytes_pending = false;
  if (p.scale_contig) {
    const int rows = min(C::WR, p.N - row_lo);
    scale_len = rows > 0 ? rows * p.KB : 0;
    const uint8_t* src = sbase + (long long)row_lo * p.stride_sn;
    if ((reinterpret_cast<uintptr_t>(src) & 15) == 0) {
      const int units = scale_len >> 4;
      const uint32_t dst = smem_u32(s_scale);
      for (int i = tid; i < units; i += THREADS) cp_async16(dst + i * 16, src + i * 16, 16);
      for (int b = (units << 4) + tid; b < scale_len; b += THREADS) s_scale[b] = __ldg(src + b);
    } else {
      scale_bytes_pending = true;  // misaligned: byte loads below
    }
  }
  cp_async_commit();

  // ---- weight ring: chunk c -> stage c % STAGES, each thread its own 2 * MT units
  auto issue_w = [&](int c) {
    if (c < p.NC) {
      const int stage = c % STAGES;
      const int blk = 4 * c + t;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const bool ok = wlive[mt][r] && blk < p.KB;
          const uint32_t dst =
              wbuf_s + (uint32_t)(((stage * MT + mt) * 2 + r) * THREADS + tid) * 16u;
          cp_async16_pf<C::PF>(dst,
                               ok ? (const void*)(wsrc[mt][r] + (long long)c * p.stride_wc)
                                  : (const void*)p.w,
                               ok ? 16 : 0);
        }
    }
    cp_async_commit();
  };
#pragma unroll
  for (int c = 0; c < STAGES - 1; ++c) issue_w(c);

  // ---- tile rows' x row indices; fallback scale staging
  if (tid == 0) {
    s_mm[0] = 255;
    s_mm[1] = 0;
  }
  for (int i = tid; i < C::XTOK; i += THREADS) s_xrow[i] = i < nrows ? p.x_rows[start + i] : 0;
  if (scale_bytes_pending) {
    const uint8_t* src = sbase + (long long)row_lo * p.stride_sn;
    for (int b = tid; b < scale_len; b += THREADS) s_scale[b] = __ldg(src + b);
  } else if (!p.scale_contig) {
    scale_len = C::WR * p.KB;
#pragma unroll 2
    for (int rr = 0; rr < MT * 16; ++rr) {
      const int mt = rr >> 4, m16 = rr & 15;
      const int row = weight_row(p, mtile0 + mt, m16 & 7, m16 >> 3);
      uint8_t* dst = s_scale + ((warp * MT + mt) * 16 + m16) * p.KB;
      const uint8_t* src = sbase + (long long)(row < 0 ? 0 : row) * p.stride_sn;
      for (int b = lane; b < p.KB; b += 32) dst[b] = row >= 0 ? __ldg(src + b) : (uint8_t)127;
    }
  }
  __syncthreads();  // s_xrow, s_mm

  // ---- activations, one 128-k chunk: loaded into registers a chunk ahead,
  // then permuted into the shared x buffer
  uint4 xr[C::XREGS];
  // XHOIST: unit i's x row (+ its k offset within a chunk), null past the
  // live tokens; a unit's token is the same in every chunk
  const __nv_bfloat16* xsrc[C::XHOIST ? C::XU : 1];
  if constexpr (C::XHOIST) {
#pragma unroll
    for (int i = 0; i < C::XU; ++i) {
      const int id = tid + i * THREADS;
      const int tok = C::WG ? id >> 2 : id >> 4;
      const int units = C::WG ? C::XTOK * 4 : C::XUNITS;
      const int koff = C::WG ? 8 * (id & 3) : 8 * (id & 15);
      xsrc[i] = id < units && tok < nrows ? p.x + (long long)s_xrow[tok] * p.stride_xm + koff
                                          : nullptr;
    }
  }
  auto load_x = [&](int c) {
    const int k0 = c * 128;
    if constexpr (C::PX) {
      (void)k0;  // PX: x comes by cp.async (issue_x)
    } else if constexpr (C::WG) {
      // unit id = tid + i * THREADS -> (token id >> 2, word w = id & 3):
      // x[k0 + 32 t + 8 w .. + 7] for t = 0..3 (what k-steps 2w, 2w + 1 take)
#pragma unroll
      for (int i = 0; i < C::XU; ++i) {
        const int id = tid + i * THREADS;
        const int tok = id >> 2, w = id & 3;
#pragma unroll
        for (int tt = 0; tt < 4; ++tt) {
          uint4 v = make_uint4(0u, 0u, 0u, 0u);
          if constexpr (C::XHOIST) {
            // K is a multiple of 32: k0 + 32 tt + 8 w < K iff k0 + 32 tt < K
            if (xsrc[i] != nullptr && k0 + 32 * tt < p.K)
              v = __ldg(reinterpret_cast<const uint4*>(xsrc[i] + k0 + 32 * tt));
          } else {
            const int k = k0 + 32 * tt + 8 * w;
            if (id < C::XTOK * 4 && tok < nrows && k < p.K)
              v = __ldg(reinterpret_cast<const uint4*>(p.x + (long long)s_xrow[tok] * p.stride_xm +
                                                       k));
          }
          xr[4 * i + tt] = v;
        }
      }
    } else {
      // unit id = tid + i * THREADS -> (token id / 16, 16-byte unit id % 16)
#pragma unroll
      for (int i = 0; i < C::XU; ++i) {
        const int id = tid + i * THREADS;
        const int tok = id >> 4, u = id & 15;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if constexpr (C::XHOIST) {
          if (xsrc[i] != nullptr && k0 + 8 * u < p.K)
            v = __ldg(reinterpret_cast<const uint4*>(xsrc[i] + k0));
        } else if (id < C::XUNITS && tok < nrows && k0 + 8 * u < p.K) {
          const __nv_bfloat16* src = p.x + (long long)s_xrow[tok] * p.stride_xm + k0 + 8 * u;
          v = __ldg(reinterpret_cast<const uint4*>(src));
        }
        xr[i] = v;
      }
    }
  };
  auto store_x = [&](int buf) {
    uint8_t* base = xbuf + buf * C::XBUF_BYTES;
    if constexpr (C::PX) {
      (void)base;
    } else if constexpr (C::WG) {
      // k-step ks = 2 w + h, k half d: the 16 bytes of token tok are the
      // pairs (x[32 t + 8 w + 2 h + d], x[.. + 4]) for t = 0..3, the k order
      // of the A registers (row tok & 7 of core matrix (tok >> 3, d))
#pragma unroll
      for (int i = 0; i < C::XU; ++i) {
        const int id = tid + i * THREADS;
        const int tok = id >> 2, w = id & 3;
        if (id < C::XTOK * 4 && tok < nsl * 8) {
          const uint4* v = xr + 4 * i;
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int d = 0; d < 2; ++d) {
              const uint32_t sel = d ? 0x7632u : 0x5410u;
              uint4 o;
              o.x = __byte_perm(h ? v[0].y : v[0].x, h ? v[0].w : v[0].z, sel);
              o.y = __byte_perm(h ? v[1].y : v[1].x, h ? v[1].w : v[1].z, sel);
              o.z = __byte_perm(h ? v[2].y : v[2].x, h ? v[2].w : v[2].z, sel);
              o.w = __byte_perm(h ? v[3].y : v[3].x, h ? v[3].w : v[3].z, sel);
              *reinterpret_cast<uint4*>(base + x_stage_offset<C>(2 * w + h, d, tok)) = o;
            }
        }
      }
      fence_proxy_async_smem();  // the stores -> the wgmmas' reads
    } else {
      // permuted (x0 x4 x1 x5 x2 x6 x3 x7 per 8-group), XOR-swizzled 16-byte units
#pragma unroll
      for (int i = 0; i < C::XU; ++i) {
        const int id = tid + i * THREADS;
        const int tok = id >> 4, u = id & 15;
        if (id < C::XUNITS && tok < nsl * 8) {
          const uint4 v = xr[i];
          uint4 o;
          o.x = __byte_perm(v.x, v.z, 0x5410);  // (x0, x4)
          o.y = __byte_perm(v.x, v.z, 0x7632);  // (x1, x5)
          o.z = __byte_perm(v.y, v.w, 0x5410);  // (x2, x6)
          o.w = __byte_perm(v.y, v.w, 0x7632);  // (x3, x7)
          const int phys = u ^ (((u >> 3) & 1) << 1) ^ (tok & 1);
          *reinterpret_cast<uint4*>(base + tok * 256 + phys * 16) = o;
        }
      }
    }
  };
  // PX: chunk c's x, unit id = tid + i * THREADS -> (token id >> 4, unit u =
  // id & 15 = 2 ks + d): the 16 bytes of k-step ks, k half d, already in the
  // staged order in global memory (x[row][128 c + 8 u .. + 7]), copied to
  // where store_x puts them; a partial last chunk's units hold 4 bytes per
  // live 32-k block (K % 32 == 0), the rest zero-filled, as are the units of
  // the live sub-tiles' tokens past nrows (src null)
  const __nv_bfloat16* xsrc_px[C::PX ? C::XU : 1];
  if constexpr (C::PX) {
#pragma unroll
    for (int i = 0; i < C::XU; ++i) {
      const int id = tid + i * THREADS;
      const int tok = id >> 4;
      xsrc_px[i] = id < C::XUNITS && tok < nrows
                       ? p.x + (long long)s_xrow[tok] * p.stride_xm + 8 * (id & 15)
                       : nullptr;
    }
  }
  auto issue_x = [&](int c) {
    if constexpr (C::PX) {
      if (c < p.NC) {
        const uint32_t base = smem_u32(xbuf) + (uint32_t)((c % STAGES) * C::XBUF_BYTES);
        const int live_blocks = min(4, (p.K - 128 * c) >> 5);
#pragma unroll
        for (int i = 0; i < C::XU; ++i) {
          const int id = tid + i * THREADS;
          const int tok = id >> 4, u = id & 15;
          if (id >= C::XUNITS || tok >= nsl * 8) continue;
          const uint32_t dst = base + (uint32_t)x_stage_offset<C>(u >> 1, u & 1, tok);
          const bool live = xsrc_px[i] != nullptr;
          cp_async16(dst, live ? (const void*)(xsrc_px[i] + 128 * c) : (const void*)p.x,
                     live ? 4 * live_blocks : 0);
        }
      }
    } else {
      (void)c;
    }
  };
  if constexpr (C::PX) {
#pragma unroll
    for (int c = 0; c < STAGES - 1; ++c) issue_x(c);
    cp_async_commit();  // after the weights' groups: chunk 0 waits for all (wgmma_loop)
  } else {
    load_x(0);
    store_x(0);
  }

  // ---- scale range of the CTA's rows -> fast (D) or slow path
  cp_async_wait<STAGES - 1>();  // group 0 (scales) done for this thread's copies
  __syncthreads();
  {
    unsigned lo4 = 0xffffffffu, hi4 = 0u;
    const int words = scale_len >> 2;
    const uint32_t* s32 = reinterpret_cast<const uint32_t*>(s_scale);
    for (int i = tid; i < words; i += THREADS) {
      lo4 = __vminu4(lo4, s32[i]);
      hi4 = __vmaxu4(hi4, s32[i]);
    }
    unsigned lo = min(min(lo4 & 0xffu, (lo4 >> 8) & 0xffu), min((lo4 >> 16) & 0xffu, lo4 >> 24));
    unsigned hi = max(max(hi4 & 0xffu, (hi4 >> 8) & 0xffu), max((hi4 >> 16) & 0xffu, hi4 >> 24));
    for (int b = (words << 2) + tid; b < scale_len; b += THREADS) {
      lo = min(lo, (unsigned)s_scale[b]);
      hi = max(hi, (unsigned)s_scale[b]);
    }
    lo = __reduce_min_sync(0xffffffffu, lo);
    hi = __reduce_max_sync(0xffffffffu, hi);
    if (lane == 0) {
      atomicMin(&s_mm[0], (int)lo);
      atomicMax(&s_mm[1], (int)hi);
    }
  }
  __syncthreads();
  const int s_lo = s_mm[0], s_hi = s_mm[1];
  int D = s_hi > 128 ? s_hi - 128 : 0;
  // exact products: s_lo >= D + 2 (A' >= 2^-126, normal), s_hi <= 252; and a
  // shift only when the spread is <= 64, so that no row's products are pushed
  // 2^-D toward fp32 subnormals in the accumulation
  const bool fast = s_lo >= D + 2 && s_hi <= 252 && (D == 0 || s_hi - s_lo <= 64);
  if (!fast) D = 0;

  // per-thread B read offsets (bytes in a buffer) of word w, sub-tile 0
  int boff[4];
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const int u = 4 * t + w;
    boff[w] = g * 256 + ((u ^ ((t >> 1) << 1) ^ (g & 1)) * 16);
  }

  float acc[MT][NSM][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int ns = 0; ns < NSM; ++ns)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][ns][e] = 0.f;

  // ---- main loop, one copy per dequant path (CTA-uniform choice)
  auto main_loop = [&](auto slow_tag) {
    constexpr bool SLOW = decltype(slow_tag)::value;
    for (int c = 0; c < p.NC; ++c) {
      issue_w(c + STAGES - 1);
      if (c + 1 < p.NC) load_x(c + 1);
      cp_async_wait<STAGES - 1>();  // this thread's weights of chunk c landed
      __syncthreads();              // x chunk c visible; everyone done with chunk c - 1

      if (warp_live) {
        const int stage = c % STAGES;
        const uint8_t* xb = xbuf + (c & 1) * C::XBUF_BYTES;
        const int blk = 4 * c + t;
        uint4 wq[MT][2];
        uint32_t fac[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            wq[mt][r] = *reinterpret_cast<const uint4*>(
                wbuf + (((stage * MT + mt) * 2 + r) * THREADS + tid) * 16);
            const uint32_t s = blk < p.KB ? s_scale[soff[mt][r] + blk] : 127u;
            if constexpr (SLOW)
              fac[mt][r] = e8m0_bf16x2(s);  // 2^(s-127)
            else
              fac[mt][r] = ((s + 126u - (uint32_t)D) << 7) * 0x00010001u;  // 2^(s-1-D)
          }
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          // A fragments of k-steps 2w (h = 0) and 2w + 1 (h = 1), all m-tiles:
          // regs (row g, row g+8, row g, row g+8) = pairs (2h, 2h, 2h+1, 2h+1)
          uint32_t a[2][MT][4];
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            const uint32_t q0 = (w == 0)   ? wq[mt][0].x
                                : (w == 1) ? wq[mt][0].y
                                : (w == 2) ? wq[mt][0].z
                                           : wq[mt][0].w;
            const uint32_t q1 = (w == 0)   ? wq[mt][1].x
                                : (w == 1) ? wq[mt][1].y
                                : (w == 2) ? wq[mt][1].z
                                           : wq[mt][1].w;
            a[0][mt][0] = dequant_pair<SLOW, 0>(q0, fac[mt][0]);
            a[0][mt][1] = dequant_pair<SLOW, 0>(q1, fac[mt][1]);
            a[0][mt][2] = dequant_pair<SLOW, 1>(q0, fac[mt][0]);
            a[0][mt][3] = dequant_pair<SLOW, 1>(q1, fac[mt][1]);
            a[1][mt][0] = dequant_pair<SLOW, 2>(q0, fac[mt][0]);
            a[1][mt][1] = dequant_pair<SLOW, 2>(q1, fac[mt][1]);
            a[1][mt][2] = dequant_pair<SLOW, 3>(q0, fac[mt][0]);
            a[1][mt][3] = dequant_pair<SLOW, 3>(q1, fac[mt][1]);
          }
          // per live sub-tile: one LDS.128 = B of both k-steps (x0x4 x1x5 | x2x6 x3x7)
#pragma unroll
          for (int ns = 0; ns < NSM; ++ns) {
            if (ns < nsl) {
              const uint4 b = *reinterpret_cast<const uint4*>(xb + ns * 2048 + boff[w]);
#pragma unroll
              for (int mt = 0; mt < MT; ++mt) {
                mma_bf16_16816(acc[mt][ns], a[0][mt][0], a[0][mt][1], a[0][mt][2],
                               a[0][mt][3], b.x, b.y);
                mma_bf16_16816(acc[mt][ns], a[1][mt][0], a[1][mt][1], a[1][mt][2],
                               a[1][mt][3], b.z, b.w);
              }
            }
          }
        }
      }
      if (c + 1 < p.NC) store_x((c + 1) & 1);
    }
  };
  // ---- wgmma main loop, one copy per (dequant path, live sub-tile count NS)
  auto wgmma_loop = [&](auto slow_tag, auto ns_tag) __attribute__((always_inline)) {
    constexpr bool SLOW = decltype(slow_tag)::value;
    constexpr int NS = decltype(ns_tag)::value;
    float* accp = &acc[0][0][0];
    const uint32_t xbuf_s = smem_u32(xbuf);
    // A of the 8 k-steps of a chunk, double-buffered (see MXCUDA_WGMMA_PENDING)
    uint32_t a_even[8][4], a_odd[8][4];
    auto chunk = [&](int c, uint32_t(&a)[8][4]) __attribute__((always_inline)) {
      if constexpr (C::PX) {
        // chunk c's weights and x landed (chunk 0: the prologue's x group
        // came after the weights' groups, so wait for everything)
        if (c == 0)
          cp_async_wait<0>();
        else
          cp_async_wait<STAGES - 2>();
      } else {
        issue_w(c + STAGES - 1);
        if (c + 1 < p.NC) load_x(c + 1);
        cp_async_wait<STAGES - 1>();  // this thread's weights of chunk c landed
      }
      // this thread's weights of chunk c (rows g, g + 8) and their scale factors
      uint4 wq[2];
      uint32_t fac[2];
      {
        const int stage = c % STAGES;
        const int blk = 4 * c + t;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          wq[r] = *reinterpret_cast<const uint4*>(wbuf + ((stage * 2 + r) * THREADS + tid) * 16);
          const uint32_t s = blk < p.KB ? s_scale[soff[0][r] + blk] : 127u;
          if constexpr (SLOW)
            fac[r] = e8m0_bf16x2(s);  // 2^(s-127)
          else
            fac[r] = ((s + 126u - (uint32_t)D) << 7) * 0x00010001u;  // 2^(s-1-D)
        }
      }
#pragma unroll
      for (int ks = 0; ks < 8; ++ks) dequant_kstep<SLOW, C::RC>(ks, wq, fac, a[ks]);
      // descriptors before the fence: no other instruction may define a wgmma
      // input inside the pipeline stage (ptxas would serialize the wgmmas)
      const uint64_t desc0 = smem_desc(xbuf_s + (uint32_t)((c % C::NXB) * C::XBUF_BYTES));
      uint64_t desc[8];
#pragma unroll
      for (int ks = 0; ks < 8; ++ks) desc[ks] = desc0 + (uint64_t)((ks * C::XREG_BYTES) >> 4);
      if constexpr (C::PX) {
        fence_proxy_async_smem();  // this thread's cp.async x -> the wgmmas' reads
        __syncthreads();           // everyone's x of chunk c; chunk c - 1's wgmmas all done
        issue_x(c + STAGES - 1);   // into chunk c - 1's x stage, free now
        issue_w(c + STAGES - 1);   // (its commit closes the group)
      } else {
        __syncthreads();  // x chunk c (stored and proxy-fenced a chunk earlier) visible
      }
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < 8; ++ks)
        WgmmaM64<NS>::run(accp, a[ks][0], a[ks][1], a[ks][2], a[ks][3], desc[ks]);
      wgmma_commit();
      // with 0 pending: chunk c's wgmmas (this warp's) are done; once every
      // warp passes the next barrier, x buffer c % NXB is free again
      wgmma_wait<C::PX ? 0 : MXCUDA_WGMMA_PENDING>();
      if (!C::PX && c + 1 < p.NC) store_x((c + 1) % C::NXB);
    };
    for (int c = 0; c < p.NC; c += 2) {
      chunk(c, a_even);
      if (c + 1 < p.NC) chunk(c + 1, a_odd);
    }
    wgmma_wait<0>();
  };
  if constexpr (C::WG) {
    // the live sub-tile count as a compile-time N (1..NSM)
    auto by_live_subtiles = [&](auto slow_tag) __attribute__((always_inline)) {
      switch (nsl) {
#define MXCUDA_NSL(n)                                        \
  case n:                                                    \
    if constexpr (n <= NSM) wgmma_loop(slow_tag, Int<n>{}); \
    break;
        MXCUDA_NSL(1) MXCUDA_NSL(2) MXCUDA_NSL(3) MXCUDA_NSL(4)
        MXCUDA_NSL(5) MXCUDA_NSL(6) MXCUDA_NSL(7) MXCUDA_NSL(8)
#undef MXCUDA_NSL
        default:
          break;
      }
    };
    if (fast)
      by_live_subtiles(Bool<false>{});
    else
      by_live_subtiles(Bool<true>{});
  } else {
    if (fast)
      main_loop(Bool<false>{});
    else
      main_loop(Bool<true>{});
  }
  cp_async_wait<0>();

  if (!warp_live) return;
  // ------------------------------------------------------------ epilogue
  const float mult = __uint_as_float((uint32_t)(127 + D) << 23);  // 2^D
  const __nv_bfloat16* bias = p.bias ? p.bias + slot64 * p.stride_bs : nullptr;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int mtile = mtile0 + mt;
    if (p.act != 0) {
      const int j = mtile * 8 + g;
      if (j >= p.n_out) continue;
      const int grow = p.g0 + j * p.step, urow = p.u0 + j * p.step;
      const float bg = bias ? __bfloat162float(bias[grow]) : 0.f;
      const float bu = bias ? __bfloat162float(bias[urow]) : 0.f;
#pragma unroll
      for (int ns = 0; ns < NSM; ++ns) {
        if (ns >= nsl) continue;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int lt = ns * 8 + 2 * t + e;
          if (lt >= nrows) continue;
          float gate = acc[mt][ns][e] * mult + bg;
          float up = acc[mt][ns][2 + e] * mult + bu;
          float y;
          if (p.act == 2) {  // silu(gate) * up
            y = gate / (1.f + expf(-gate)) * up;
          } else {
            gate = gate > p.limit ? p.limit : gate;  // NaN-propagating min / clamp (as torch)
            up = up > p.limit ? p.limit : (up < -p.limit ? -p.limit : up);
            y = (up + 1.f) * (gate / (1.f + expf(-gate * p.alpha)));
          }
          p.out[(long long)(start + lt) * p.stride_om + out_column(p, j)] =
              __float2bfloat16_rn(y);
        }
      }
    } else {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int n = mtile * 16 + g + 8 * r;
        if (n >= p.N) continue;
        const float bn = bias ? __bfloat162float(bias[n]) : 0.f;
#pragma unroll
        for (int ns = 0; ns < NSM; ++ns) {
          if (ns >= nsl) continue;
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int lt = ns * 8 + 2 * t + e;
            if (lt >= nrows) continue;
            const float y = acc[mt][ns][2 * r + e] * mult + bn;
            p.out[(long long)(start + lt) * p.stride_om + out_column(p, n)] =
                __float2bfloat16_rn(y);
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------- host side
constexpr int kMaxDevices = 64;

#ifndef PDFLASH_MXFP4_GEMM_SM90A
#define PDFLASH_MXFP4_GEMM_SM90A 0  // the build system says when there is sm_90a code
#endif

// Whether a kernel of `kind` runs on device `dev`: every kind needs compute
// capability 8.0+; the wgmma kind needs this build's sm_90a code
// (PDFLASH_MXFP4_GEMM_SM90A) and a compute capability 9.0 device, the only
// one that loads sm_90a code (elsewhere the compute_90 PTX, a trap for it,
// would run). PDFLASH_MXFP4_OK, PDFLASH_MXFP4_VARIANT_UNAVAILABLE, or
// PDFLASH_MXFP4_ATTRIBUTE_ERROR + cudaError_t.
int kind_runs_on(int kind, int dev) {
  const bool wgmma = kind == kKindWgmma || kind == kKindWgmmaPx || kind == kKindWgmmaRc;
  if (wgmma && !PDFLASH_MXFP4_GEMM_SM90A) return PDFLASH_MXFP4_VARIANT_UNAVAILABLE;
  int major = 0, minor = 0;
  cudaError_t e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  if (e != cudaSuccess) {
    cudaGetLastError();  // not sticky
    return PDFLASH_MXFP4_ATTRIBUTE_ERROR + (int)e;
  }
  const bool runs = wgmma ? major == 9 && minor == 0 : major >= 8;
  return runs ? PDFLASH_MXFP4_OK : PDFLASH_MXFP4_VARIANT_UNAVAILABLE;
}

template <class C>
int launch(const Params& p, int num_tiles, cudaStream_t stream) {
  const int smem = smem_bytes<C>(p.KB);
  // the largest dynamic shared memory set for this kernel so far, per device
  // (a function attribute; setting it is not a stream operation, so it is
  // allowed while the stream is captured)
  static std::atomic<int> configured[kMaxDevices];
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return PDFLASH_MXFP4_ATTRIBUTE_ERROR + (int)e;
  // (the mma.sync kinds need no check: below sm_80 there is no image for
  // them and the launch itself reports that)
  if constexpr (C::WG) {
    const int rc = kind_runs_on(C::KIND, dev);
    if (rc != PDFLASH_MXFP4_OK) return rc;
  }
  std::atomic<int>* done = dev >= 0 && dev < kMaxDevices ? &configured[dev] : nullptr;
  if (done == nullptr || done->load(std::memory_order_acquire) < smem) {
    e = cudaFuncSetAttribute(mxfp4_moe_kernel<C>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             smem);
    if (e != cudaSuccess) {
      cudaGetLastError();  // not sticky: later calls work
      return PDFLASH_MXFP4_ATTRIBUTE_ERROR + (int)e;
    }
    if (done != nullptr) {
      int seen = done->load(std::memory_order_relaxed);
      while (seen < smem && !done->compare_exchange_weak(seen, smem)) {
      }
    }
  }
  const int cols_per_cta = C::WARPS * C::MT * (p.act != 0 ? 8 : 16);
  dim3 grid(num_tiles, (p.n_out + cols_per_cta - 1) / cols_per_cta);
  mxfp4_moe_kernel<C><<<grid, C::THREADS, smem, stream>>>(p);
  e = cudaGetLastError();
  return e == cudaSuccess ? PDFLASH_MXFP4_OK : PDFLASH_MXFP4_LAUNCH_ERROR + (int)e;
}

// (variant, WARPS, MT, STAGES, MINB, largest NSM it is built for, L2 prefetch
// hint bytes, kind); NSM (2 / 4 / 8 sub-tiles of 8 tokens) is picked from
// block_m at launch. MT = 2 with 8 sub-tiles (64 fp32 accumulators; 8 warps:
// 4 sub-tiles) spills: not built. Kind 1 = kKindWgmma (MT 1, whole
// warpgroups; runs where kind_runs_on says); kind 2 = kKindWgmmaPx (the same,
// x given chunk-permuted: mxfp4_moe_gemm.h); kind 3 = kKindWgmmaRc (variant
// 10 reading repacked codes: mxfp4_moe_gemm.h).
#define MXCUDA_VARIANTS(X)      \
  X(0, 4, 1, 4, 3, 8, 0, 0)     \
  X(1, 4, 2, 4, 3, 4, 0, 0)     \
  X(2, 8, 1, 4, 2, 8, 0, 0)     \
  X(3, 8, 2, 3, 2, 2, 0, 0)     \
  X(4, 16, 1, 4, 1, 8, 0, 0)    \
  X(5, 8, 1, 8, 2, 8, 0, 0)     \
  X(6, 4, 1, 8, 3, 8, 0, 0)     \
  X(7, 4, 2, 8, 2, 4, 0, 0)     \
  X(8, 8, 1, 4, 2, 8, 256, 0)   \
  X(9, 4, 1, 8, 3, 8, 256, 0)   \
  X(10, 8, 1, 4, 2, 8, 256, 1)   \
  X(11, 16, 1, 4, 1, 8, 256, 1)  \
  X(12, 8, 1, 6, 2, 8, 256, 1)   \
  X(13, 12, 1, 4, 1, 8, 256, 1)  \
  X(14, 8, 1, 4, 2, 8, 256, 2)   \
  X(15, 8, 1, 4, 2, 8, 256, 3)

constexpr int kNumVariants = 16;

template <int WARPS, int MT, int STAGES, int MINB, int NSMAX, int PF, int KIND>
int launch_nsm(const Params& p, int num_tiles, cudaStream_t stream) {
  if (p.block_m <= 16)
    return launch<Cfg<WARPS, MT, 2, STAGES, MINB, PF, KIND>>(p, num_tiles, stream);
  if (p.block_m <= 32) {
    if constexpr (NSMAX >= 4)
      return launch<Cfg<WARPS, MT, 4, STAGES, MINB, PF, KIND>>(p, num_tiles, stream);
    return PDFLASH_MXFP4_BLOCK_M_VARIANT;
  }
  if (p.block_m <= 64) {
    if constexpr (NSMAX >= 8)
      return launch<Cfg<WARPS, MT, 8, STAGES, MINB, PF, KIND>>(p, num_tiles, stream);
    return PDFLASH_MXFP4_BLOCK_M_VARIANT;
  }
  return PDFLASH_MXFP4_BLOCK_M_TOO_LARGE;
}

}  // namespace mxcuda

extern "C" {

int mxfp4_moe_built(void) { return 1; }

int mxfp4_moe_num_variants(void) { return mxcuda::kNumVariants; }

int mxfp4_moe_wgmma_built(void) { return PDFLASH_MXFP4_GEMM_SM90A ? 1 : 0; }

const char* mxfp4_moe_error_string(int code) {
  if (code >= PDFLASH_MXFP4_LAUNCH_ERROR)
    return cudaGetErrorString(static_cast<cudaError_t>(code - PDFLASH_MXFP4_LAUNCH_ERROR));
  if (code >= PDFLASH_MXFP4_ATTRIBUTE_ERROR)
    return cudaGetErrorString(static_cast<cudaError_t>(code - PDFLASH_MXFP4_ATTRIBUTE_ERROR));
  switch (code) {
    case PDFLASH_MXFP4_OK:
      return "ok";
    case PDFLASH_MXFP4_BAD_VARIANT:
      return "unknown variant";
    case PDFLASH_MXFP4_BAD_ARGS:
      return "a shape, stride, alignment or epilogue the kernel cannot take";
    case PDFLASH_MXFP4_BLOCK_M_TOO_LARGE:
      return "block_m > 64";
    case PDFLASH_MXFP4_BLOCK_M_VARIANT:
      return "block_m larger than the variant's max_block_m";
    case PDFLASH_MXFP4_NOT_BUILT:
      return "pdflash was built without the CUDA MXFP4 GEMM";
    case PDFLASH_MXFP4_VARIANT_UNAVAILABLE:
      return "the variant's code does not run on this device (wgmma: sm_90a code, built for "
             "CUDA architecture 90, on a compute capability 9.0 device)";
    default:
      return "unknown error code";
  }
}

// the variant's parameters; 0, or 1 for an unknown variant
int mxfp4_moe_variant_info(int variant, int* warps, int* mt, int* stages, int* max_block_m,
                           int* l2_prefetch, int* kind) {
  switch (variant) {
#define MXCUDA_INFO(V, W, M, S, B, NS, PF, KD) \
  case V:                                      \
    *warps = W;                                \
    *mt = M;                                   \
    *stages = S;                               \
    *max_block_m = 8 * NS;                     \
    *l2_prefetch = PF;                         \
    *kind = KD;                                \
    return PDFLASH_MXFP4_OK;
    MXCUDA_VARIANTS(MXCUDA_INFO)
#undef MXCUDA_INFO
    default:
      return PDFLASH_MXFP4_BAD_VARIANT;
  }
}

int mxfp4_moe_variant_available(int variant, int device) {
  int warps, mt, stages, max_block_m, l2_prefetch, kind;
  const int rc =
      mxfp4_moe_variant_info(variant, &warps, &mt, &stages, &max_block_m, &l2_prefetch, &kind);
  if (rc != PDFLASH_MXFP4_OK) return rc;
  return mxcuda::kind_runs_on(kind, device);
}

// Returns PDFLASH_MXFP4_OK (0) or an error code (mxfp4_moe_gemm.h).
int mxfp4_moe_gemm(int variant, const void* x, long long stride_xm, const int* x_rows,
                   const void* blocks, long long stride_ws, long long stride_wn,
                   long long stride_wc, const void* scales, long long stride_ss,
                   long long stride_sn, long long stride_sk, const void* bias,
                   long long stride_bs, void* out, long long stride_om, const int* tile_slot,
                   const int* tile_start, const int* tile_end, int num_tiles, int block_m, int N,
                   int K, int n_out, int act, int gate_col0, int up_col0, int col_step,
                   float alpha, float limit, int out_layout, unsigned long long stream) {
  using namespace mxcuda;
  constexpr int kBad = PDFLASH_MXFP4_BAD_ARGS;
  if (variant < 0 || variant >= kNumVariants) return PDFLASH_MXFP4_BAD_VARIANT;
  if (K <= 0 || K % 32 != 0 || N <= 0 || n_out <= 0 || block_m <= 0) return kBad;
  if (stride_sk != 1 || stride_wn % 16 != 0 || stride_ws % 16 != 0 || stride_wc % 16 != 0 ||
      stride_xm % 8 != 0)
    return kBad;
  if ((reinterpret_cast<uintptr_t>(x) & 15) || (reinterpret_cast<uintptr_t>(blocks) & 15))
    return kBad;
  if (act < 0 || act > 2) return kBad;
  if (out_layout != PDFLASH_MXFP4_OUT_NATURAL && out_layout != PDFLASH_MXFP4_OUT_CHUNK_PERMUTED)
    return kBad;
  if (act != 0 && (col_step <= 0 || gate_col0 < 0 || up_col0 < 0)) return kBad;
  if (block_m > 64) return PDFLASH_MXFP4_BLOCK_M_TOO_LARGE;
  if (num_tiles <= 0) return PDFLASH_MXFP4_OK;
  if (!x || !x_rows || !blocks || !scales || !out || !tile_slot || !tile_start || !tile_end)
    return kBad;
  Params p;
  p.x = static_cast<const __nv_bfloat16*>(x);
  p.stride_xm = stride_xm;
  p.x_rows = x_rows;
  p.w = static_cast<const uint8_t*>(blocks);
  p.stride_ws = stride_ws;
  p.stride_wn = stride_wn;
  p.stride_wc = stride_wc;
  p.sc = static_cast<const uint8_t*>(scales);
  p.stride_ss = stride_ss;
  p.stride_sn = stride_sn;
  p.bias = static_cast<const __nv_bfloat16*>(bias);
  p.stride_bs = stride_bs;
  p.out = static_cast<__nv_bfloat16*>(out);
  p.stride_om = stride_om;
  p.tile_slot = tile_slot;
  p.tile_start = tile_start;
  p.tile_end = tile_end;
  p.block_m = block_m;
  p.N = N;
  p.K = K;
  p.KB = K / 32;
  p.NC = (p.KB + 3) / 4;
  p.n_out = n_out;
  p.act = act;
  p.g0 = gate_col0;
  p.u0 = up_col0;
  p.step = col_step;
  p.alpha = alpha;
  p.limit = limit;
  p.out_perm = out_layout == PDFLASH_MXFP4_OUT_CHUNK_PERMUTED ? 1 : 0;
  // a CTA's weight rows are contiguous: act 0 (rows nb .. nb + WR), or gate /
  // up interleaved 0 / 1 step 2 (rows 2 jb .. 2 jb + WR); scale rows dense
  const bool rows_contig =
      act == 0 || (col_step == 2 && ((gate_col0 == 0 && up_col0 == 1) ||
                                     (gate_col0 == 1 && up_col0 == 0)));
  p.scale_contig = rows_contig && stride_sn == p.KB ? 1 : 0;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(stream));
  switch (variant) {
#define MXCUDA_CASE(V, W, M, S, B, NS, PF, KD) \
  case V:                                      \
    return launch_nsm<W, M, S, B, NS, PF, KD>(p, num_tiles, s);
    MXCUDA_VARIANTS(MXCUDA_CASE)
#undef MXCUDA_CASE
    default:
      return PDFLASH_MXFP4_BAD_VARIANT;
  }
}

}  // extern "C"
