# cython: language_level=3, auto_pickle=False
"""Binding of the CUDA MXFP4 expert GEMM (cuda/include/pdflash/mxfp4_moe_gemm.h).

Pointers and the stream are integers (device addresses and a
``cudaStream_t``); this module knows nothing of torch. :func:`launch`
enqueues one grouped GEMM and returns the launcher's code (``OK`` or one of
the error codes below; ``error_string`` describes it). Built without the
kernel (no CUDA compiler, or an architecture below sm_80), the module still
imports: ``BUILT`` is False, :func:`num_variants` is 0 and :func:`launch`
raises RuntimeError. ``WGMMA_BUILT``: the build has the sm_90a code of the
wgmma variants (kinds ``KIND_WGMMA``, ``KIND_WGMMA_PX``, taking x
chunk-permuted, and ``KIND_WGMMA_RC``, taking the codes repacked: the
header), which run on compute capability 9.0
devices only; :func:`variant_available` says whether a variant runs on a
device (``launch`` returns ``VARIANT_UNAVAILABLE`` where it does not). The Python-facing seam is
``pdflash.models.mxfp4_cuda_gemm``; the kernel's per-lane algorithm, as
runnable code, is ``tests/models/mxfp4_cuda_model.py``.
"""

from libc.stdint cimport uintptr_t

BUILT = bool(mxfp4_moe_built())
WGMMA_BUILT = bool(mxfp4_moe_wgmma_built())

OK = PDFLASH_MXFP4_OK
BAD_VARIANT = PDFLASH_MXFP4_BAD_VARIANT
BAD_ARGS = PDFLASH_MXFP4_BAD_ARGS
BLOCK_M_TOO_LARGE = PDFLASH_MXFP4_BLOCK_M_TOO_LARGE
BLOCK_M_VARIANT = PDFLASH_MXFP4_BLOCK_M_VARIANT
NOT_BUILT = PDFLASH_MXFP4_NOT_BUILT
VARIANT_UNAVAILABLE = PDFLASH_MXFP4_VARIANT_UNAVAILABLE
ATTRIBUTE_ERROR = PDFLASH_MXFP4_ATTRIBUTE_ERROR
LAUNCH_ERROR = PDFLASH_MXFP4_LAUNCH_ERROR

KIND_MMA_SYNC = PDFLASH_MXFP4_KIND_MMA_SYNC
KIND_WGMMA = PDFLASH_MXFP4_KIND_WGMMA
KIND_WGMMA_PX = PDFLASH_MXFP4_KIND_WGMMA_PX
KIND_WGMMA_RC = PDFLASH_MXFP4_KIND_WGMMA_RC

OUT_NATURAL = PDFLASH_MXFP4_OUT_NATURAL
OUT_CHUNK_PERMUTED = PDFLASH_MXFP4_OUT_CHUNK_PERMUTED


def num_variants():
    """How many kernel variants :func:`launch` takes (0 when not built)."""
    return mxfp4_moe_num_variants()


def variant_info(int variant):
    """``(warps, m_tiles_per_warp, stages, max_block_m, l2_prefetch_bytes,
    kind)`` of ``variant`` (``kind``: ``KIND_MMA_SYNC``, ``KIND_WGMMA``,
    ``KIND_WGMMA_PX`` or ``KIND_WGMMA_RC``;
    ValueError for an unknown variant)."""
    cdef int warps = 0, mt = 0, stages = 0, max_block_m = 0, l2_prefetch = 0, kind = 0
    if mxfp4_moe_variant_info(
        variant, &warps, &mt, &stages, &max_block_m, &l2_prefetch, &kind
    ) != 0:
        raise ValueError(f"unknown CUDA MXFP4 GEMM variant {variant} (of {num_variants()})")
    return warps, mt, stages, max_block_m, l2_prefetch, kind


def variant_available(int variant, int device):
    """Whether :func:`launch` runs ``variant`` on CUDA device ``device`` (an
    ordinal): ``OK``, ``VARIANT_UNAVAILABLE`` (e.g. a wgmma variant without
    sm_90a code or off compute capability 9.0), ``BAD_VARIANT``,
    ``NOT_BUILT``, or ``ATTRIBUTE_ERROR`` + the CUDA error of the device
    query."""
    cdef int rc
    with nogil:
        rc = mxfp4_moe_variant_available(variant, device)
    return rc


def error_string(int code):
    """The launcher's description of ``code`` (CUDA codes: the CUDA error)."""
    return mxfp4_moe_error_string(code).decode()


def launch(
    int variant,
    uintptr_t x, long long stride_xm, uintptr_t x_rows,
    uintptr_t blocks, long long stride_ws, long long stride_wn, long long stride_wc,
    uintptr_t scales, long long stride_ss, long long stride_sn, long long stride_sk,
    uintptr_t bias, long long stride_bs,
    uintptr_t out, long long stride_om,
    uintptr_t tile_slot, uintptr_t tile_start, uintptr_t tile_end, int num_tiles,
    int block_m, int n, int k, int n_out,
    int act, int gate_col0, int up_col0, int col_step, float alpha, float limit,
    int out_layout, uintptr_t stream,
):
    """Enqueue the GEMM on ``stream`` (see mxfp4_moe_gemm.h for the layouts;
    ``stride_wc`` 64 for blocks whose rows are contiguous;
    ``bias`` 0 = none; ``out_layout`` ``OUT_NATURAL`` or
    ``OUT_CHUNK_PERMUTED``); the launcher's code (``OK`` = 0). RuntimeError
    when this build has no kernel."""
    if not BUILT:
        raise RuntimeError(
            "pdflash_native._mxfp4gemm was built without the CUDA MXFP4 GEMM "
            "(no CUDA compiler at build time, or CMAKE_CUDA_ARCHITECTURES below 80)"
        )
    cdef int rc
    with nogil:
        rc = mxfp4_moe_gemm(
            variant, <const void*>x, stride_xm, <const int*>x_rows,
            <const void*>blocks, stride_ws, stride_wn, stride_wc,
            <const void*>scales, stride_ss, stride_sn, stride_sk,
            <const void*>bias, stride_bs, <void*>out, stride_om,
            <const int*>tile_slot, <const int*>tile_start, <const int*>tile_end, num_tiles,
            block_m, n, k, n_out, act, gate_col0, up_col0, col_step, alpha, limit,
            out_layout, <unsigned long long>stream,
        )
    return rc
