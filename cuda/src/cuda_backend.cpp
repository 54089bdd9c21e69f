// CUDA backend: ONE non-blocking copy stream per issuer; each chunk is
// bracketed by two timing events in its window slot, so completion is a
// cudaEventQuery and link busy time is the events' elapsed time.
//
// Built only when PDFLASH_WITH_CUDA; otherwise the factory throws and
// cuda_device_count() is 0. Plain C++ against the CUDA runtime (no kernels),
// linked with cudart_static.
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "pdflash/copy_backend.h"

#if defined(PDFLASH_WITH_CUDA) && PDFLASH_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace pdflash {

#if defined(PDFLASH_WITH_CUDA) && PDFLASH_WITH_CUDA

namespace {

std::string cuda_text(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear a non-sticky error so later calls work
    throw std::runtime_error(std::string(what) + " failed: " + cuda_text(e));
  }
}

// Restores the calling thread's current device (shared with torch through the
// driver's context stack).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&prev_) != cudaSuccess) prev_ = -1;
    if (prev_ != device) check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() {
    int cur = -1;
    if (prev_ >= 0 && cudaGetDevice(&cur) == cudaSuccess && cur != prev_) cudaSetDevice(prev_);
  }

 private:
  int prev_ = -1;
};

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
    start_.resize(std::size_t(max_slots), nullptr);
    end_.resize(std::size_t(max_slots), nullptr);
    for (int i = 0; i < max_slots; ++i) {
      cudaError_t e1 = cudaEventCreate(&start_[std::size_t(i)]);
      cudaError_t e2 = cudaEventCreate(&end_[std::size_t(i)]);
      if (e1 != cudaSuccess || e2 != cudaSuccess) {
        release();
        check(e1 != cudaSuccess ? e1 : e2, "cudaEventCreate");
      }
    }
  }
  ~CudaBackend() override { close(); }

  const char* name() const override { return "cuda"; }

  bool enqueue(int slot, void* dst, const void* src, std::size_t n, std::string* err) override {
    bind_thread();
    cudaError_t e = cudaEventRecord(start_[std::size_t(slot)], stream_);
    if (e == cudaSuccess) e = cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, stream_);
    if (e == cudaSuccess) e = cudaEventRecord(end_[std::size_t(slot)], stream_);
    if (e != cudaSuccess) {
      cudaGetLastError();
      *err = cuda_text(e);
      return false;
    }
    return true;
  }

  bool query(int slot, ChunkResult* out) override {
    cudaError_t e = cudaEventQuery(end_[std::size_t(slot)]);
    if (e == cudaErrorNotReady) return false;
    if (e != cudaSuccess) {
      cudaGetLastError();
      out->ok = false;
      out->error = cuda_text(e);
      out->busy_s = 0.0;
      return true;
    }
    float ms = 0.0f;
    if (cudaEventElapsedTime(&ms, start_[std::size_t(slot)], end_[std::size_t(slot)]) !=
        cudaSuccess) {
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
    cudaEvent_t ev = end_[std::size_t(slot)];
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
                                        end_[std::size_t(slot)], 0);
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

  int device_;
  cudaStream_t stream_ = nullptr;
  std::vector<cudaEvent_t> start_, end_;
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
