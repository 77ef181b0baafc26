// Internal interface between the linear kernels' front end (linear.cpp: checks, x in fp32,
// threads, ISA dispatch) and their compute code per instruction-set level (linear_<level>.cpp).
#pragma once

#include <cstdint>

#include "dtype_convert.h"

namespace pyengine::kernels::cpu {

// Column padding of the fp32 copy of x: a full step (32 columns) past K reads zeros.
constexpr int32_t kLinearPad = 32;

struct LinearArgs {
  void* y;          // [M, N], bf16 or fp32 (as the weight)
  const float* xf;  // [M, kp] fp32, zero-padded columns K..kp-1, laid out as x_group() says
  int64_t kp;
  const void* w;     // [N, K], bf16 or fp32
  const void* bias;  // [N] or null, as the weight
  bool bf16;         // weight, bias and y are bf16 (else fp32)
  int32_t M, N, K;
  // bf16 weights: x as given ([M, K] bf16, not padded), for the levels that multiply bf16 pairs
  // directly (linear_avx512 with AVX512-BF16); null for fp32 weights.
  const uint16_t* xb = nullptr;
};

// Rounds `acc` (+ bias) to y's dtype into y[m, n].
static inline void linear_store(const LinearArgs& a, int32_t m, int32_t n, float acc) {
  const int64_t at = static_cast<int64_t>(m) * a.N + n;
  if (a.bf16) {
    if (a.bias != nullptr) acc += bf16_to_f32(static_cast<const uint16_t*>(a.bias)[n]);
    static_cast<uint16_t*>(a.y)[at] = f32_to_bf16(acc);
  } else {
    if (a.bias != nullptr) acc += static_cast<const float*>(a.bias)[n];
    static_cast<float*>(a.y)[at] = acc;
  }
}

// Each level: linear_rows computes the weight rows [n0, n1) for all rows of x;
// linear_x_group says how xf is laid out: 0 = as x; g > 0 = within each g columns, the g/2
// even ones first, then the g/2 odd ones (what a bf16 pair load splits into, see linear_avx512).
#define PYENGINE_LINEAR_ENTRY_POINTS                               \
  void linear_rows(const LinearArgs& a, int32_t n0, int32_t n1);   \
  int32_t linear_x_group(bool bf16);

namespace isa_generic { PYENGINE_LINEAR_ENTRY_POINTS }
namespace isa_avx2 { PYENGINE_LINEAR_ENTRY_POINTS }
namespace isa_avx512 { PYENGINE_LINEAR_ENTRY_POINTS }
namespace isa_neon { PYENGINE_LINEAR_ENTRY_POINTS }

#undef PYENGINE_LINEAR_ENTRY_POINTS

}  // namespace pyengine::kernels::cpu
