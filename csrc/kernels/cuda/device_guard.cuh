// Every CUDA entry point runs on the device its caller names (the device of its tensors and
// stream), not on whatever device happens to be current on the calling thread.
//
// Why: pyengine links its own, static, CUDA runtime beside torch's; torch makes a device
// current only around its own operations, so on entry the current device may be another one
// than the tensors' (device="cuda:1" with torch's current device 0). A kernel launched there
// would go to the wrong device's context, with a stream of another device.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <string>

#include "common.cuh"
#include "compute_capability.h"

namespace pyengine::kernels::cuda::detail {

// Throws std::runtime_error naming the device and its compute capability unless `device` can
// run the kernels; a supported device is remembered, so later calls cost one atomic load.
inline void require_supported_device(int device) {
  static std::atomic<bool> supported[64];  // zero (false) at start: static storage
  const bool cacheable = device >= 0 && device < 64;
  if (cacheable && supported[device].load(std::memory_order_relaxed)) return;
  int major = 0, minor = 0;
  check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
             "cudaDeviceGetAttribute(ComputeCapabilityMajor)");
  check_cuda(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device),
             "cudaDeviceGetAttribute(ComputeCapabilityMinor)");
  if (!compute_capability_supported(major, minor)) {
    cudaDeviceProp prop{};
    const std::string name =
        cudaGetDeviceProperties(&prop, device) == cudaSuccess ? prop.name : "unknown GPU";
    throw std::runtime_error(compute_capability_error(device, name, major, minor));
  }
  if (cacheable) supported[device].store(true, std::memory_order_relaxed);
}

// Makes `device` current for the scope of an entry point (after checking it can run the
// kernels) and restores the previously current device on exit. Same device: no call at all
// beyond cudaGetDevice. Validate host arguments before constructing one: it is the first CUDA
// call of an entry point.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : device_(device) {
    if (device < 0) fail("device: must be >= 0, got " + std::to_string(device));
    check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device_) {
      check_cuda(cudaSetDevice(device_), ("cudaSetDevice(" + std::to_string(device_) + ")").c_str());
    }
    try {
      require_supported_device(device_);
    } catch (...) {
      restore();
      throw;
    }
  }
  ~DeviceGuard() { restore(); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  void restore() noexcept {
    if (previous_ != device_) (void)cudaSetDevice(previous_);
    previous_ = device_;  // once
  }
  int device_;
  int previous_ = -1;
};

}  // namespace pyengine::kernels::cuda::detail
