// Which kernels have been opted in to more dynamic shared memory than CUDA's default 48 KiB,
// on which device. Plain C++ (no CUDA): the CUDA call itself is passed in, so the bookkeeping
// is testable on the host (tests/cpp/test_cuda_smem_opt_in.cpp); common.cuh's allow_smem
// passes cudaFuncSetAttribute(MaxDynamicSharedMemorySize).
//
// The opt-in is an attribute of one kernel function in one device's context, so it is
// remembered per (kernel address, device) -- not per kernel *type*: every attention kernel has
// the same type, void(*)(AttnArgs).
#pragma once

#include <map>
#include <mutex>
#include <utility>

namespace pyengine::kernels::cuda::detail {

// Dynamic shared memory any kernel may use without an opt-in.
constexpr int kDefaultDynamicSmemBytes = 48 * 1024;

class SmemOptInRegistry {
 public:
  // Calls set_max_dynamic_smem() (which sets the kernel's limit to `bytes` on `device`) unless
  // `bytes` fits the default or (kernel, device) already holds an opt-in of at least `bytes`.
  // Thread-safe; an exception from set_max_dynamic_smem propagates and records nothing.
  template <class SetMaxDynamicSmem>
  void ensure(const void* kernel, int device, int bytes, SetMaxDynamicSmem&& set_max_dynamic_smem) {
    if (bytes <= kDefaultDynamicSmemBytes) return;
    const std::pair<const void*, int> key{kernel, device};
    // Held across the call: two threads launching the same new kernel must not both race
    // through a half-recorded state, and the call is rare (once per kernel and device).
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = granted_.find(key);
    if (it != granted_.end() && it->second >= bytes) return;
    set_max_dynamic_smem();
    granted_[key] = bytes;
  }

 private:
  std::mutex mutex_;
  std::map<std::pair<const void*, int>, int> granted_;  // (kernel, device) -> bytes opted in
};

}  // namespace pyengine::kernels::cuda::detail
