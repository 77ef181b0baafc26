// The AVX2 + FMA build of the GEMM; dispatched to only on CPUs that have it. Micro-kernel: 2
// vectors of 8 rows by 6 weight rows, 12 accumulators (of 16 registers).
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "dtype_convert.h"
#include "gemm_common.h"
#include "isa_target.h"

#if !PYENGINE_ISA_X86
namespace pyengine::kernels::cpu::isa_avx2 {
namespace {
#include "gemm_portable.h"
#include "gemm_impl.h"
}  // namespace pyengine::kernels::cpu::isa_avx2
#else
#include <immintrin.h>

PYENGINE_ISA_BEGIN_AVX2
namespace pyengine::kernels::cpu::isa_avx2 {
namespace {

#include "simd_x86.h"
#include "gemm_x86.h"

struct Vec {
  static constexpr int L = 8;
  using reg = __m256;
  static inline reg zero() { return _mm256_setzero_ps(); }
  static inline reg load(const float* p) { return _mm256_loadu_ps(p); }
  static inline void store(float* p, reg v) { _mm256_storeu_ps(p, v); }
  static inline reg bcast(float f) { return _mm256_set1_ps(f); }
  static inline reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
};

constexpr int kMV = 2;
constexpr int kNB = 6;

#include "gemm_impl.h"
}  // namespace pyengine::kernels::cpu::isa_avx2
PYENGINE_ISA_END
#endif
