// The device side of host_signal.h: a one-thread kernel that polls a mapped
// host flag (bounded by a timeout on the global timer), acknowledges the
// slot, and records a failure or a timeout in the ring's sticky error words.
#include <cuda_runtime.h>

#include <cstdint>

#include "pdflash/host_signal.h"

namespace pdflash {
namespace {

struct DeviceEnv {
  const volatile std::uint32_t* flag;
  __device__ std::uint32_t load() const { return *flag; }
  __device__ std::uint64_t now_ns() const {
    std::uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
  }
  // NOTE: each poll is a read across the link; a short sleep keeps them from
  // crowding the copies' traffic while adding at most this much latency.
  __device__ void pause() const { __nanosleep(200); }
};

__global__ void host_signal_wait_kernel(volatile std::uint32_t* words, int capacity, int slot,
                                        std::uint32_t seq, std::uint64_t timeout_ns) {
  DeviceEnv env{words + slot};
  WaitOutcome outcome = wait_signal(env, seq, timeout_ns);
  volatile std::uint32_t* acks = words + capacity;
  volatile std::uint32_t* err = words + 2 * capacity;
  if (outcome != WaitOutcome::kDone && err[0] == 0u) {
    err[1] = seq;
    __threadfence_system();
    err[0] = static_cast<std::uint32_t>(outcome);
  }
  __threadfence_system();
  acks[slot] = seq;
  __threadfence_system();
}

}  // namespace

cudaError_t launch_host_signal_wait(std::uint32_t* dev_words, int capacity, int slot,
                                    std::uint32_t seq, std::uint64_t timeout_ns,
                                    cudaStream_t stream) {
  host_signal_wait_kernel<<<1, 1, 0, stream>>>(dev_words, capacity, slot, seq, timeout_ns);
  return cudaGetLastError();
}

}  // namespace pdflash
