/* The grouped MXFP4 x bf16 expert GEMM over the slab (cuda/src/mxfp4_moe_gemm.cu):
 * the CUDA twin of pdflash.models.fused_moe_triton.grouped_qgemm for
 * fmt "mxfp4" and bf16 activations (fp32 accumulation, bf16 output).
 *
 *   out[r] = epilogue(x[x_rows[r]] @ W[slot(r)]^T + bias[slot(r)])
 *
 * for the sorted rows r that the tile map covers: tile i is
 * (tile_slot[i], tile_start[i], tile_end[i]) int32, slot -1 = dead (skipped,
 * its range unread), and covers rows [start, min(start + block_m, end)).
 * Rows no live tile covers are not written (the caller masks them).
 *
 * W: blocks [S, N, K/32, 16] uint8 (two e2m1 codes per byte, low nibble =
 * lower k) and scales [S, N, K/32] uint8 e8m0 (2^(s-127); the k stride must
 * be 1). The blocks' bytes: row n of slot s starts at s * stride_ws + n *
 * stride_wn, and within a row each 128-k chunk (4 blocks, 64 contiguous
 * bytes) starts stride_wc bytes after the previous one: 64 for rows whose
 * K/2 bytes are contiguous; N * 64 for a chunk-major slot ([K/128][N][64],
 * each chunk of consecutive rows one contiguous run). Bias: bf16 [S, N]
 * (row stride stride_bs elements) or NULL. x: bf16 rows (k stride 1), x_rows
 * int32. out: bf16 rows (column stride 1). Strides are in elements for x, bias and
 * out, in bytes for blocks and scales. out_layout 0 writes output column j at
 * j; 1 (PDFLASH_MXFP4_OUT_CHUNK_PERMUTED, for a next GEMM of kind
 * PDFLASH_MXFP4_KIND_WGMMA_PX) at its place in the chunk-permuted layout
 * below (out rows then hold ceil(n_out / 128) * 128 positions; those of
 * columns >= n_out are not written).
 *
 * Epilogues (act): 0 none (+ bias), out [rows, N]; 1 gpt-oss clamped
 * SwiGLU (g = min(gate, limit), u = clamp(up, -limit, limit),
 * (u + 1) * g * sigmoid(alpha * g)); 2 silu(gate) * up. For act 1 and 2 the
 * gate / up weight rows of output column j are gate_col0 + j * col_step and
 * up_col0 + j * col_step, out [rows, n_out].
 *
 * Alignment the kernel needs (else PDFLASH_MXFP4_BAD_ARGS): x and blocks
 * 16-byte aligned, stride_xm % 8 == 0, stride_ws, stride_wn and stride_wc
 * multiples of 16 (bytes), stride_sk == 1, K % 32 == 0.
 *
 * Variants (mxfp4_moe_variant_info): warps per CTA, m16 weight tiles per
 * warp, cp.async stages, the largest block_m it is built for (16 / 32 / 64),
 * the cp.async L2 prefetch hint in bytes (0: none) and the kind
 * (PDFLASH_MXFP4_KIND_*). Each supports every block_m up to its
 * max_block_m. Device code needs sm_80+ (mma.sync bf16, cp.async); the build
 * compiles it only for such architectures. The wgmma kinds need sm_90a code:
 * built where the CUDA architectures include 90 (mxfp4_moe_wgmma_built), it
 * runs on compute capability 9.0 devices only; elsewhere mxfp4_moe_gemm
 * refuses it with PDFLASH_MXFP4_VARIANT_UNAVAILABLE, and
 * mxfp4_moe_variant_available says so beforehand.
 *
 * Every function is thread-safe. mxfp4_moe_gemm only enqueues work on
 * `stream` (a cudaStream_t of the current device, as an integer): it may be
 * called while the stream is being captured into a CUDA graph.
 *
 * Builds without the kernel (PDFLASH_WITH_MXFP4_GEMM defined as 0: no CUDA
 * compiler, or an architecture below sm_80) get inline stand-ins that
 * return PDFLASH_MXFP4_NOT_BUILT (mxfp4_moe_variant_available too).
 */
