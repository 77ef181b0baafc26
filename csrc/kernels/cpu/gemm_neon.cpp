// The aarch64 Advanced SIMD build of the GEMM, dispatched to at level neon. Micro-kernel: 4
// vectors of 4 rows by 6 weight rows, 24 accumulators (of 32 registers), fused multiply-adds.
// Not tuned on aarch64 hardware (checked for correctness under qemu-aarch64 only). On x86-64
// this namespace holds the portable build, never dispatched to.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "dtype_convert.h"
#include "gemm_common.h"
#include "isa_target.h"

#if !PYENGINE_ISA_ARM
namespace pyengine::kernels::cpu::isa_neon {
namespace {
#include "gemm_portable.h"
#include "gemm_impl.h"
}  // namespace pyengine::kernels::cpu::isa_neon
#else
#include <arm_neon.h>

PYENGINE_ISA_BEGIN_NEON
namespace pyengine::kernels::cpu::isa_neon {
namespace {

struct Vec {
  static constexpr int L = 4;
  using reg = float32x4_t;
  static inline reg zero() { return vdupq_n_f32(0.0f); }
  static inline reg load(const float* p) { return vld1q_f32(p); }
  static inline void store(float* p, reg v) { vst1q_f32(p, v); }
  static inline reg bcast(float f) { return vdupq_n_f32(f); }
  static inline reg fma(reg a, reg b, reg c) { return vfmaq_f32(c, a, b); }
};

constexpr int kMV = 4;
constexpr int kNB = 6;
constexpr bool kPackRows8 = false;
template <typename T>
static inline void pack_rows8(const T*, int64_t, float*, int32_t) {}

#include "gemm_impl.h"
}  // namespace pyengine::kernels::cpu::isa_neon
PYENGINE_ISA_END_NEON
#endif
