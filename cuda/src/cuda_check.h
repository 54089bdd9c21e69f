// Internal to the CUDA-built sources (not installed): a CUDA error as text,
// a check that throws, and a guard that restores the calling thread's device.
// Include only where PDFLASH_WITH_CUDA is set.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace pdflash {
namespace cuda_detail {

inline std::string cuda_text(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}

inline void check(cudaError_t e, const char* what) {
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
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
};

}  // namespace cuda_detail
}  // namespace pdflash
