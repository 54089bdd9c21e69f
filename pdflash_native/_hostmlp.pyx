# cython: language_level=3, auto_pickle=False
"""Binding of the host expert MLP (cuda/include/pdflash/host_mlp.h).

Pointers are plain integers (``tensor.data_ptr()``); the weights of each
expert come as arrays of pointers (0: no bias). :meth:`HostMlp.run` releases
the GIL for the whole batch. The Python-facing kernel is
``pdflash.hybrid.native.NativeHostKernel``; the math and the packed layout
are specified in host_mlp.h and, as runnable code, in
``pdflash._reference.hostmlp``.
"""

from libc.stdint cimport int64_t, uint8_t, uint16_t, uint64_t, uintptr_t
from libcpp.vector cimport vector

from pdflash_native._hostmlp_cpp cimport (
    FloatType,
    HostMlpRunner,
    MlpExpert,
    MlpIsa,
    MlpShape,
    WeightFormat,
    cpu_has_amx_bf16 as c_cpu_has_amx_bf16,
    cpu_has_avx512_bf16 as c_cpu_has_avx512_bf16,
    mlp_hidden_pairs,
    mlp_inter_pad,
    mlp_mxfp4_code_bytes,
    mlp_mxfp4_scale_bytes,
    mlp_w1_tiles,
    mlp_w2_tiles,
    mlp_w1_elems,
    mlp_w2_elems,
)

import numpy as np

ACT_SWIGLU_SILU = 0
ACT_GPT_OSS_CLAMP = 1
ISA_AUTO = <int>MlpIsa.kAuto
ISA_SCALAR = <int>MlpIsa.kScalar
ISA_AVX512_BF16 = <int>MlpIsa.kAvx512Bf16
ISA_AMX_BF16 = <int>MlpIsa.kAmxBf16
ISA_NAMES = {
    ISA_AUTO: "auto",
    ISA_SCALAR: "scalar",
    ISA_AVX512_BF16: "avx512_bf16",
    ISA_AMX_BF16: "amx_bf16",
}
DTYPE_F32 = <int>FloatType.kF32
DTYPE_BF16 = <int>FloatType.kBF16
WEIGHTS_BF16 = <int>WeightFormat.kBf16
WEIGHTS_MXFP4 = <int>WeightFormat.kMxfp4
WEIGHTS_FP8 = <int>WeightFormat.kFp8
#: columns of a packed tile, and intermediate indices of a W1 tile
TILE_COLS = 32
W1_TILE_INTER = 16


def cpu_has_avx512_bf16():
    """True if this CPU (and OS) runs the AVX-512 BF16 kernel."""
    return bool(c_cpu_has_avx512_bf16())


def cpu_has_amx_bf16():
    """True if this CPU (and OS, and this process's permission, which the
    first call requests) runs the AMX BF16 kernel."""
    return bool(c_cpu_has_amx_bf16())


def inter_pad(int64_t inter):
    """The intermediate size as packed (rounded up to 32)."""
    return mlp_inter_pad(inter)


def hidden_pairs(int64_t hidden):
    """Pairs of the hidden size as packed (ceil(H / 2) rounded up to 16)."""
    return mlp_hidden_pairs(hidden)


def w1_elems(int64_t hidden, int64_t inter):
    """uint16 elements of one packed W1 (gate and up)."""
    return mlp_w1_elems(hidden, inter)


def w2_elems(int64_t hidden, int64_t inter):
    """uint16 elements of one packed W2 (down)."""
    return mlp_w2_elems(hidden, inter)


def mxfp4_code_bytes(int64_t elems):
    """Bytes of the MXFP4 codes of a packed matrix of ``elems`` elements."""
    return mlp_mxfp4_code_bytes(elems)


def mxfp4_scale_bytes(int64_t elems):
    """Bytes of its MXFP4 scales."""
    return mlp_mxfp4_scale_bytes(elems)


def w1_tiles(int64_t inter):
    """Tiles of a packed W1 (FP8: 32 column scales each)."""
    return mlp_w1_tiles(inter)


def w2_tiles(int64_t hidden):
    """Tiles of a packed W2."""
    return mlp_w2_tiles(hidden)


