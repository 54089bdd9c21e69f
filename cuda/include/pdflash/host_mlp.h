// A MoE expert's MLP on the host CPU for the few rows a missed expert gets
// (1-16 typically): memory-bound, so each weight byte is read once per call
// whatever the row count, the rows stay in registers/L1, fp32 accumulation.
//
// Knows nothing of torch: raw pointers, shapes, row strides, dtype tags. The
// Python side (pdflash/hybrid/native.py) packs the weights into the layout
// below once and passes tensors' data pointers; its reference
// (pdflash/_reference/hostmlp.py) computes the same function.
//
// Math (act):
//   kSwigluSilu   (Qwen3-MoE, Mixtral, ...): g = silu(x W_gate^T) * (x W_up^T)
//   kGptOssClamp  (gpt-oss): gate = min(x W_gate^T + b_gate, limit),
//                 up = clamp(x W_up^T + b_up, -limit, limit),
//                 g = (up + 1) * gate * sigmoid(alpha * gate)
//   out = g W_down^T (+ b_down)
// g is rounded to bf16 (round to nearest even) before the second product,
// as a bf16 model's own path rounds it; everything else stays fp32 until the
// output is written (fp32 or bf16, rounded to nearest even).
//
// Packed weights (bf16 as uint16, all zero-padded; "pairs" are 2 consecutive
// elements along the reduction dimension, as _mm512_dpbf16_ps consumes them):
//   W1: inter_pad = round_up(I, 32) intermediate indices in tiles of 16;
//       tile t, pair p (p < hidden_pairs = round_up(ceil(H / 2), 16)),
//       column c (< 32), j (< 2) at
//       ((t * hidden_pairs + p) * 32 + c) * 2 + j  =  W_gate[16 t + c][2 p + j]
//       for c < 16, W_up[16 t + c - 16][2 p + j] for c >= 16.
//   W2: tiles of 32 output columns (ceil(H / 32) tiles); tile t, pair p
//       (p < inter_pad / 2), column c, j at
//       ((t * inter_pairs + p) * 32 + c) * 2 + j  =  W_down[32 t + c][2 p + j].
//   b1: fp32 [2 * inter_pad]: gate biases then up biases (or null);
//   b2: fp32 [H] (or null).
// Pairs per tile are a multiple of 16 (one AMX K step each), zero-padded.
// One tile's weights are contiguous, so a thread's share (a run of tiles) is
// one sequential stream, and a W1 tile holds a gate column and its up column
// side by side: the activation runs on the accumulators before g is stored.
//
// MXFP4 weights (MlpShape::weights == kMxfp4; gpt-oss's released experts):
// the same tiles, pairs and columns, each weight an e2m1 code with one e8m0
// scale per column per 16 pairs (the 32 values along the reduction
// dimension that share an MXFP4 block scale), a quarter of the bytes:
//   q1 / q2: per tile, per pair, 32 bytes; byte b holds the code of element
//       b of the bf16 layout's pair row (its 64 elements 2 c + j) in its low
//       nibble and the code of element b + 32 in its high nibble;
//   s1 / s2: per tile, per group of 16 pairs, 32 bytes: column c's scale.
//   Element value = e2m1(code) * 2^(scale - 127). Codes are dequantized to
//   the bf16 layout right before the products (in registers, per AMX step,
//   or in blocks of 128 pairs in L1), so the bf16 products run unchanged
//   and the results are bit-identical to the bf16 kernel's on the
//   dequantized weights. The
//   value is made by adding scale - 127 to the e2m1 value's bf16 exponent:
//   exact for scales in [2, 252] (every bf16 result normal), which the
//   packer (pdflash/hybrid/native.py) checks; padding codes are 0.
//
// FP8 weights (kFp8; the store's --expert-dtype fp8: e4m3fn with one fp32
// scale per output channel): q1 / q2 hold each weight's e4m3 byte in the
// bf16 layout's place (one byte per element, half the bf16 bytes); c1 / c2:
// per tile, the fp32 scales of its 32 columns (W1: gate's 16, then up's).
// The codes are decoded exactly to bf16 (every e4m3 value is a bf16 value)
// before the same products, and a column's scale multiplies its fp32
// accumulator before the bias (as the fused GPU kernel applies them); NaN
// codes are refused by the packer, padding codes are 0 and pad scales 1.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace pdflash {

