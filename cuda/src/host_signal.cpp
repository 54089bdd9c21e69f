// HostSignalRing (host_signal.h): the ring's words, tickets, the host's
// release store, and the host stand-in of the device wait. The device wait
// itself is host_signal_wait.cu (CUDA builds only).
#include "pdflash/host_signal.h"

#include <chrono>
#include <cstring>
#include <stdexcept>
#include <thread>

#if defined(PDFLASH_WITH_CUDA) && PDFLASH_WITH_CUDA
#include <cuda_runtime.h>

#include "cuda_check.h"
#endif

namespace pdflash {

#if defined(PDFLASH_WITH_CUDA) && PDFLASH_WITH_CUDA
cudaError_t launch_host_signal_wait(std::uint32_t* dev_words, int capacity, int slot,
                                    std::uint32_t seq, std::uint64_t timeout_ns,
                                    cudaStream_t stream);
#endif

namespace {

#if defined(PDFLASH_WITH_CUDA) && PDFLASH_WITH_CUDA
using cuda_detail::check;
using cuda_detail::cuda_text;
using cuda_detail::DeviceGuard;
#endif

std::uint32_t load_acquire(const std::uint32_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void store_release(std::uint32_t* p, std::uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

std::uint64_t steady_ns() {
  return std::uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                           std::chrono::steady_clock::now().time_since_epoch())
                           .count());
}

struct HostEnv {
  const std::uint32_t* flag;
  std::uint32_t load() const { return load_acquire(flag); }
  std::uint64_t now_ns() const { return steady_ns(); }
  void pause() const { std::this_thread::yield(); }
};

// Free `words` as allocated: page-locked (synchronizes the device) or plain.
void free_words(std::uint32_t* words, bool mapped) {
  if (words == nullptr) return;
  if (mapped) {
#if defined(PDFLASH_WITH_CUDA) && PDFLASH_WITH_CUDA
    cudaFreeHost(words);
#endif
  } else {
    delete[] words;
  }
}

const char* outcome_name(WaitOutcome o) {
  switch (o) {
    case WaitOutcome::kDone:
      return "done";
    case WaitOutcome::kFailed:
      return "failed";
    case WaitOutcome::kTimedOut:
      return "timed out";
    default:
      return "none";
  }
}

}  // namespace

bool host_signal_has_cuda() {
#if defined(PDFLASH_WITH_CUDA) && PDFLASH_WITH_CUDA
  return true;
#else
  return false;
#endif
}

std::string host_signal_unavailable(int device) {
#if defined(PDFLASH_WITH_CUDA) && PDFLASH_WITH_CUDA
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return "no CUDA device (" + cuda_text(e) + ")";
  }
  if (device < 0 || device >= count)
    return "CUDA device " + std::to_string(device) + " out of range [0, " + std::to_string(count) +
           ")";
  int can_map = 0, unified = 0;
  if (cudaDeviceGetAttribute(&can_map, cudaDevAttrCanMapHostMemory, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&unified, cudaDevAttrUnifiedAddressing, device) != cudaSuccess) {
    cudaGetLastError();
    return "cannot read the device's attributes";
  }
  if (!can_map) return "the device cannot map host memory";
  if (!unified) return "the device has no unified addressing";
  return "";
#else
  (void)device;
  return "this build has no CUDA (pdflash was built without nvcc)";
#endif
}

HostSignalRing::HostSignalRing(int capacity, bool mapped, int device)
    : capacity_(capacity), mapped_(mapped), device_(device) {
  if (capacity < 1) throw std::invalid_argument("capacity must be >= 1");
  const std::size_t n = word_count();
  if (mapped) {
#if defined(PDFLASH_WITH_CUDA) && PDFLASH_WITH_CUDA
    std::string why = host_signal_unavailable(device);
    if (!why.empty()) throw std::runtime_error("mapped host signals unavailable: " + why);
    DeviceGuard guard(device);
    void* p = nullptr;
    check(cudaHostAlloc(&p, n * sizeof(std::uint32_t), cudaHostAllocMapped | cudaHostAllocPortable),
          "cudaHostAlloc");
    words_ = static_cast<std::uint32_t*>(p);
    void* d = nullptr;
    cudaError_t e = cudaHostGetDevicePointer(&d, p, 0);
    if (e != cudaSuccess) {
      cudaFreeHost(p);
      words_ = nullptr;
      check(e, "cudaHostGetDevicePointer");
    }
    dev_words_ = static_cast<std::uint32_t*>(d);
#else
    throw std::runtime_error("mapped host signals unavailable: " + host_signal_unavailable(device));
#endif
  } else {
    words_ = new std::uint32_t[n];
  }
  std::memset(words_, 0, n * sizeof(std::uint32_t));
  last_seq_.assign(std::size_t(capacity), 0u);
}

