// CUDA backend: ONE non-blocking copy stream per issuer; each chunk is
// followed by a timing event, so completion is a cudaEventQuery and link busy
// time is an elapsed time between events: from the previous chunk's end event
// when the chunk was queued behind it, else from a start event recorded just
// before it (the stream was idle).
//
// Built only when PDFLASH_WITH_CUDA; otherwise the factory throws and
// cuda_device_count() is 0. Plain C++ against the CUDA runtime (no kernels),
// linked with cudart_static.
#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "pdflash/copy_backend.h"

#if defined(PDFLASH_WITH_CUDA) && PDFLASH_WITH_CUDA
#include <cuda_runtime.h>

#include "cuda_check.h"
#endif

namespace pdflash {

#if defined(PDFLASH_WITH_CUDA) && PDFLASH_WITH_CUDA

namespace {

using cuda_detail::check;
using cuda_detail::cuda_text;
using cuda_detail::DeviceGuard;

class CudaBackend final : public CopyBackend {
 public:
  CudaBackend(int max_slots, int device) : device_(device) {
    int count = 0;
    check(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
    if (device < 0 || device >= count)
      throw std::invalid_argument("CUDA device " + std::to_string(device) + " out of range [0, " +
                                  std::to_string(count) + ")");
    DeviceGuard guard(device);
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    // NOTE: end events live in a ring of 2 x max_slots indexed by chunk
    // number, not by slot: a chunk's busy time reads its predecessor's end
    // event, which must not be re-recorded before then. At most max_slots
    // chunks are in flight, so chunk j + 2 max_slots - 1 (the next user of
    // chunk j - 1's event) is enqueued only after chunk j was reaped.
    start_.resize(std::size_t(max_slots), nullptr);
    end_.resize(2 * std::size_t(max_slots), nullptr);
    chunk_of_slot_.assign(std::size_t(max_slots), 0);
    chained_.assign(std::size_t(max_slots), 0);
    auto create = [&](cudaEvent_t* ev) {
      cudaError_t e = cudaEventCreate(ev);
      if (e != cudaSuccess) {
        release();
        check(e, "cudaEventCreate");
      }
    };
    for (auto& ev : start_) create(&ev);
    for (auto& ev : end_) create(&ev);
  }
  ~CudaBackend() override { close(); }

  const char* name() const override { return "cuda"; }

  bool enqueue(int slot, void* dst, const void* src, std::size_t n, std::string* err) override {
    bind_thread();
    // NOTE: one event per chunk instead of a start/end pair: every event
    // recorded between two copies on the stream is GPU-side work at a chunk
    // boundary, where the link idles (issue 4). A chunk queued behind a
    // running one starts when that one ends, so its predecessor's end event
    // is its start. (If the predecessor ends between this query and the
    // enqueue, the few microseconds in between count as busy.)
    bool chained = unreaped_ > 0 && cudaEventQuery(end_event(next_chunk_ - 1)) == cudaErrorNotReady;
    cudaError_t e = cudaSuccess;
    if (!chained) e = cudaEventRecord(start_[std::size_t(slot)], stream_);
    if (e == cudaSuccess) e = cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, stream_);
    if (e == cudaSuccess) e = cudaEventRecord(end_event(next_chunk_), stream_);
    if (e != cudaSuccess) {
      cudaGetLastError();
      *err = cuda_text(e);
      return false;
    }
    chunk_of_slot_[std::size_t(slot)] = next_chunk_++;
    chained_[std::size_t(slot)] = chained ? 1 : 0;
    ++unreaped_;
    return true;
  }

  bool query(int slot, ChunkResult* out) override {
    std::uint64_t chunk = chunk_of_slot_[std::size_t(slot)];
    cudaError_t e = cudaEventQuery(end_event(chunk));
    if (e == cudaErrorNotReady) return false;
    --unreaped_;
    if (e != cudaSuccess) {
      cudaGetLastError();
      out->ok = false;
      out->error = cuda_text(e);
      out->busy_s = 0.0;
      return true;
    }
    float ms = 0.0f;
    cudaEvent_t from = chained_[std::size_t(slot)] ? end_event(chunk - 1) : start_[std::size_t(slot)];
    if (cudaEventElapsedTime(&ms, from, end_event(chunk)) != cudaSuccess) {
      cudaGetLastError();
      ms = 0.0f;
    }
    out->ok = true;
    out->error.clear();
    out->busy_s = double(ms) * 1e-3;
    return true;
  }

  void wait_progress(int slot, std::chrono::steady_clock::time_point deadline,
                     const std::function<bool()>& interrupted) override {
    // NOTE: spin (yielding) on the oldest chunk's event, without the issuer's
    // lock: a 4 MiB chunk lasts ~76 us at 55 GB/s, and the next one must be
    // issued before the copy engine runs dry. A blocking-sync event or a host callback in the stream
    // adds tens of microseconds per chunk (cudaLaunchHostFunc also stalls the
    // stream until the callback has run).
    cudaEvent_t ev = end_event(chunk_of_slot_[std::size_t(slot)]);
    bool timed = deadline != std::chrono::steady_clock::time_point::max();
    while (cudaEventQuery(ev) == cudaErrorNotReady) {
      if (interrupted()) return;
      if (timed && std::chrono::steady_clock::now() >= deadline) return;
      std::this_thread::yield();
    }
  }