#ifndef PDFLASH_MXFP4_MOE_GEMM_H_
#define PDFLASH_MXFP4_MOE_GEMM_H_

#ifdef __cplusplus
extern "C" {
#endif

/* mxfp4_moe_gemm's return codes */
enum {
  PDFLASH_MXFP4_OK = 0,
  PDFLASH_MXFP4_BAD_VARIANT = 1,        /* variant outside [0, mxfp4_moe_num_variants()) */
  PDFLASH_MXFP4_BAD_ARGS = 2,           /* a shape, stride, alignment or act the kernel cannot take */
  PDFLASH_MXFP4_BLOCK_M_TOO_LARGE = 3,  /* block_m > 64 */
  PDFLASH_MXFP4_BLOCK_M_VARIANT = 4,    /* block_m > the variant's max_block_m */
  PDFLASH_MXFP4_NOT_BUILT = 5,          /* this build has no kernel */
  /* the variant's code does not run on the device (wgmma: no sm_90a code in
   * this build, or not a compute capability 9.0 device) */
  PDFLASH_MXFP4_VARIANT_UNAVAILABLE = 6,
  /* + cudaError_t: a device attribute query or cudaFuncSetAttribute
   * (dynamic shared memory) failed */
  PDFLASH_MXFP4_ATTRIBUTE_ERROR = 100,
  /* + cudaError_t: the launch failed (cudaGetLastError after it) */
  PDFLASH_MXFP4_LAUNCH_ERROR = 1000
};

/* variant kinds (mxfp4_moe_variant_info) */
enum {
  PDFLASH_MXFP4_KIND_MMA_SYNC = 0, /* mma.sync m16n8k16 (sm_80+) */
  PDFLASH_MXFP4_KIND_WGMMA = 1,    /* wgmma m64nNk16, x from shared memory (sm_90a) */
  /* the wgmma kind with x given chunk-permuted (sm_90a): each row of x holds
   * NC * 128 elements (NC = ceil(K / 128)); within each 128-element chunk the
   * input k = 32 t + 8 w + 4 e + 2 h + d (t, w < 4; e, h, d < 2) sits at
   * position 32 w + 16 h + 8 d + 2 t + e (pdflash.models.mxfp4_cuda_gemm.
   * chunk_permuted); positions of k >= K are never read */
  PDFLASH_MXFP4_KIND_WGMMA_PX = 2,
  /* the wgmma kind with the weights' codes given repacked (sm_90a): in each
   * little-endian 32-bit word of the blocks, natural nibble i (bits 4i..4i+3:
   * m, e0, e1, s of k = 8w + i) moves its role bits to
   *   i = 0: 6, 7, 8, 15    i = 4: 22, 23, 24, 31
   *   i = 1: 10, 11, 12, 19 i = 5: 26, 27, 28, 3
   *   i = 2: 16, 17, 18, 25 i = 6: 0, 1, 2, 9
   *   i = 3: 4, 5, 14, 13   i = 7: 20, 21, 30, 29
   * (pdflash.models.mxfp4_cuda_gemm.repack_codes); scales as given */
  PDFLASH_MXFP4_KIND_WGMMA_RC = 3
};

/* out_layout values (mxfp4_moe_gemm) */
enum {
  PDFLASH_MXFP4_OUT_NATURAL = 0,
  PDFLASH_MXFP4_OUT_CHUNK_PERMUTED = 1
};

#if defined(PDFLASH_WITH_MXFP4_GEMM) && !PDFLASH_WITH_MXFP4_GEMM

static inline int mxfp4_moe_built(void) { return 0; }
static inline int mxfp4_moe_num_variants(void) { return 0; }
static inline int mxfp4_moe_wgmma_built(void) { return 0; }
static inline int mxfp4_moe_variant_info(int variant, int* warps, int* mt, int* stages,
                                         int* max_block_m, int* l2_prefetch, int* kind) {
  (void)variant, (void)warps, (void)mt, (void)stages, (void)max_block_m, (void)l2_prefetch;
  (void)kind;
  return PDFLASH_MXFP4_BAD_VARIANT;
}
static inline int mxfp4_moe_variant_available(int variant, int device) {
  (void)variant, (void)device;
  return PDFLASH_MXFP4_NOT_BUILT;
}
static inline const char* mxfp4_moe_error_string(int code) {
  return code == 0 ? "ok" : "pdflash was built without the CUDA MXFP4 GEMM";
}
static inline int mxfp4_moe_gemm(
    int variant, const void* x, long long stride_xm, const int* x_rows, const void* blocks,
    long long stride_ws, long long stride_wn, long long stride_wc, const void* scales,
    long long stride_ss, long long stride_sn, long long stride_sk, const void* bias,
    long long stride_bs, void* out, long long stride_om, const int* tile_slot,
    const int* tile_start, const int* tile_end, int num_tiles, int block_m, int N, int K,
    int n_out, int act, int gate_col0, int up_col0, int col_step, float alpha, float limit,
    int out_layout, unsigned long long stream) {
  (void)variant, (void)x, (void)stride_xm, (void)x_rows, (void)blocks, (void)stride_ws;
  (void)stride_wn, (void)stride_wc, (void)scales, (void)stride_ss, (void)stride_sn;
  (void)stride_sk, (void)bias;
  (void)stride_bs, (void)out, (void)stride_om, (void)tile_slot, (void)tile_start, (void)tile_end;
  (void)num_tiles, (void)block_m, (void)N, (void)K, (void)n_out, (void)act, (void)gate_col0;
  (void)up_col0, (void)col_step, (void)alpha, (void)limit, (void)out_layout, (void)stream;
  return PDFLASH_MXFP4_NOT_BUILT;
}

#else

/* 1: this library has the kernel. */
int mxfp4_moe_built(void);

/* How many variants mxfp4_moe_gemm takes (0 .. n - 1). */
int mxfp4_moe_num_variants(void);

/* 1: this library has sm_90a code for the wgmma variants. */
int mxfp4_moe_wgmma_built(void);

/* A variant's parameters (see above); PDFLASH_MXFP4_OK, or
 * PDFLASH_MXFP4_BAD_VARIANT (outputs untouched). */
int mxfp4_moe_variant_info(int variant, int* warps, int* mt, int* stages, int* max_block_m,
                           int* l2_prefetch, int* kind);

/* Whether mxfp4_moe_gemm runs `variant` on CUDA device `device` (an
 * ordinal): PDFLASH_MXFP4_OK, PDFLASH_MXFP4_VARIANT_UNAVAILABLE,
 * PDFLASH_MXFP4_BAD_VARIANT, or PDFLASH_MXFP4_ATTRIBUTE_ERROR + cudaError_t
 * (the device query failed). Not a stream operation: allowed during capture. */
int mxfp4_moe_variant_available(int variant, int device);

/* A static description of a return code (for CUDA codes, the CUDA error). */
const char* mxfp4_moe_error_string(int code);

/* Enqueue the GEMM on `stream` (no host sync; num_tiles <= 0: nothing to
 * do). Returns PDFLASH_MXFP4_OK or an error code above (a variant that does
 * not run on the current device: PDFLASH_MXFP4_VARIANT_UNAVAILABLE); an
 * error enqueues nothing. The grid is (num_tiles, column blocks): dead tiles cost an empty
 * CTA each. */
int mxfp4_moe_gemm(int variant, const void* x, long long stride_xm, const int* x_rows,
                   const void* blocks, long long stride_ws, long long stride_wn,
                   long long stride_wc, const void* scales, long long stride_ss,
                   long long stride_sn, long long stride_sk, const void* bias,
                   long long stride_bs, void* out, long long stride_om, const int* tile_slot,
                   const int* tile_start, const int* tile_end, int num_tiles, int block_m, int N,
                   int K, int n_out, int act, int gate_col0, int up_col0, int col_step,
                   float alpha, float limit, int out_layout, unsigned long long stream);

#endif

#ifdef __cplusplus
}
#endif

#endif /* PDFLASH_MXFP4_MOE_GEMM_H_ */
