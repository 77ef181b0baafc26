// The paged-attention compute back end, compiled once per instruction-set level (isa_target.h):
// attention_<level>.cpp defines PYENGINE_ISA_NS (isa_generic, isa_avx2, isa_avx512, isa_neon) and
// includes this header under that level's target; attention_avx512.cpp also defines
// PYENGINE_ATTN_AVX512, which adds hand-written AVX-512 block kernels, attention_avx2.cpp
// PYENGINE_ATTN_AVX2 (the same block kernel for rows of one query position, 8 lanes wide). The
// other levels are auto-vectorized from the portable loops below.
//
// Everything here has internal linkage (anonymous namespace / static) or lives in the level's
// namespace, so the builds of the same helpers can never be merged by the linker.
//
// The loops are written for gcc's auto-vectorizer: fixed 16-lane partial sums for the dot
// products (several keys at once, so the FMA chains are independent), contiguous axpy over
// head_dim for P.V, and a branch-free polynomial exp over score rows.
#ifndef PYENGINE_ISA_NS
#error "define PYENGINE_ISA_NS before including attention_impl.h"
#endif

#include "attention_deps.h"

namespace pyengine::kernels::cpu::PYENGINE_ISA_NS {
namespace {

constexpr int kLanes = 16;
#ifndef PYENGINE_PF_DIST
#define PYENGINE_PF_DIST 2
#endif
#ifndef PYENGINE_PF_LOC
#define PYENGINE_PF_LOC 3
#endif
constexpr int32_t kPrefetchBlocks = PYENGINE_PF_DIST;
constexpr float kNegInf = -__builtin_inff();

static inline int32_t imin(int32_t a, int32_t b) { return a < b ? a : b; }
static inline int32_t imax(int32_t a, int32_t b) { return a > b ? a : b; }

// e^x for x in [-87, 0] (e^-87 ~ 1.6e-38); relative error ~1e-7. Branch-free: round x/ln2 to n
// with the 1.5*2^23 trick, reduce, degree-7 polynomial, scale by 2^n through the exponent bits.
static inline float exp_neg_in_range(float x) {
  const float shifter = 12582912.0f;  // 1.5 * 2^23
  float n = x * 1.44269504088896341f + shifter;
  n = n - shifter;  // round(x / ln2), exact integer in [-126, 0]
  const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t ni = static_cast<int32_t>(n);
  const uint32_t scale_bits = static_cast<uint32_t>(ni + 127) << 23;
  return p * bits_f32(scale_bits);
}

// e^x for x <= 0 (clamped below at -87, where e^x ~ 1.6e-38).
static inline float exp_neg(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 0.0f ? 0.0f : x;
  return exp_neg_in_range(x);
}

// tanh(x), absolute error below 12 u + 6e-9 (u = 2^-24; measured: 1.5 u); NaN stays NaN.
//   |x| < 0.3:  the Taylor series x - x^3/3 + 2x^5/15 - ... up to x^11 (the next term is below
//               6e-10 there), where 1 - e^-2|x| would lose bits to cancellation;
//   otherwise:  (1 - e) / (1 + e) with e = e^-2|x| <= e^-0.6, the sign put back.
// Written so that loops over score rows vectorize at every level: gcc turns a select between
// the two forms (a ternary, or integer masks) into a branch, and a branch holding the division
// (which may trap) into a loop it will not vectorize. So both forms are computed for every x,
// their arguments clamped (as integers: non-negative floats order as their bits) to keep them
// finite, and blended arithmetically, big + (small - big) * w with w = 1 or 0: exact for w = 0,
// and for w = 1 within an ulp of `small` (exact where the two are within a factor of 2).
static inline float tanh_f(float x) {
  const uint32_t bits = f32_bits(x);
  const uint32_t sign = bits & 0x80000000u;
  const uint32_t mag = bits ^ sign;  // |x|
  auto umin = [](uint32_t a, uint32_t b) { return a < b ? a : b; };
  const float xs = bits_f32(umin(mag, f32_bits(0.3f)));  // min(|x|, 0.3)
  const float x2 = xs * xs;
  float p = -1382.0f / 155925.0f;
  p = p * x2 + 62.0f / 2835.0f;
  p = p * x2 + -17.0f / 315.0f;
  p = p * x2 + 2.0f / 15.0f;
  p = p * x2 + -1.0f / 3.0f;
  const float small = xs + xs * x2 * p;
  const float e = exp_neg_in_range(-2.0f * bits_f32(umin(mag, f32_bits(43.5f))));
  const float big = (1.0f - e) / (1.0f + e);
  // w = 1.0f where |x| < 0.3, else 0.0f, from the borrow of mag - bits(0.3) (mag < 2^31)
  const uint32_t below = (mag - f32_bits(0.3f)) >> 31;
  const float w = bits_f32((0u - below) & f32_bits(1.0f));
  const uint32_t t = f32_bits(big + (small - big) * w) | sign;
  const uint32_t is_nan = (f32_bits(__builtin_inff()) - mag) >> 31;  // 1 where mag > inf's bits
  return bits_f32((t & (is_nan - 1u)) | (bits & (0u - is_nan)));
}

// Logit soft-capping of the scores s[a..e): s = cap * tanh(s / cap) (Gemma 2; the division as
// Hugging Face's, not a multiply by 1 / cap, which would overflow for a tiny cap). Callers test
// cap > 0 once per row block, so the uncapped path is untouched.
static inline void softcap_row(float* __restrict s, int32_t a, int32_t e, float cap) {
  for (int32_t t = a; t < e; ++t) s[t] = cap * tanh_f(s[t] / cap);
}

// ---- row conversions ----

template <typename T>
static inline void row_to_f32(const T* __restrict src, float* __restrict dst, int32_t n) {
  for (int32_t i = 0; i < n; ++i) dst[i] = to_f32(src[i]);
}

#if defined(PYENGINE_ATTN_AVX2) || defined(PYENGINE_ATTN_AVX512)
// float16 rows with F16C, 8 values a conversion (exact, as fp16_to_f32; the scalar conversion
// does not vectorize).
static inline void row_to_f32(const fp16_t* __restrict src, float* __restrict dst, int32_t n) {
  int32_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  for (; i < n; ++i) dst[i] = to_f32(src[i]);
}
#endif

template <typename T>
static inline void row_to_f32_scaled(const T* __restrict src, float* __restrict dst, int32_t n,
                                     float s) {
  for (int32_t i = 0; i < n; ++i) dst[i] = to_f32(src[i]) * s;
}

static inline void load_row_scaled(const void* base, DType dt, int64_t elem_off,
                                   float* __restrict dst, int32_t n, float s) {
  switch (dt) {
    case DType::kFloat32:
      row_to_f32_scaled(static_cast<const float*>(base) + elem_off, dst, n, s);
      break;
    case DType::kBFloat16:
      row_to_f32_scaled(static_cast<const bf16_t*>(base) + elem_off, dst, n, s);
      break;
    case DType::kFloat16:
      row_to_f32_scaled(static_cast<const fp16_t*>(base) + elem_off, dst, n, s);
      break;
    case DType::kFloat8E4M3:  // CUDA-only; the entry points reject it before this
      break;
  }
}

template <typename T>
static inline void row_from_f32_scaled(const float* __restrict src, T* __restrict dst, int32_t n,
                                       float s) {
  for (int32_t i = 0; i < n; ++i) store_f32(dst + i, src[i] * s);
}

static inline void store_row_scaled(void* base, DType dt, int64_t elem_off,
                                    const float* __restrict src, int32_t n, float s) {
  switch (dt) {
    case DType::kFloat32:
      row_from_f32_scaled(src, static_cast<float*>(base) + elem_off, n, s);
      break;
    case DType::kBFloat16:
      row_from_f32_scaled(src, static_cast<bf16_t*>(base) + elem_off, n, s);
      break;
    case DType::kFloat16:
      row_from_f32_scaled(src, static_cast<fp16_t*>(base) + elem_off, n, s);
      break;
    case DType::kFloat8E4M3:  // CUDA-only; the entry points reject it before this
      break;
  }
}

// ---- math kernels ----

static inline float hsum16(const float* a) {
  float b[8];
  for (int i = 0; i < 8; ++i) b[i] = a[i] + a[i + 8];
  for (int i = 0; i < 4; ++i) b[i] = b[i] + b[i + 4];
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// s[t] = <q, k[t]> for t in [a, e); k rows are `d` floats apart.
static inline void scores_row(const float* __restrict q, const float* __restrict k,
                              float* __restrict s, int32_t a, int32_t e, int32_t d) {
  const int32_t dv = d / kLanes * kLanes;
  int32_t t = a;
  for (; t + 4 <= e; t += 4) {
    const float* k0 = k + static_cast<int64_t>(t) * d;
    const float* k1 = k0 + d;
    const float* k2 = k1 + d;
    const float* k3 = k2 + d;
    float acc0[kLanes] = {}, acc1[kLanes] = {}, acc2[kLanes] = {}, acc3[kLanes] = {};
    for (int32_t i = 0; i < dv; i += kLanes) {
      for (int l = 0; l < kLanes; ++l) {
        const float qv = q[i + l];
        acc0[l] += qv * k0[i + l];
        acc1[l] += qv * k1[i + l];
        acc2[l] += qv * k2[i + l];
        acc3[l] += qv * k3[i + l];
      }
    }
    float r0 = hsum16(acc0), r1 = hsum16(acc1), r2 = hsum16(acc2), r3 = hsum16(acc3);
    for (int32_t i = dv; i < d; ++i) {
      r0 += q[i] * k0[i];
      r1 += q[i] * k1[i];
      r2 += q[i] * k2[i];
      r3 += q[i] * k3[i];
    }
    s[t] = r0;
    s[t + 1] = r1;
    s[t + 2] = r2;
    s[t + 3] = r3;
  }
  for (; t < e; ++t) {
    const float* k0 = k + static_cast<int64_t>(t) * d;
    float acc0[kLanes] = {};
    for (int32_t i = 0; i < dv; i += kLanes)
      for (int l = 0; l < kLanes; ++l) acc0[l] += q[i + l] * k0[i + l];
    float r0 = hsum16(acc0);
    for (int32_t i = dv; i < d; ++i) r0 += q[i] * k0[i];
    s[t] = r0;
  }
}

static inline void scale_row(float* __restrict a, int32_t n, float s) {
  for (int32_t i = 0; i < n; ++i) a[i] *= s;
}

// acc += sum_t p[t] * v[t] for t in [a, e); v rows `d` floats apart.
static inline void pv_row(const float* __restrict p, const float* __restrict v,
                          float* __restrict acc, int32_t a, int32_t e, int32_t d) {
  int32_t t = a;
  for (; t + 2 <= e; t += 2) {
    const float p0 = p[t], p1 = p[t + 1];
    const float* v0 = v + static_cast<int64_t>(t) * d;
    const float* v1 = v0 + d;
    for (int32_t i = 0; i < d; ++i) acc[i] += p0 * v0[i] + p1 * v1[i];
  }
  for (; t < e; ++t) {
    const float p0 = p[t];
    const float* v0 = v + static_cast<int64_t>(t) * d;
    for (int32_t i = 0; i < d; ++i) acc[i] += p0 * v0[i];
  }
}

// Online softmax: a block whose probabilities (against the new running max m_new) sum to
// `bsum` joins a row whose state was (m_old, l, acc): rescale l and acc by
// exp(m_old - m_new) when the max grew, then add the block.
static inline void fold_block(float bsum, float m_old, float m_new, float& l, float& m, float* __restrict acc,
                              int32_t d) {
  if (m_new > m_old) {
    const float alpha = m_old == kNegInf ? 0.0f : exp_neg(m_old - m_new);
    l = l * alpha + bsum;
    if (alpha == 0.0f) {
      for (int32_t i = 0; i < d; ++i) acc[i] = 0.0f;
    } else {
      scale_row(acc, d, alpha);
    }
  } else {
    l += bsum;
  }
  m = m_new;
}

// Online-softmax update of one query row with the scores s[a..e): rescales acc/l, turns s
// into probabilities in place, and accumulates P.V.
static inline void softmax_pv_row(float* __restrict s, const float* __restrict v,
                                  float* __restrict acc, float* m, float* l, int32_t a,
                                  int32_t e, int32_t d) {
  float mx = s[a];
  for (int32_t t = a + 1; t < e; ++t) mx = s[t] > mx ? s[t] : mx;
  const float m_old = *m;
  const float m_new = mx > m_old ? mx : m_old;
  float sum = 0.0f;
  for (int32_t t = a; t < e; ++t) {
    const float pt = exp_neg(s[t] - m_new);
    s[t] = pt;
    sum += pt;
  }
  fold_block(sum, m_old, m_new, *l, *m, acc, d);
  pv_row(s, v, acc, a, e, d);
}

#ifdef PYENGINE_ATTN_AVX2
// ---- AVX2 block kernel: R (<= 4) query rows sharing one query position, one KV block ----
// (the AVX-512 kernel's structure with 8-wide vectors; AVX2 has no lane masks for arithmetic,
// so tails are blended or loaded through vmaskmov)

// e^x for x <= 0, 8 lanes (the polynomial of exp_neg; 2^n through the exponent bits).
static inline __m256 exp_neg_v8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  x = _mm256_min_ps(x, _mm256_setzero_ps());
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723212e-6f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  // n is an integer in [-126, 0]: 2^n is the normal float with exponent field n + 127
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// All-ones in lanes [0, n), zeros from n on (n <= 8 is clamped).
static inline __m256i lanes_below(int32_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

#include "simd_x86.h"  // hsum8, hmax8

// Horizontal sums of 8 vectors at once: v[j] = sum of the lanes of x[j] (x: 8 vectors, 8 apart).
static inline __m256 hsum8x8(const float* x) {
  const __m256 h01 = _mm256_hadd_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8));
  const __m256 h23 = _mm256_hadd_ps(_mm256_loadu_ps(x + 16), _mm256_loadu_ps(x + 24));
  const __m256 h45 = _mm256_hadd_ps(_mm256_loadu_ps(x + 32), _mm256_loadu_ps(x + 40));
  const __m256 h67 = _mm256_hadd_ps(_mm256_loadu_ps(x + 48), _mm256_loadu_ps(x + 56));
  const __m256 h0123 = _mm256_hadd_ps(h01, h23);  // per 128-bit half: vectors 0-3, lanes 0-3 | 4-7
  const __m256 h4567 = _mm256_hadd_ps(h45, h67);
  return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20),
                       _mm256_permute2f128_ps(h0123, h4567, 0x31));
}

