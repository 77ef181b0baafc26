// What the x86 builds of the GEMM (gemm_avx2.cpp, gemm_avx512.cpp) share: packing x with 8 x 8
// transposes. Included inside the level's anonymous namespace, after simd_x86.h.
#pragma once

constexpr bool kPackRows8 = true;

static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const uint16_t* p) {  // 8 bf16 -> fp32 (exact)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// dst[j * kP + i] = x[i * ld + j] for i, j < 8 (x fp32 or bf16).
template <typename T>
static inline void pack_rows8(const T* x, int64_t ld, float* dst, int32_t panel_rows) {
  __m256 r[8];
  for (int i = 0; i < 8; ++i) r[i] = load8(x + i * ld);
  transpose8x8(r);
  for (int j = 0; j < 8; ++j) _mm256_storeu_ps(dst + j * panel_rows, r[j]);
}
