// The portable compute code of the linear kernels: sixteen partial sums per dot product,
// written so the compiler vectorizes them for the level it compiles for without reassociating
// (no -ffast-math needed). Included by linear_generic.cpp, and by the builds of other
// architectures' levels (linear_avx2.cpp on aarch64, linear_neon.cpp on x86-64), which are
// never dispatched to.
#ifndef PYENGINE_ISA_NS
#error "define PYENGINE_ISA_NS before including linear_generic_impl.h"
#endif

#include <cstdint>
#include <vector>

#include "linear_common.h"

namespace pyengine::kernels::cpu::PYENGINE_ISA_NS {

namespace {

template <typename W>
void rows_portable(const LinearArgs& a, int32_t n0, int32_t n1) {
  constexpr int32_t kSums = 16;
  static thread_local std::vector<float> wrow;
  wrow.assign(static_cast<size_t>(a.kp), 0.0f);
  for (int32_t n = n0; n < n1; ++n) {
    const W* w = static_cast<const W*>(a.w) + static_cast<int64_t>(n) * a.K;
    for (int32_t k = 0; k < a.K; ++k) {
      if constexpr (sizeof(W) == 2)
        wrow[k] = bf16_to_f32(w[k]);
      else
        wrow[k] = w[k];
    }
    for (int32_t m = 0; m < a.M; ++m) {
      const float* x = a.xf + m * a.kp;
      float acc[kSums] = {};
      for (int64_t k = 0; k < a.kp; k += kSums)
        for (int32_t j = 0; j < kSums; ++j) acc[j] += x[k + j] * wrow[k + j];
      for (int32_t s = kSums / 2; s > 0; s /= 2)
        for (int32_t j = 0; j < s; ++j) acc[j] += acc[j + s];
      linear_store(a, m, n, acc[0]);
    }
  }
}

}  // namespace

void linear_rows(const LinearArgs& a, int32_t n0, int32_t n1) {
  if (a.bf16)
    rows_portable<uint16_t>(a, n0, n1);
  else
    rows_portable<float>(a, n0, n1);
}

int32_t linear_x_group(bool) { return 0; }

}  // namespace pyengine::kernels::cpu::PYENGINE_ISA_NS