// Scores of R rows (q, d apart) against keys [t0, t0 + n), n <= 8, into s rows (ss apart);
// lanes past n get 0.
template <int R>
static inline void scores8(const float* __restrict q, const float* __restrict k, int32_t t0,
                           int32_t n, int32_t d, float* __restrict s, int64_t ss,
                           float* __restrict stage) {
  const int32_t dv = d / 8 * 8;
  const __m256i dm = lanes_below(d - dv);
  for (int32_t j = 0; j < 8; ++j) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    if (j < n) {
      const float* kr = k + static_cast<int64_t>(t0 + j) * d;
      int32_t i = 0;
      for (; i < dv; i += 8) {
        const __m256 kv = _mm256_loadu_ps(kr + i);
        for (int r = 0; r < R; ++r)
          acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + static_cast<int64_t>(r) * d + i), kv, acc[r]);
      }
      if (i < d) {
        const __m256 kv = _mm256_maskload_ps(kr + i, dm);
        for (int r = 0; r < R; ++r)
          acc[r] = _mm256_fmadd_ps(_mm256_maskload_ps(q + static_cast<int64_t>(r) * d + i, dm), kv,
                                   acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(stage + 64 * r + 8 * j, acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(s + r * ss + t0, hsum8x8(stage + 64 * r));
}

template <int R>
static void avx2_rows_t(const float* __restrict q, const float* __restrict k,
                        const float* __restrict v, float* __restrict s, int64_t ss,
                        float* __restrict acc, float* m, float* l, int32_t a, int32_t e,
                        int32_t d, float cap, float* __restrict stage) {
  for (int32_t t0 = a; t0 < e; t0 += 8) scores8<R>(q, k, t0, imin(8, e - t0), d, s, ss, stage);
  if (cap > 0.0f)
    for (int r = 0; r < R; ++r) softcap_row(s + r * ss, a, e, cap);
  // online softmax per row; probabilities overwrite the scores (zero past e)
  const __m256 neg_inf = _mm256_set1_ps(kNegInf);
  for (int r = 0; r < R; ++r) {
    float* sr = s + r * ss;
    __m256 mx = neg_inf;
    for (int32_t t0 = a; t0 < e; t0 += 8)
      mx = _mm256_max_ps(mx, _mm256_blendv_ps(neg_inf, _mm256_loadu_ps(sr + t0),
                                              _mm256_castsi256_ps(lanes_below(e - t0))));
    const float m_old = m[r];
    const float m_blk = hmax8(mx);
    const float m_new = m_blk > m_old ? m_blk : m_old;
    const __m256 mv = _mm256_set1_ps(m_new);
    __m256 sum = _mm256_setzero_ps();
    for (int32_t t0 = a; t0 < e; t0 += 8) {
      const __m256 live = _mm256_castsi256_ps(lanes_below(e - t0));
      const __m256 pv = _mm256_and_ps(live, exp_neg_v8(_mm256_sub_ps(_mm256_loadu_ps(sr + t0), mv)));
      _mm256_storeu_ps(sr + t0, pv);
      sum = _mm256_add_ps(sum, pv);
    }
    fold_block(hsum8(sum), m_old, m_new, l[r], m[r], acc + static_cast<int64_t>(r) * d, d);
  }
  // acc[r] += sum_t p[r][t] * v[t], each V chunk loaded once for the R rows
  for (int32_t i = 0; i < d; i += 8) {
    const bool full = i + 8 <= d;
    const __m256i dm = lanes_below(d - i);
    __m256 ac[R];
    for (int r = 0; r < R; ++r) {
      float* ar = acc + static_cast<int64_t>(r) * d + i;
      ac[r] = full ? _mm256_loadu_ps(ar) : _mm256_maskload_ps(ar, dm);
    }
    for (int32_t t = a; t < e; ++t) {
      const float* vr = v + static_cast<int64_t>(t) * d + i;
      const __m256 vv = full ? _mm256_loadu_ps(vr) : _mm256_maskload_ps(vr, dm);
      for (int r = 0; r < R; ++r) ac[r] = _mm256_fmadd_ps(_mm256_set1_ps(s[r * ss + t]), vv, ac[r]);
    }
    for (int r = 0; r < R; ++r) {
      float* ar = acc + static_cast<int64_t>(r) * d + i;
      if (full)
        _mm256_storeu_ps(ar, ac[r]);
      else
        _mm256_maskstore_ps(ar, dm, ac[r]);
    }
  }
}

static inline void avx2_rows(int32_t R, const float* q, const float* k, const float* v, float* s,
                             int64_t ss, float* acc, float* m, float* l, int32_t a, int32_t e,
                             int32_t d, float cap, float* stage) {
  switch (R) {
    case 1:
      return avx2_rows_t<1>(q, k, v, s, ss, acc, m, l, a, e, d, cap, stage);
    case 2:
      return avx2_rows_t<2>(q, k, v, s, ss, acc, m, l, a, e, d, cap, stage);
    case 3:
      return avx2_rows_t<3>(q, k, v, s, ss, acc, m, l, a, e, d, cap, stage);
    default:
      return avx2_rows_t<4>(q, k, v, s, ss, acc, m, l, a, e, d, cap, stage);
  }
}
#endif  // PYENGINE_ATTN_AVX2

#ifdef PYENGINE_ATTN_AVX512
// ---- AVX-512 block kernel: R (<= 4) query rows sharing one query position, one KV block ----

// e^x for x <= 0, 16 lanes (same polynomial as exp_neg; scalef applies 2^n).
static inline __m512 exp_neg_v(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  x = _mm512_min_ps(x, _mm512_setzero_ps());
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

static inline __mmask16 tail_mask(int32_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1u);
}

// Horizontal sums of 16 vectors at once: returns v with v[j] = sum of the lanes of x[j].
static inline __m512 hsum16x16(const float* x) {  // x: 16 vectors, 16 floats apart
  __m512 l1[8];
  for (int i = 0; i < 8; ++i) {
    const __m512 a = _mm512_loadu_ps(x + 32 * i);
    const __m512 b = _mm512_loadu_ps(x + 32 * i + 16);
    l1[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  __m512 l2[4];
  for (int i = 0; i < 4; ++i) {
    const __m512 a = l1[2 * i], b = l1[2 * i + 1];
    l2[i] = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
  }
  __m512 l3[2];
  for (int i = 0; i < 2; ++i) {
    const __m512 a = l2[2 * i], b = l2[2 * i + 1];
    l3[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(l3[0], l3[1], 0x88),
                       _mm512_shuffle_f32x4(l3[0], l3[1], 0xDD));
}

// Scores of R rows (q, D apart) against keys [t0, t0 + n), n <= 16, into s rows (ss apart).
// The new running max of a row: the larger of m_old and the scores sr[a..e).
static inline float running_max(const float* __restrict sr, int32_t a, int32_t e, float m_old) {
  __m512 mx = _mm512_set1_ps(kNegInf);
  for (int32_t t0 = a; t0 < e; t0 += 16) mx = _mm512_mask_max_ps(mx, tail_mask(e - t0), mx, _mm512_loadu_ps(sr + t0));
  const float m_new = _mm512_reduce_max_ps(mx);
  return m_new > m_old ? m_new : m_old;
}

template <int R>
static inline void scores16(const float* __restrict q, const float* __restrict k, int32_t t0,
                            int32_t n, int32_t d, float* __restrict s, int64_t ss,
                            float* __restrict stage) {
  const int32_t dv = d / 16 * 16;
  const __mmask16 dm = tail_mask(d - dv);
  for (int32_t j = 0; j < 16; ++j) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    if (j < n) {
      const float* kr = k + static_cast<int64_t>(t0 + j) * d;
      int32_t i = 0;
      for (; i < dv; i += 16) {
        const __m512 kv = _mm512_loadu_ps(kr + i);
        for (int r = 0; r < R; ++r)
          acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(q + static_cast<int64_t>(r) * d + i), kv,
                                   acc[r]);
      }
      if (dm) {
        const __m512 kv = _mm512_maskz_loadu_ps(dm, kr + i);
        for (int r = 0; r < R; ++r)
          acc[r] = _mm512_fmadd_ps(
              _mm512_maskz_loadu_ps(dm, q + static_cast<int64_t>(r) * d + i), kv, acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(stage + 256 * r + 16 * j, acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(s + r * ss + t0, hsum16x16(stage + 256 * r));
}

template <int R>
static void avx512_rows_t(const float* __restrict q, const float* __restrict k,
                          const float* __restrict v, float* __restrict s, int64_t ss,
                          float* __restrict acc, float* m, float* l, int32_t a, int32_t e,
                          int32_t d, float cap, float* __restrict stage) {
  for (int32_t t0 = a; t0 < e; t0 += 16) scores16<R>(q, k, t0, imin(16, e - t0), d, s, ss, stage);
  if (cap > 0.0f)
    for (int r = 0; r < R; ++r) softcap_row(s + r * ss, a, e, cap);
  // online softmax per row; probabilities overwrite the scores
  for (int r = 0; r < R; ++r) {
    float* sr = s + r * ss;
    const float m_old = m[r];
    const float m_new = running_max(sr, a, e, m_old);
    const __m512 mv = _mm512_set1_ps(m_new);
    __m512 sum = _mm512_setzero_ps();
    for (int32_t t0 = a; t0 < e; t0 += 16) {
      const __mmask16 tm = tail_mask(e - t0);
      const __m512 pv = _mm512_maskz_mov_ps(tm, exp_neg_v(_mm512_sub_ps(_mm512_loadu_ps(sr + t0), mv)));
      _mm512_storeu_ps(sr + t0, pv);
      sum = _mm512_add_ps(sum, pv);
    }
    fold_block(_mm512_reduce_add_ps(sum), m_old, m_new, l[r], m[r], acc + static_cast<int64_t>(r) * d, d);
  }
  // acc[r] += sum_t p[r][t] * v[t], each V chunk loaded once for the R rows
  for (int32_t i = 0; i < d; i += 16) {
    const __mmask16 dm = tail_mask(d - i);
    __m512 ac[R];
    for (int r = 0; r < R; ++r) ac[r] = _mm512_maskz_loadu_ps(dm, acc + static_cast<int64_t>(r) * d + i);
    for (int32_t t = a; t < e; ++t) {
      const __m512 vv = _mm512_maskz_loadu_ps(dm, v + static_cast<int64_t>(t) * d + i);
      for (int r = 0; r < R; ++r)
        ac[r] = _mm512_fmadd_ps(_mm512_set1_ps(s[r * ss + t]), vv, ac[r]);
    }
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(acc + static_cast<int64_t>(r) * d + i, dm, ac[r]);
  }
}

static inline void avx512_rows(int32_t R, const float* q, const float* k, const float* v,
                               float* s, int64_t ss, float* acc, float* m, float* l, int32_t a,
                               int32_t e, int32_t d, float cap, float* stage) {
  switch (R) {
    case 1:
      return avx512_rows_t<1>(q, k, v, s, ss, acc, m, l, a, e, d, cap, stage);
    case 2:
      return avx512_rows_t<2>(q, k, v, s, ss, acc, m, l, a, e, d, cap, stage);
    case 3:
      return avx512_rows_t<3>(q, k, v, s, ss, acc, m, l, a, e, d, cap, stage);
    default:
      return avx512_rows_t<4>(q, k, v, s, ss, acc, m, l, a, e, d, cap, stage);
  }
}
// Query tiles (several query positions): all M rows of the tile against one KV block at once.
// K is transposed per 16 keys (Kt[d][16], via gathers), so each score vector is a plain
// broadcast-FMA sum over d with no horizontal reductions; probabilities outside a row's
// visible range are zeroed so P.V shares every V load across up to 8 rows.
template <int R>
static inline void tile_scores(const float* __restrict q, int32_t d, const float* __restrict kt,
                               float* __restrict s, int64_t ss, int32_t t0) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int32_t i = 0; i < d; ++i) {
    const __m512 kv = _mm512_loadu_ps(kt + 16 * i);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[static_cast<int64_t>(r) * d + i]), kv, acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(s + r * ss + t0, acc[r]);
}

template <int R>
static inline void tile_pv(const float* __restrict p, int64_t ss, const float* __restrict v,
                           float* __restrict acc, int32_t a, int32_t e, int32_t d) {
  for (int32_t i = 0; i < d; i += 16) {
    const __mmask16 dm = tail_mask(d - i);
    __m512 ac[R];
    for (int r = 0; r < R; ++r)
      ac[r] = _mm512_maskz_loadu_ps(dm, acc + static_cast<int64_t>(r) * d + i);
    for (int32_t t = a; t < e; ++t) {
      const __m512 vv = _mm512_maskz_loadu_ps(dm, v + static_cast<int64_t>(t) * d + i);
      for (int r = 0; r < R; ++r) ac[r] = _mm512_fmadd_ps(_mm512_set1_ps(p[r * ss + t]), vv, ac[r]);
    }
    for (int r = 0; r < R; ++r)
      _mm512_mask_storeu_ps(acc + static_cast<int64_t>(r) * d + i, dm, ac[r]);
  }
}

// rows: M = nq * G; row r is query position pos0 + r / G. Block keys [tb0, tb1) (block
// coordinates, block starts at position bstart).
static void avx512_tile(const float* Q, int32_t M, int32_t G, int32_t pos0, int32_t W,
                        int32_t bstart, const float* K, const float* V, float* S, int64_t ss,
                        float* acc, float* m, float* l, int32_t tb0, int32_t tb1, int32_t d,
                        float cap, float* kt) {
  const __m512i idx = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(d));
  for (int32_t t0 = tb0; t0 < tb1; t0 += 16) {
    const __mmask16 tm = tail_mask(tb1 - t0);
    const float* kb = K + static_cast<int64_t>(t0) * d;
    for (int32_t i = 0; i < d; ++i)
      _mm512_storeu_ps(kt + 16 * i,
                       _mm512_mask_i32gather_ps(_mm512_setzero_ps(), tm, idx, kb + i, 4));
    int32_t r = 0;
    for (; r + 8 <= M; r += 8) tile_scores<8>(Q + static_cast<int64_t>(r) * d, d, kt, S + r * ss, ss, t0);
    for (; r + 4 <= M; r += 4) tile_scores<4>(Q + static_cast<int64_t>(r) * d, d, kt, S + r * ss, ss, t0);
    for (; r < M; ++r) tile_scores<1>(Q + static_cast<int64_t>(r) * d, d, kt, S + r * ss, ss, t0);
  }
  for (int32_t r = 0; r < M; ++r) {
    const int32_t pos = pos0 + r / G;
    const int32_t vis_lo = W > 0 ? pos - W + 1 : 0;
    const int32_t a = imax(tb0, vis_lo - bstart);
    const int32_t e = imin(tb1, pos + 1 - bstart);
    float* sr = S + r * ss;
    if (a >= e) {
      for (int32_t t = tb0; t < tb1; ++t) sr[t] = 0.0f;
      continue;
    }
    if (cap > 0.0f) softcap_row(sr, a, e, cap);  // the rest of the row is masked to 0 below
    const float m_old = m[r];
    const float m_new = running_max(sr, a, e, m_old);
    const __m512 mv = _mm512_set1_ps(m_new);
    __m512 sum = _mm512_setzero_ps();
    for (int32_t t0 = tb0; t0 < tb1; t0 += 16) {
      // lanes of [a, e) within this chunk
      const int32_t lo = imax(0, a - t0), hi = imin(16, e - t0);
      const __mmask16 vm =
          hi > lo ? static_cast<__mmask16>(tail_mask(hi) & ~tail_mask(lo)) : static_cast<__mmask16>(0);
      const __m512 pv =
          _mm512_maskz_mov_ps(vm, exp_neg_v(_mm512_sub_ps(_mm512_loadu_ps(sr + t0), mv)));
      _mm512_storeu_ps(sr + t0, pv);
      sum = _mm512_add_ps(sum, pv);
    }
    fold_block(_mm512_reduce_add_ps(sum), m_old, m_new, l[r], m[r], acc + static_cast<int64_t>(r) * d, d);
  }
  int32_t r = 0;
  for (; r + 8 <= M; r += 8)
    tile_pv<8>(S + r * ss, ss, V, acc + static_cast<int64_t>(r) * d, tb0, tb1, d);
  for (; r + 4 <= M; r += 4)
    tile_pv<4>(S + r * ss, ss, V, acc + static_cast<int64_t>(r) * d, tb0, tb1, d);
  for (; r < M; ++r) tile_pv<1>(S + r * ss, ss, V, acc + static_cast<int64_t>(r) * d, tb0, tb1, d);
}
#endif  // PYENGINE_ATTN_AVX512

#include "attention_decode.h"

// ---- one work item ----

template <typename KV>
static void run_item(const AttnParams& p, const WorkItem& it, float* scratch) {
  const int32_t G = p.group;
  const int32_t D = p.head_dim;
  const int32_t T = p.tokens_per_block;
  const int32_t H = p.num_kv_heads;
  const int32_t maxM = p.max_rows;
  const int32_t nq = it.q1 - it.q0;
  const int32_t GH = G * it.heads;  // query rows per token: the query heads of the item's KV heads
  const int32_t M = nq * GH;

  float* Q = scratch;
  float* acc = Q + static_cast<int64_t>(maxM) * D;
  float* mrow = acc + static_cast<int64_t>(maxM) * D;
  float* lrow = mrow + maxM;
  const int64_t SS = attention_score_stride(T);
  float* S = lrow + maxM;
  float* Kf = S + static_cast<int64_t>(maxM) * SS;
  float* Vf = Kf + static_cast<int64_t>(T) * D;
  float* stage = Vf + static_cast<int64_t>(T) * D;
  (void)stage;

  const int32_t s = it.seq;
  const int32_t q_begin = p.query_start_loc[s];
  const int32_t q_len = p.query_start_loc[s + 1] - q_begin;
  const int32_t pos0 = p.seq_lens[s] - q_len + it.q0;  // position of the item's first row
  const int32_t W = p.sliding_window;
  const float cap = p.softcap;

  for (int32_t qi = 0; qi < nq; ++qi) {
    const int64_t tok = q_begin + it.q0 + qi;
    for (int32_t g = 0; g < GH; ++g) {
      const int32_t r = qi * GH + g;
      const int64_t off = tok * p.query_row_stride + static_cast<int64_t>(it.kv_head * G + g) * D;
      load_row_scaled(p.query, p.q_dtype, off, Q + static_cast<int64_t>(r) * D, D, p.scale);
    }
  }
  for (int64_t i = 0; i < static_cast<int64_t>(M) * D; ++i) acc[i] = 0.0f;
  for (int32_t r = 0; r < M; ++r) {
    mrow[r] = kNegInf;
    lrow[r] = 0.0f;
  }

  const int32_t lo = it.kv_lo, hi = it.kv_hi;
  const KV* kbase = static_cast<const KV*>(p.k_cache);
  const KV* vbase = static_cast<const KV*>(p.v_cache);
  const int32_t* btab = p.block_tables + static_cast<int64_t>(s) * p.max_blocks_per_seq;

  bool decoded = false;
#ifdef PYENGINE_ATTN_DECODE
  if (nq == 1 && D % 16 == 0) {  // one query position: the chunked decode kernel
    const int32_t vis_lo = W > 0 ? pos0 - W + 1 : 0;
    decode_rows<DecodeVec, KV>(Q, G, it.heads, kbase, vbase, btab, T, H, it.kv_head, imax(lo, vis_lo),
                               imin(hi, pos0 + 1), D, cap, acc, mrow, lrow, stage);
    decoded = true;
  }
#endif
  for (int32_t b = lo / T; !decoded && b * T < hi; ++b) {
    const int32_t bstart = b * T;
    const int32_t tb0 = imax(lo, bstart) - bstart;
    const int32_t tb1 = imin(hi, bstart + T) - bstart;
    const int64_t bid = btab[b];
    const int64_t head_off = (bid * H + it.kv_head) * T * static_cast<int64_t>(D);
    if ((b + kPrefetchBlocks) * T < hi) {
      // software prefetch of a later block's K/V head slices (block ids are scattered, so the
      // hardware prefetcher cannot follow them)
      const int64_t nb = btab[b + kPrefetchBlocks];
      const int64_t noff = (nb * H + it.kv_head) * T * static_cast<int64_t>(D);
      const char* nk = reinterpret_cast<const char*>(kbase + noff);
      const char* nv = reinterpret_cast<const char*>(vbase + noff);
      const int64_t bytes = static_cast<int64_t>(T) * D * sizeof(KV);
      for (int64_t o = 0; o < bytes; o += 64) {
        __builtin_prefetch(nk + o, 0, PYENGINE_PF_LOC);
        __builtin_prefetch(nv + o, 0, PYENGINE_PF_LOC);
      }
    }
    const float* K;
    const float* V;
    if constexpr (std::is_same_v<KV, float>) {
      K = kbase + head_off;
      V = vbase + head_off;
    } else {
      const int64_t o = static_cast<int64_t>(tb0) * D;
      const int64_t n = static_cast<int64_t>(tb1 - tb0) * D;
      row_to_f32(kbase + head_off + o, Kf + o, static_cast<int32_t>(n));
      row_to_f32(vbase + head_off + o, Vf + o, static_cast<int32_t>(n));
      K = Kf;
      V = Vf;
    }
#ifdef PYENGINE_ATTN_AVX512
    if (M >= 8) {
      // tail rows of the tile that see nothing of this block are handled (skipped) inside
      avx512_tile(Q, M, G, pos0, W, bstart, K, V, S, SS, acc, mrow, lrow, tb0, tb1, D, cap, stage);
      continue;
    }
#endif
    for (int32_t qi = 0; qi < nq; ++qi) {
      const int32_t pos = pos0 + qi;
      const int32_t vis_lo = W > 0 ? pos - W + 1 : 0;
      const int32_t a = imax(tb0, vis_lo - bstart);
      const int32_t e = imin(tb1, pos + 1 - bstart);
      if (a >= e) continue;
#ifdef PYENGINE_ATTN_AVX512
      for (int32_t g0 = 0; g0 < G; g0 += 4) {
        const int64_t r = static_cast<int64_t>(qi) * G + g0;
        avx512_rows(imin(4, G - g0), Q + r * D, K, V, S + r * SS, SS, acc + r * D, mrow + r,
                    lrow + r, a, e, D, cap, stage);
      }
#elif defined(PYENGINE_ATTN_AVX2)
      for (int32_t g0 = 0; g0 < G; g0 += 4) {
        const int64_t r = static_cast<int64_t>(qi) * G + g0;
        avx2_rows(imin(4, G - g0), Q + r * D, K, V, S + r * SS, SS, acc + r * D, mrow + r,
                  lrow + r, a, e, D, cap, stage);
      }
#else
      for (int32_t g = 0; g < G; ++g) {
        const int32_t r = qi * G + g;
        float* srow = S + static_cast<int64_t>(r) * SS;
        scores_row(Q + static_cast<int64_t>(r) * D, K, srow, a, e, D);
        if (cap > 0.0f) softcap_row(srow, a, e, cap);
        softmax_pv_row(srow, V, acc + static_cast<int64_t>(r) * D, mrow + r, lrow + r, a, e, D);
      }
#endif
    }
  }

  if (it.partial < 0) {
    for (int32_t qi = 0; qi < nq; ++qi) {
      const int64_t tok = q_begin + it.q0 + qi;
      for (int32_t g = 0; g < GH; ++g) {
        const int32_t r = qi * GH + g;
        const int64_t off = tok * p.out_row_stride + static_cast<int64_t>(it.kv_head * G + g) * D;
        const float inv = lrow[r] > 0.0f ? 1.0f / lrow[r] : 0.0f;
        store_row_scaled(p.out, p.q_dtype, off, acc + static_cast<int64_t>(r) * D, D, inv);
      }
    }
  } else {
    float* part = p.partials + static_cast<int64_t>(it.partial) * p.partial_floats;
    std::memcpy(part, acc, sizeof(float) * static_cast<size_t>(M) * D);
    std::memcpy(part + static_cast<int64_t>(maxM) * D, mrow, sizeof(float) * M);
    std::memcpy(part + static_cast<int64_t>(maxM) * D + maxM, lrow, sizeof(float) * M);
  }
}

// Merges split-K pieces of one tile into `out`.
static void run_combine(const AttnParams& p, const CombineItem& c, float* scratch) {
  const int32_t G = p.group;
  const int32_t D = p.head_dim;
  const int32_t maxM = p.max_rows;
  const int32_t nq = c.q1 - c.q0;
  const int32_t GH = G * c.heads;
  const int32_t q_begin = p.query_start_loc[c.seq];
  float* row = scratch;
  for (int32_t qi = 0; qi < nq; ++qi) {
    for (int32_t g = 0; g < GH; ++g) {
      const int32_t r = qi * GH + g;
      float mmax = kNegInf;
      for (int32_t j = 0; j < c.num_partials; ++j) {
        const float* part = p.partials + static_cast<int64_t>(c.first_partial + j) * p.partial_floats;
        const float mj = part[static_cast<int64_t>(maxM) * D + r];
        mmax = mj > mmax ? mj : mmax;
      }
      for (int32_t i = 0; i < D; ++i) row[i] = 0.0f;
      float l = 0.0f;
      if (mmax != kNegInf) {
        for (int32_t j = 0; j < c.num_partials; ++j) {
          const float* part =
              p.partials + static_cast<int64_t>(c.first_partial + j) * p.partial_floats;
          const float mj = part[static_cast<int64_t>(maxM) * D + r];
          if (mj == kNegInf) continue;
          const float w = exp_neg(mj - mmax);
          l += w * part[static_cast<int64_t>(maxM) * D + maxM + r];
          const float* a = part + static_cast<int64_t>(r) * D;
          for (int32_t i = 0; i < D; ++i) row[i] += w * a[i];
        }
      }
      const int64_t tok = q_begin + c.q0 + qi;
      const int64_t off = tok * p.out_row_stride + static_cast<int64_t>(c.kv_head * G + g) * D;
      store_row_scaled(p.out, p.q_dtype, off, row, D, l > 0.0f ? 1.0f / l : 0.0f);
    }
  }
}

template <typename KV>
static void run_all(const AttnParams& p) {
  const int32_t nt = p.num_threads;
  if (nt <= 1) {  // on the calling thread: no one-thread OpenMP team to set up (elementwise_impl.h: for_rows)
    for (int32_t i = 0; i < p.num_items; ++i) run_item<KV>(p, p.items[i], p.thread_scratch);
    for (int32_t i = 0; i < p.num_combines; ++i) run_combine(p, p.combines[i], p.thread_scratch);
    return;
  }
PYENGINE_OMP(parallel num_threads(nt))
  {
    float* scratch = p.thread_scratch + cpu::thread_id() * p.thread_scratch_floats;
PYENGINE_OMP(for schedule(dynamic, 1))
    for (int32_t i = 0; i < p.num_items; ++i) run_item<KV>(p, p.items[i], scratch);
    // implicit barrier: every partial is written before it is combined
PYENGINE_OMP(for schedule(dynamic, 1))
    for (int32_t i = 0; i < p.num_combines; ++i) run_combine(p, p.combines[i], scratch);
  }
}

}  // namespace

void attention_run(const AttnParams& p) {
  switch (p.cache_dtype) {
    case DType::kFloat32:
      return run_all<float>(p);
    case DType::kBFloat16:
      return run_all<bf16_t>(p);
    case DType::kFloat16:
      return run_all<fp16_t>(p);
    case DType::kFloat8E4M3:  // CUDA-only; the entry points reject it before this
      break;
  }
}

}  // namespace pyengine::kernels::cpu::PYENGINE_ISA_NS
