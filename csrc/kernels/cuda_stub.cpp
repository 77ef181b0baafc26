// The CUDA kernel entry points of a build without CUDA: each says so.
#include <stdexcept>

#include "pyengine/cuda_kernels.h"
#include "pyengine/cuda_quant.h"

namespace pyengine::kernels::cuda {

namespace {
[[noreturn]] void not_built() {
  throw std::runtime_error(
      "pyengine was built without its CUDA kernels (CMake found no nvcc, or PYENGINE_CUDA=OFF); "
      "reinstall with nvcc and the nvidia-cutlass headers available, or use device=\"cpu\"");
}
}  // namespace

bool cuda_kernels_built() { return false; }
const char* cuda_architectures() { return ""; }

void store_kv(const void*, const void*, int64_t, int64_t, DType, void*, void*, DType, float, float,
              const int32_t*, int32_t, int32_t, int32_t, int32_t, int32_t, void*) {
  not_built();
}

// (the workspace arithmetic, paged_attention_workspace_bytes and the rest, is
// kernels/cuda/attention_workspace.cpp, built in every build)

void paged_attention(void*, int64_t, const void*, int64_t, DType, const void*, const void*, DType,
                     float, float, const int32_t*, const int32_t*, const int32_t*, int32_t, int32_t,
                     int32_t, int32_t, int32_t, int32_t, int32_t, float, int32_t, float, int32_t,
                     int32_t, void*, size_t, int32_t, void*) {
  not_built();
}

void linear_quant(void*, int64_t, const void*, int64_t, DType, int32_t, const void*, QuantType, int32_t, int32_t,
                  const void*, int32_t, void*) {
  not_built();
}

void dequantize_rows(void*, int64_t, DType, const void*, QuantType, int32_t, int32_t, const int64_t*, int64_t, int32_t,
                     int32_t, void*) {
  not_built();
}

}  // namespace pyengine::kernels::cuda
