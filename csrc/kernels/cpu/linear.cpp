// linear_bf16 / linear_f32: see pyengine/cpu_linear.h. The front end: argument checks, x
// converted to fp32 once (zero-padded to a multiple of 32 columns, laid out as the level's
// compute code wants) and shared by all threads, each thread taking a contiguous range of
// output columns (weight rows); the compute code is the active level's (linear_<level>.cpp).
#include "parallel.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "column_split.h"
#include "isa_target.h"
#include "linear_checks.h"
#include "linear_common.h"
#include "pyengine/cpu_linear.h"

namespace pyengine::kernels {

namespace {

using cpu::LinearArgs;
using RowsFn = void (*)(const LinearArgs&, int32_t, int32_t);

// Below this many weight elements a call runs on one thread (a fork/join costs more).
constexpr int64_t kMinParallelElems = 1 << 15;
// Output columns handed to a thread are a multiple of this (the weight-row tile).
constexpr int32_t kColumnGrain = 4;

// The active level's compute code (cpu_isa() throws here, before any thread starts, if
// PYENGINE_CPU_ISA is invalid).
void level_fns(RowsFn& rows, int32_t& group, bool bf16) {
  switch (cpu_isa()) {
    case CpuIsa::kAvx512:
      rows = cpu::isa_avx512::linear_rows, group = cpu::isa_avx512::linear_x_group(bf16);
      break;
    case CpuIsa::kAvx2:
      rows = cpu::isa_avx2::linear_rows, group = cpu::isa_avx2::linear_x_group(bf16);
      break;
    case CpuIsa::kNeon:
      rows = cpu::isa_neon::linear_rows, group = cpu::isa_neon::linear_x_group(bf16);
      break;
    default:
      rows = cpu::isa_generic::linear_rows, group = cpu::isa_generic::linear_x_group(bf16);
  }
}

// xf[m, :] = x[m, :] as fp32, zero-padded to kp columns; with group g > 0, each g columns hold
// their even columns first, then their odd ones.
template <typename X>
void prepare_x(std::vector<float>& xf, const X* x, int32_t M, int32_t K, int64_t kp, int32_t g) {
  xf.assign(static_cast<size_t>(M * kp), 0.0f);
  for (int32_t m = 0; m < M; ++m) {
    const X* src = x + static_cast<int64_t>(m) * K;
    float* dst = xf.data() + m * kp;
    for (int32_t k = 0; k < K; ++k) {
      float v;
      if constexpr (sizeof(X) == 2)
        v = cpu::bf16_to_f32(src[k]);
      else
        v = src[k];
      if (g == 0) {
        dst[k] = v;
      } else {
        const int32_t j = k % g;
        dst[k - j + (j % 2) * (g / 2) + j / 2] = v;
      }
    }
  }
}

template <typename T>
void linear(T* y, const T* x, const T* weight, const T* bias, int32_t M, int32_t N, int32_t K,
            int32_t num_threads) {
  cpu::check_linear_args(y, x, weight, M, kLinearMaxRows, N, K);
  constexpr bool bf16 = sizeof(T) == 2;
  RowsFn rows;
  int32_t group;
  level_fns(rows, group, bf16);
  // x -> fp32 once, zero-padded; reused across calls by the calling thread.
  static thread_local std::vector<float> xf;
  const int64_t kp = (static_cast<int64_t>(K) + cpu::kLinearPad - 1) / cpu::kLinearPad * cpu::kLinearPad;
  prepare_x(xf, x, M, K, kp, group);

  LinearArgs a{y, xf.data(), kp, weight, bias, bf16, M, N, K};
  if constexpr (bf16) a.xb = x;
  int nt = cpu::resolve_threads(num_threads);
  if (static_cast<int64_t>(N) * K < kMinParallelElems) nt = 1;
  cpu::split_columns(N, nt, kColumnGrain, int64_t{kColumnGrain} * K * static_cast<int64_t>(sizeof(T)), [&](int32_t n0, int32_t n1) { rows(a, n0, n1); });
}

}  // namespace

void linear_bf16(uint16_t* y, const uint16_t* x, const uint16_t* weight, const uint16_t* bias,
                 int32_t M, int32_t N, int32_t K, int32_t num_threads) {
  linear(y, x, weight, bias, M, N, K, num_threads);
}

void linear_f32(float* y, const float* x, const float* weight, const float* bias, int32_t M,
                int32_t N, int32_t K, int32_t num_threads) {
  linear(y, x, weight, bias, M, N, K, num_threads);
}

}  // namespace pyengine::kernels
