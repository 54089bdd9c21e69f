# cdef extern declarations of the CUDA MXFP4 expert GEMM
# (cuda/include/pdflash/mxfp4_moe_gemm.h; a build without it compiles the
# header's stand-ins, which return PDFLASH_MXFP4_NOT_BUILT).

cdef extern from "pdflash/mxfp4_moe_gemm.h" nogil:
    enum:
        PDFLASH_MXFP4_OK
        PDFLASH_MXFP4_BAD_VARIANT
        PDFLASH_MXFP4_BAD_ARGS
        PDFLASH_MXFP4_BLOCK_M_TOO_LARGE
        PDFLASH_MXFP4_BLOCK_M_VARIANT
        PDFLASH_MXFP4_NOT_BUILT
        PDFLASH_MXFP4_VARIANT_UNAVAILABLE
        PDFLASH_MXFP4_ATTRIBUTE_ERROR
        PDFLASH_MXFP4_LAUNCH_ERROR

    enum:
        PDFLASH_MXFP4_KIND_MMA_SYNC
        PDFLASH_MXFP4_KIND_WGMMA
        PDFLASH_MXFP4_KIND_WGMMA_PX
        PDFLASH_MXFP4_KIND_WGMMA_RC

    enum:
        PDFLASH_MXFP4_OUT_NATURAL
        PDFLASH_MXFP4_OUT_CHUNK_PERMUTED

    int mxfp4_moe_built()
    int mxfp4_moe_num_variants()
    int mxfp4_moe_wgmma_built()
    int mxfp4_moe_variant_info(int variant, int* warps, int* mt, int* stages, int* max_block_m,
                               int* l2_prefetch, int* kind)
    int mxfp4_moe_variant_available(int variant, int device)
    const char* mxfp4_moe_error_string(int code)
    int mxfp4_moe_gemm(int variant, const void* x, long long stride_xm, const int* x_rows,
                       const void* blocks, long long stride_ws, long long stride_wn,
                       long long stride_wc, const void* scales, long long stride_ss,
                       long long stride_sn, long long stride_sk, const void* bias,
                       long long stride_bs, void* out, long long stride_om, const int* tile_slot,
                       const int* tile_start, const int* tile_end, int num_tiles, int block_m,
                       int N, int K, int n_out, int act, int gate_col0, int up_col0,
                       int col_step, float alpha, float limit, int out_layout,
                       unsigned long long stream)
