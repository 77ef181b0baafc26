// The AVX-512 build of the GEMM; dispatched to only on CPUs that have it. Micro-kernel: 2
// vectors of 16 rows by 12 weight rows, 24 accumulators (of 32 registers).
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "dtype_convert.h"
#include "gemm_common.h"
#include "isa_target.h"

#if !PYENGINE_ISA_X86
namespace pyengine::kernels::cpu::isa_avx512 {
namespace {
#include "gemm_portable.h"
#include "gemm_impl.h"
}  // namespace pyengine::kernels::cpu::isa_avx512
#else
#include <immintrin.h>

PYENGINE_ISA_BEGIN_AVX512
namespace pyengine::kernels::cpu::isa_avx512 {
namespace {

#include "simd_x86.h"
#include "gemm_x86.h"

struct Vec {
  static constexpr int L = 16;
  using reg = __m512;
  static inline reg zero() { return _mm512_setzero_ps(); }
  static inline reg load(const float* p) { return _mm512_loadu_ps(p); }
  static inline void store(float* p, reg v) { _mm512_storeu_ps(p, v); }
  static inline reg bcast(float f) { return _mm512_set1_ps(f); }
  static inline reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
};

constexpr int kMV = 2;
constexpr int kNB = 12;

#include "gemm_impl.h"
}  // namespace pyengine::kernels::cpu::isa_avx512
PYENGINE_ISA_END
#endif