  void wake() override {}

  bool stream_wait_slot(int slot, std::uintptr_t stream, std::string* err) override {
    cudaError_t e = cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(stream),
                                        end_event(chunk_of_slot_[std::size_t(slot)]), 0);
    if (e != cudaSuccess) {
      cudaGetLastError();
      *err = "cudaStreamWaitEvent failed: " + cuda_text(e);
      return false;
    }
    return true;
  }
  bool supports_stream_wait() const override { return true; }

  void close() override {
    if (stream_ == nullptr) return;
    cudaStreamSynchronize(stream_);
    release();
  }

  bool source_is_pinned(const void* p, std::string* err) override {
    cudaPointerAttributes attr{};
    cudaError_t e = cudaPointerGetAttributes(&attr, p);
    if (e != cudaSuccess) {
      cudaGetLastError();
      *err = "cudaPointerGetAttributes: " + cuda_text(e);
      return false;
    }
    if (attr.type == cudaMemoryTypeHost) return true;
    *err = attr.type == cudaMemoryTypeUnregistered ? "pageable memory"
           : attr.type == cudaMemoryTypeDevice     ? "device memory"
                                                   : "managed memory";
    return false;
  }

  bool destination_is_device(void* p, std::string* err) override {
    cudaPointerAttributes attr{};
    cudaError_t e = cudaPointerGetAttributes(&attr, p);
    if (e != cudaSuccess) {
      cudaGetLastError();
      *err = "cudaPointerGetAttributes: " + cuda_text(e);
      return false;
    }
    // NOTE: copies are cudaMemcpyHostToDevice; a host destination would be
    // undefined behaviour, so only device (or managed) memory qualifies.
    if (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged) return true;
    *err = attr.type == cudaMemoryTypeUnregistered ? "pageable host memory" : "pinned host memory";
    return false;
  }

 private:
  void bind_thread() {
    // The worker thread issues every chunk; bind it to our device once.
    thread_local int bound = -1;
    if (bound != device_) {
      if (cudaSetDevice(device_) == cudaSuccess) bound = device_;
    }
  }
  void release() {
    for (auto& e : start_)
      if (e) cudaEventDestroy(e), e = nullptr;
    for (auto& e : end_)
      if (e) cudaEventDestroy(e), e = nullptr;
    if (stream_) cudaStreamDestroy(stream_);
    stream_ = nullptr;
  }

  cudaEvent_t end_event(std::uint64_t chunk) const { return end_[chunk % end_.size()]; }

  int device_;
  cudaStream_t stream_ = nullptr;
  std::vector<cudaEvent_t> start_;  // per slot, recorded only when not chained
  std::vector<cudaEvent_t> end_;    // ring by chunk number (see the constructor)
  std::vector<std::uint64_t> chunk_of_slot_;
  std::vector<std::uint8_t> chained_;
  std::uint64_t next_chunk_ = 1;  // chunk numbers start at 1 (0: none yet)
  std::int64_t unreaped_ = 0;     // enqueued chunks whose completion query() has not reported
};

}  // namespace

std::unique_ptr<CopyBackend> make_cuda_backend(int max_slots, int device) {
  return std::unique_ptr<CopyBackend>(new CudaBackend(max_slots, device));
}

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

bool built_with_cuda() { return true; }

namespace detail {
void* cuda_alloc_pinned(int device, std::size_t n) {
  DeviceGuard guard(device);
  void* p = nullptr;
  // Portable: usable from every device's context, whoever allocated it.
  check(cudaHostAlloc(&p, n, cudaHostAllocPortable), "cudaHostAlloc");
  return p;
}
void cuda_free_pinned(void* p) noexcept { cudaFreeHost(p); }
void cuda_register_host(void* p, std::size_t n) {
  check(cudaHostRegister(p, n, cudaHostRegisterPortable), "cudaHostRegister");
}
void cuda_unregister_host(void* p) noexcept { cudaHostUnregister(p); }
}  // namespace detail

#else  // !PDFLASH_WITH_CUDA

std::unique_ptr<CopyBackend> make_cuda_backend(int, int) {
  throw std::runtime_error("pdflash was built without CUDA (PDFLASH_CUDA=OFF or no nvcc)");
}
int cuda_device_count() { return 0; }
bool built_with_cuda() { return false; }

namespace detail {
void* cuda_alloc_pinned(int, std::size_t) {
  throw std::runtime_error("pdflash was built without CUDA");
}
void cuda_free_pinned(void*) noexcept {}
void cuda_register_host(void*, std::size_t) {
  throw std::runtime_error("pdflash was built without CUDA");
}
void cuda_unregister_host(void*) noexcept {}
}  // namespace detail

#endif

}  // namespace pdflash
