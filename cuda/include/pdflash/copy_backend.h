// The copy engine behind the issuer: one FIFO copy stream, chunks identified
// by a window slot. Two implementations: CUDA (cudaMemcpyAsync on one
// non-blocking stream, events per slot) and host (memcpy on an engine thread,
// optionally throttled to an emulated link bandwidth).
//
// Every method except wake() and the allocation helpers is called by the
// issuer's worker thread or under the issuer's lock; implementations need no
// locking of their own beyond what their own threads require.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace pdflash {

// Outcome of one chunk copy.
struct ChunkResult {
  bool ok = true;
  std::string error;      // backend error text when !ok
  double busy_s = 0.0;    // time the link spent on this chunk
};

class CopyBackend {
 public:
  virtual ~CopyBackend() = default;

  virtual const char* name() const = 0;

  // Enqueue one chunk on the copy stream, after everything already enqueued.
  // `slot` (< max_slots) names it until reaped. Returns false and fills *err
  // when the enqueue itself failed (then nothing is in flight for the slot).
  virtual bool enqueue(int slot, void* dst, const void* src, std::size_t n,
                       std::string* err) = 0;

  // Non-blocking: true (and *out filled) once the chunk in `slot` finished.
  virtual bool query(int slot, ChunkResult* out) = 0;

  // Block until the chunk in `slot` may have finished, interrupted() is true
  // or `deadline` (steady_clock; time_point::max() for none) has passed.
  // Spurious returns are allowed; the caller re-queries.
  virtual void wait_progress(int slot, std::chrono::steady_clock::time_point deadline,
                             const std::function<bool()>& interrupted) = 0;

  // Wake a thread blocked in wait_progress so it re-evaluates interrupted().
  virtual void wake() = 0;

  // Make `stream` (a raw cudaStream_t) wait for the chunk in `slot` without
  // a host sync. Host backend: never called (the issuer waits on the host).
  virtual bool stream_wait_slot(int slot, std::uintptr_t stream, std::string* err) = 0;

  // Wait for every enqueued chunk, then free the stream, events and threads.
  // Idempotent; afterwards only wake() and close() may be called.
  virtual void close() = 0;

  // CUDA: refuses pageable memory. Host: accepts everything.
  virtual bool source_is_pinned(const void* p, std::string* err) = 0;
  // CUDA: refuses anything but device memory (copies are host-to-device).
  // Host: accepts everything.
  virtual bool destination_is_device(void* p, std::string* err) = 0;

  virtual bool supports_stream_wait() const = 0;

  // Test hooks (host backend only; CUDA returns false).
  virtual bool set_hold(bool hold) { (void)hold; return false; }
  virtual bool inject_failures(int count, const std::string& text) {
    (void)count; (void)text; return false;
  }
};

// Emulated link in GB/s (1e9 bytes/s); <= 0 copies at memcpy speed.
std::unique_ptr<CopyBackend> make_host_backend(int max_slots, double emulated_link_gbps);

// Throws std::runtime_error when built without CUDA or the device is unusable.
std::unique_ptr<CopyBackend> make_cuda_backend(int max_slots, int device);

// Number of CUDA devices usable by the CUDA backend; 0 without CUDA.
int cuda_device_count();

// True when this build contains the CUDA backend.
bool built_with_cuda();

// Pinned host memory. CUDA backend: cudaHostAlloc / cudaHostRegister on the
// given device; host backend: 4 KiB-aligned malloc / a no-op registration.
// Throw std::runtime_error with the CUDA error text on failure.
void* alloc_pinned(bool cuda, int device, std::size_t n);
void free_pinned(bool cuda, int device, void* p) noexcept;
void register_host(bool cuda, int device, void* p, std::size_t n);
void unregister_host(bool cuda, int device, void* p) noexcept;

// Live native objects, for leak tests: issuers, threads, pinned allocations,
// registrations.
struct LiveCounts {
  std::int64_t issuers;
  std::int64_t threads;
  std::int64_t pinned_allocations;
  std::int64_t registrations;
};
LiveCounts live_counts();

namespace detail {
void count_thread(int delta);
void count_issuer(int delta);
}  // namespace detail

}  // namespace pdflash