enum class MlpAct : int32_t { kSwigluSilu = 0, kGptOssClamp = 1 };
// kAmxBf16: AMX tiles for row chunks of >= amx_min_rows rows, AVX-512 BF16
// for smaller ones (and every epilogue); kAuto: the best this CPU offers.
enum class MlpIsa : int32_t { kAuto = 0, kScalar = 1, kAvx512Bf16 = 2, kAmxBf16 = 3 };
enum class FloatType : int32_t { kF32 = 0, kBF16 = 1 };
enum class WeightFormat : int32_t { kBf16 = 0, kMxfp4 = 1, kFp8 = 2 };

struct MlpShape {
  int64_t hidden = 0;  // H: the width of x and out
  int64_t inter = 0;   // I: the expert's intermediate size
  int32_t act = 0;     // MlpAct
  float alpha = 0.f;   // gpt-oss only
  float limit = 0.f;   // gpt-oss only
  int32_t weights = 0;  // WeightFormat
};

// One expert of a batch: its packed weights (w1 / w2 for kBf16; q1, s1,
// q2, s2 for kMxfp4; q1, c1, q2, c2 for kFp8) and the rows it computes.
struct MlpExpert {
  const uint16_t* w1 = nullptr;
  const float* b1 = nullptr;
  const uint16_t* w2 = nullptr;
  const float* b2 = nullptr;
  const uint8_t* q1 = nullptr;
  const uint8_t* s1 = nullptr;
  const uint8_t* q2 = nullptr;
  const uint8_t* s2 = nullptr;
  const float* c1 = nullptr;
  const float* c2 = nullptr;
  int64_t row_begin = 0;
  int64_t row_end = 0;
};

// Packed sizes (elements of uint16) and derived dimensions.
int64_t mlp_inter_pad(int64_t inter);        // round_up(I, 32)
int64_t mlp_hidden_pairs(int64_t hidden);    // round_up(ceil(H / 2), 16)
int64_t mlp_w1_elems(int64_t hidden, int64_t inter);
int64_t mlp_w2_elems(int64_t hidden, int64_t inter);
// MXFP4 bytes of a packed matrix of `elems` bf16 elements: codes (elems / 2)
// and scales (elems / 32).
int64_t mlp_mxfp4_code_bytes(int64_t elems);
int64_t mlp_mxfp4_scale_bytes(int64_t elems);
// Tiles of a packed W1 (16 intermediate indices each) and W2 (32 output
// columns each): FP8's column scales are 32 floats a tile.
int64_t mlp_w1_tiles(int64_t inter);
int64_t mlp_w2_tiles(int64_t hidden);

// Whether this CPU (and OS) runs the AVX-512 BF16 kernel.
bool cpu_has_avx512_bf16();
// Whether it also runs the AMX BF16 one (CPU, OS tile state, and on Linux
// the process's permission, which the first call requests).
bool cpu_has_amx_bf16();

// A persistent team of `threads - 1` worker threads plus the calling thread.
// run() has the team claim each phase's tiles (every expert's W1 tiles, then
// every expert's W2 tiles) one at a time from a shared counter; phase 2
// starts once every W1 tile is done. A call ends when its work is done:
// workers join it while it is open and take what is left, so a worker that
// wakes late takes less, or nothing, and never delays the call. Workers
// spin `spin_us` after a call (back-to-back calls skip a wake-up), then park
// (Linux: a futex on the call counter; elsewhere a condition variable).
// Calls from several threads are serialised (one team).
class HostMlpRunner {
 public:
  HostMlpRunner(int threads, int spin_us);
  ~HostMlpRunner();
  HostMlpRunner(const HostMlpRunner&) = delete;
  HostMlpRunner& operator=(const HostMlpRunner&) = delete;

  // out[r] = MLP(x[r]) for every expert's rows [row_begin, row_end).
  // x / out: `rows` rows of `hidden` elements, row strides in elements.
  // isa kAuto picks AVX-512 BF16 where the CPU has it, else scalar.
  // Throws std::invalid_argument on bad arguments (before any work starts).
  void run(const MlpShape& shape, const MlpExpert* experts, int64_t n_experts, const void* x,
           FloatType x_type, int64_t x_stride, void* out, FloatType out_type,
           int64_t out_stride, int64_t rows, MlpIsa isa, int64_t amx_min_rows = 1);

  int threads() const;
  // The workers' kernel thread ids (Linux: one per worker, set before the
  // constructor returns; elsewhere empty), for placing them on cores.
  std::vector<int64_t> worker_tids() const;
  // Calls served, and the ISA the last call ran (kAuto before any call).
  int64_t calls() const;
  MlpIsa last_isa() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace pdflash
