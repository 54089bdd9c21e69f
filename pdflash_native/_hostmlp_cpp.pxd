# cdef extern declarations of the host expert MLP (cuda/include/pdflash/host_mlp.h).
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t
from libcpp.vector cimport vector


cdef extern from "pdflash/host_mlp.h" namespace "pdflash" nogil:
    cdef enum class MlpIsa(int32_t):
        kAuto
        kScalar
        kAvx512Bf16
        kAmxBf16

    cdef enum class FloatType(int32_t):
        kF32
        kBF16

    cdef enum class WeightFormat(int32_t):
        kBf16
        kMxfp4
        kFp8

    cdef cppclass MlpShape:
        int64_t hidden
        int64_t inter
        int32_t act
        float alpha
        float limit
        int32_t weights

    cdef cppclass MlpExpert:
        const uint16_t* w1
        const float* b1
        const uint16_t* w2
        const float* b2
        const uint8_t* q1
        const uint8_t* s1
        const uint8_t* q2
        const uint8_t* s2
        const float* c1
        const float* c2
        int64_t row_begin
        int64_t row_end

    int64_t mlp_inter_pad(int64_t inter)
    int64_t mlp_hidden_pairs(int64_t hidden)
    int64_t mlp_w1_elems(int64_t hidden, int64_t inter)
    int64_t mlp_w2_elems(int64_t hidden, int64_t inter)
    int64_t mlp_mxfp4_code_bytes(int64_t elems)
    int64_t mlp_mxfp4_scale_bytes(int64_t elems)
    int64_t mlp_w1_tiles(int64_t inter)
    int64_t mlp_w2_tiles(int64_t hidden)
    bint cpu_has_avx512_bf16()
    bint cpu_has_amx_bf16()

    cdef cppclass HostMlpRunner:
        HostMlpRunner(int threads, int spin_us) except +
        void run(const MlpShape& shape, const MlpExpert* experts, int64_t n_experts,
                 const void* x, FloatType x_type, int64_t x_stride, void* out,
                 FloatType out_type, int64_t out_stride, int64_t rows, MlpIsa isa,
                 int64_t amx_min_rows) except +
        int threads()
        vector[int64_t] worker_tids()
        int64_t calls()
        MlpIsa last_isa()