cdef class HostMlp:
    """A team of ``threads`` threads (``threads - 1`` workers and the caller)
    computing batches of experts; ``spin_us``: how long idle workers spin
    before they park."""

    cdef HostMlpRunner* _runner
    cdef int _active
    cdef readonly int threads
    cdef readonly int spin_us

    def __cinit__(self):
        self._runner = NULL
        self._active = 0

    def __init__(self, int threads, int spin_us=50):
        if self._runner != NULL:
            raise RuntimeError("HostMlp is already initialised")
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if spin_us < 0:
            raise ValueError(f"spin_us must be >= 0, got {spin_us}")
        self._runner = new HostMlpRunner(threads, spin_us)
        self.threads = threads
        self.spin_us = spin_us

    def __dealloc__(self):
        if self._runner != NULL:
            del self._runner
            self._runner = NULL

    @property
    def closed(self):
        return self._runner == NULL

    @property
    def worker_tids(self):
        """The ``threads - 1`` workers' kernel thread ids (Linux; empty
        elsewhere and once closed), for ``os.sched_setaffinity``."""
        return [] if self._runner == NULL else list(self._runner.worker_tids())

    @property
    def calls(self):
        """Batches computed so far."""
        return 0 if self._runner == NULL else self._runner.calls()

    @property
    def last_isa(self):
        """The ISA the last batch ran (an ``ISA_*`` value; ``ISA_AUTO`` before any)."""
        return ISA_AUTO if self._runner == NULL else <int>self._runner.last_isa()

    def close(self):
        """Join the worker threads; idempotent. Raises RuntimeError while a
        batch runs on another thread."""
        if self._active:
            raise RuntimeError("HostMlp.close() while a batch is running")
        if self._runner != NULL:
            del self._runner
            self._runner = NULL

    def run(
        self,
        int act,
        int64_t hidden,
        int64_t inter,
        float alpha,
        float limit,
        const uint64_t[::1] w1,
        const uint64_t[::1] b1,
        const uint64_t[::1] w2,
        const uint64_t[::1] b2,
        const int64_t[::1] bounds,
        uintptr_t x,
        int x_type,
        int64_t x_stride,
        uintptr_t out,
        int out_type,
        int64_t out_stride,
        int isa=ISA_AUTO,
        int64_t amx_min_rows=1,
        int weights=WEIGHTS_BF16,
        const uint64_t[::1] q1=None,
        const uint64_t[::1] s1=None,
        const uint64_t[::1] q2=None,
        const uint64_t[::1] s2=None,
    ):
        """Experts ``j`` (pointer arrays ``w1[j]`` ..., 0: no bias) on rows
        ``bounds[j]:bounds[j + 1]`` of ``x`` into ``out`` (row strides in
        elements; ``x_type``/``out_type`` ``DTYPE_*``; with AMX, row chunks
        of fewer than ``amx_min_rows`` rows run AVX-512). The caller keeps
        every buffer alive and sized (``w1_elems``/``w2_elems`` elements,
        biases ``2 * inter_pad(inter)`` and ``hidden`` floats).
        ``weights=WEIGHTS_MXFP4``: the matrices are MXFP4 codes and scales
        (``q1``, ``s1``, ``q2``, ``s2``: ``mxfp4_code_bytes`` and
        ``mxfp4_scale_bytes`` of ``w1_elems``/``w2_elems``; ``w1``/``w2``
        are then not read). ``weights=WEIGHTS_FP8``: e4m3 codes (``q1``,
        ``q2``: ``w1_elems``/``w2_elems`` bytes) and fp32 column scales
        (``s1``, ``s2``: 32 floats per ``w1_tiles``/``w2_tiles`` tile)."""
        if self._runner == NULL:
            raise RuntimeError("HostMlp is closed")
        cdef Py_ssize_t n = w1.shape[0]
        if b1.shape[0] != n or w2.shape[0] != n or b2.shape[0] != n or bounds.shape[0] != n + 1:
            raise ValueError(
                f"{n} experts need {n} pointers per array and {n + 1} bounds"
            )
        if weights not in (WEIGHTS_BF16, WEIGHTS_MXFP4, WEIGHTS_FP8):
            raise ValueError(f"unknown weight format {weights}")
        cdef bint mx = weights == WEIGHTS_MXFP4
        cdef bint f8 = weights == WEIGHTS_FP8
        if (mx or f8) and (
            q1 is None or s1 is None or q2 is None or s2 is None
            or q1.shape[0] != n or s1.shape[0] != n or q2.shape[0] != n or s2.shape[0] != n
        ):
            raise ValueError(f"quantized weights need {n} pointers in each of q1, s1, q2, s2")
        if x_type not in (DTYPE_F32, DTYPE_BF16) or out_type not in (DTYPE_F32, DTYPE_BF16):
            raise ValueError(f"unknown dtype tags {x_type}, {out_type}")
        if isa not in ISA_NAMES:
            raise ValueError(f"unknown isa {isa}")
        cdef MlpShape shape
        shape.hidden = hidden
        shape.inter = inter
        shape.act = act
        shape.alpha = alpha
        shape.limit = limit
        shape.weights = weights
        cdef vector[MlpExpert] experts
        experts.resize(n)
        cdef Py_ssize_t j
        for j in range(n):
            experts[j].w1 = <const uint16_t*><uintptr_t>w1[j]
            experts[j].b1 = <const float*><uintptr_t>b1[j]
            experts[j].w2 = <const uint16_t*><uintptr_t>w2[j]
            experts[j].b2 = <const float*><uintptr_t>b2[j]
            if mx:
                experts[j].q1 = <const uint8_t*><uintptr_t>q1[j]
                experts[j].s1 = <const uint8_t*><uintptr_t>s1[j]
                experts[j].q2 = <const uint8_t*><uintptr_t>q2[j]
                experts[j].s2 = <const uint8_t*><uintptr_t>s2[j]
            elif f8:
                experts[j].q1 = <const uint8_t*><uintptr_t>q1[j]
                experts[j].c1 = <const float*><uintptr_t>s1[j]
                experts[j].q2 = <const uint8_t*><uintptr_t>q2[j]
                experts[j].c2 = <const float*><uintptr_t>s2[j]
            experts[j].row_begin = bounds[j]
            experts[j].row_end = bounds[j + 1]
        cdef int64_t rows = bounds[n] if n else 0
        if n and bounds[0] != 0:
            raise ValueError(f"bounds must start at 0, got {bounds[0]}")
        self._active += 1
        try:
            with nogil:
                self._runner.run(
                    shape, experts.data(), n, <const void*>x, <FloatType>x_type, x_stride,
                    <void*>out, <FloatType>out_type, out_stride, rows, <MlpIsa>isa,
                    amx_min_rows,
                )
        finally:
            self._active -= 1