HostSignalRing::~HostSignalRing() {
  // NOTE: a still mapped ring frees its page-locked words here, which
  // synchronizes the device: owners unmap() first (class comment)
  free_words(words_, mapped_);
  words_ = nullptr;
}

void HostSignalRing::unmap() {
  const std::size_t n = word_count();
  std::uint32_t* plain = new std::uint32_t[n];
  std::uint32_t* old = nullptr;
  bool old_mapped = false;
  {
    std::lock_guard<std::mutex> lock(store_mu_);
    for (std::size_t i = 0; i < n; ++i) plain[i] = load_acquire(words_ + i);
    old = words_;
    old_mapped = mapped_;
    words_ = plain;
    dev_words_ = nullptr;
    mapped_ = false;
  }
  // outside the lock: a signal() waiting on it stores into the plain copy
  free_words(old, old_mapped);
}

void HostSignalRing::check_slot(int slot) const {
  if (slot < 0 || slot >= capacity_)
    throw std::out_of_range("slot " + std::to_string(slot) + " out of range [0, " +
                            std::to_string(capacity_) + ")");
}

SignalTicket HostSignalRing::acquire(std::uint64_t reuse_wait_ns) {
  std::lock_guard<std::mutex> lock(mu_);
  WaitOutcome err = error_code();
  if (err != WaitOutcome::kNone)
    throw std::runtime_error(std::string("a host job's stream wait ") + outcome_name(err) +
                             " (seq " + std::to_string(error_seq()) + "): the ring is unusable");
  const int slot = next_slot_;
  const std::uint32_t prev = last_seq_[std::size_t(slot)];
  if (prev != 0u) {
    const std::uint32_t* a = words_ + capacity_ + slot;
    const std::uint64_t t0 = steady_ns();
    while (load_acquire(a) != prev) {
      if (steady_ns() - t0 >= reuse_wait_ns)
        throw std::runtime_error("slot " + std::to_string(slot) + "'s previous wait (seq " +
                                 std::to_string(prev) +
                                 ") has not run: more host jobs in flight than the ring holds");
      std::this_thread::yield();
    }
  }
  SignalTicket t{slot, next_seq_};
  last_seq_[std::size_t(slot)] = next_seq_;
  next_seq_ = next_signal_seq(next_seq_);
  next_slot_ = (slot + 1) % capacity_;
  return t;
}

void HostSignalRing::signal(int slot, std::uint32_t seq, bool failed) {
  check_slot(slot);
  std::lock_guard<std::mutex> lock(store_mu_);
  store_release(words_ + slot, signal_value(seq, failed));
}

void HostSignalRing::enqueue_wait(int slot, std::uint32_t seq, std::uintptr_t stream,
                                  std::uint64_t timeout_ns) {
  check_slot(slot);
  if (!mapped_) throw std::runtime_error("enqueue_wait needs a mapped ring");
#if defined(PDFLASH_WITH_CUDA) && PDFLASH_WITH_CUDA
  DeviceGuard guard(device_);
  cudaError_t e = launch_host_signal_wait(dev_words_, capacity_, slot, seq, timeout_ns,
                                          reinterpret_cast<cudaStream_t>(stream));
  if (e != cudaSuccess) {
    // no wait will run for this ticket: acknowledge it here, so the slot is
    // not held forever
    store_release(words_ + capacity_ + slot, seq);
    check(e, "the host signal wait's launch");
  }
  ++launches_;
#else
  (void)seq;
  (void)stream;
  (void)timeout_ns;
  throw std::runtime_error("this build has no CUDA");
#endif
}

WaitOutcome HostSignalRing::wait_host(int slot, std::uint32_t seq, std::uint64_t timeout_ns) {
  check_slot(slot);
  HostEnv env{words_ + slot};
  WaitOutcome outcome = wait_signal(env, seq, timeout_ns);
  std::uint32_t* err = words_ + 2 * capacity_;
  if (outcome != WaitOutcome::kDone && load_acquire(err) == 0u) {
    store_release(err + 1, seq);
    store_release(err, static_cast<std::uint32_t>(outcome));
  }
  store_release(words_ + capacity_ + slot, seq);
  return outcome;
}

WaitOutcome HostSignalRing::error_code() const {
  return static_cast<WaitOutcome>(load_acquire(words_ + 2 * capacity_));
}

std::uint32_t HostSignalRing::error_seq() const { return load_acquire(words_ + 2 * capacity_ + 1); }

std::uint32_t HostSignalRing::flag(int slot) const {
  check_slot(slot);
  return load_acquire(words_ + slot);
}

std::uint32_t HostSignalRing::ack(int slot) const {
  check_slot(slot);
  return load_acquire(words_ + capacity_ + slot);
}

}  // namespace pdflash
