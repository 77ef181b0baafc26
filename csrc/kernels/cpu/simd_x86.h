// Small x86 SIMD helpers shared by the hand-written AVX2 and AVX-512 kernels (linear,
// quantized linear, attention). Each includes this inside its level's namespace, after
// PYENGINE_ISA_BEGIN_<LEVEL> and <immintrin.h>, so that the code compiles for that level with
// internal linkage; one level per translation unit.
#pragma once

// Software prefetch into L2 (the weight-streaming kernels prefetch a few KB ahead).
static inline void prefetch_l2(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

// The sum of the 8 lanes.
static inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

