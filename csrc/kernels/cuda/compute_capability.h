// The GPUs pyengine's CUDA kernels run on: compute capability 8.0 or newer (they use cp.async
// and the SM80 tensor-core MMA instructions). Plain C++ so the rule is testable on the host
// (tests/cpp/test_cuda_compute_capability.cpp); device_guard.cuh applies it.
#pragma once

#include <string>

namespace pyengine::kernels::cuda::detail {

constexpr int kMinComputeMajor = 8;
constexpr int kMinComputeMinor = 0;

inline bool compute_capability_supported(int major, int minor) {
  return major > kMinComputeMajor || (major == kMinComputeMajor && minor >= kMinComputeMinor);
}

// The error for a device that cannot run the kernels ("" when it can).
inline std::string compute_capability_error(int device, const std::string& name, int major,
                                            int minor) {
  if (compute_capability_supported(major, minor)) return "";
  return "pyengine CUDA kernels need a GPU of compute capability " +
         std::to_string(kMinComputeMajor) + "." + std::to_string(kMinComputeMinor) +
         " or newer (cp.async, SM80 tensor-core MMA); CUDA device " + std::to_string(device) +
         " (" + name + ") has compute capability " + std::to_string(major) + "." +
         std::to_string(minor);
}

}  // namespace pyengine::kernels::cuda::detail
