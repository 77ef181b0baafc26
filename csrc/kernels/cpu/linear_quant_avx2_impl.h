// The AVX2 compute code of the quantized linear kernel: 8-bit integer block dot products with
// vpmaddubsw / vpmaddwd (32 weight-activation products per instruction pair), exact within a
// block (Q8_0, Q4_0) or super-block (Q4_K, Q6_K), scaled into fp32 sums. Included by
// linear_quant_avx2.cpp, and by linear_quant_avx512.cpp, which compiles the same code for the
// AVX-512 level (a CPU with AVX-512 has AVX2).
//
// Tiles: the 32-weight formats keep MB x rows by R weight rows of fp32 partial sums in
// registers (M == 1: R = 4 rows in flight); the 256-weight formats take one weight row against
// MB x rows, its scales unpacked once per super-block.
#ifndef PYENGINE_ISA_NS
#error "define PYENGINE_ISA_NS before including linear_quant_avx2_impl.h"
#endif

namespace pyengine::kernels::cpu::PYENGINE_ISA_NS {

namespace {

constexpr int32_t kPrefetchBytes = 2048;
constexpr int32_t kPrefetchM1Bytes = 4096;

inline __m256i load32(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline void prefetch_l2(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }
inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

inline float hsum_ps(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

inline int32_t hsum_epi32(__m256i v) {
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i t = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1)));
}

// ---- 32-weight blocks: Q8_0, Q4_0 ----

// A block's dot product with 32 activations: 8 int32 partial sums. vpmaddubsw multiplies
// unsigned by signed bytes: Q8_0 moves the weights' signs onto x (|w| times +-x); Q4_0 multiplies
// its unsigned levels 0..15 as they are, the offset of 8 being taken off with ActQ8_32::s8.
inline __m256i block_dot(const BlockQ8_0& b, __m256i x) {
  const __m256i w = load32(b.qs);
  const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
  return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}
inline __m256i block_dot(const BlockQ4_0& b, __m256i x) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs));
  const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0f));
  return _mm256_madd_epi16(_mm256_maddubs_epi16(nib, x), _mm256_set1_epi16(1));
}
constexpr bool has_offset(const BlockQ8_0*) { return false; }
constexpr bool has_offset(const BlockQ4_0*) { return true; }

// Dot products of MB rows of x with R weight rows: out[m * R + r]. Even and odd blocks sum into
// separate accumulators (two independent FMA chains), added at the end (Q4_0: minus the offsets'
// sum, kept in a scalar): the same order for every MB and R, so a row's result does not depend on
// the batch it is in.
template <typename B, int MB, int R>
void tile32(const QuantLinearArgs& a, int32_t m0, int32_t n, float* out) {
  constexpr bool offset = has_offset(static_cast<const B*>(nullptr));
  const int32_t nb = a.K / kQK;
  __m256 acc[2][MB][R];
  float off[MB][R];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) acc[0][m][r] = acc[1][m][r] = _mm256_setzero_ps(), off[m][r] = 0.0f;
  const B* w[R];
  for (int r = 0; r < R; ++r) w[r] = reinterpret_cast<const B*>(a.w + (n + r) * a.wrow_bytes);
  const ActQ8_32* x[MB];
  for (int m = 0; m < MB; ++m) x[m] = reinterpret_cast<const ActQ8_32*>(a.xq + (m0 + m) * a.xrow_bytes);
  auto step = [&](int32_t b, int p) {
    for (int r = 0; r < R; ++r) {
      const float dw = half_to_float(w[r][b].d);
      for (int m = 0; m < MB; ++m) {
        const __m256i dot = block_dot(w[r][b], load32(x[m][b].qs));
        acc[p][m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dw * x[m][b].d), acc[p][m][r]);
        if (offset) off[m][r] += dw * x[m][b].s8;
      }
    }
  };
  int32_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    if (MB == 1 && R == 1) prefetch_l2(reinterpret_cast<const char*>(w[0] + b) + kPrefetchM1Bytes);
    step(b, 0);
    step(b + 1, 1);
  }
  if (b < nb) step(b, 0);
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) out[m * R + r] = hsum_ps(_mm256_add_ps(acc[0][m][r], acc[1][m][r])) - off[m][r];
}

// ---- 256-weight super-blocks: Q4_K, Q6_K (one weight row, MB x rows) ----

template <int MB>
void row_q4_k(const QuantLinearArgs& a, int32_t m0, int32_t n, float* out) {
  const int32_t nb = a.K / kQKK;
  const auto* w = reinterpret_cast<const BlockQ4_K*>(a.w + n * a.wrow_bytes);
  const ActQ8_256* x[MB];
  for (int m = 0; m < MB; ++m) x[m] = reinterpret_cast<const ActQ8_256*>(a.xq + (m0 + m) * a.xrow_bytes);
  float acc[MB] = {};
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  for (int32_t b = 0; b < nb; ++b) {
    const BlockQ4_K& wb = w[b];
    if (MB == 1) prefetch_l2(reinterpret_cast<const char*>(&wb) + kPrefetchBytes);
    uint8_t sc[8], mn[8];
    for (int j = 0; j < 8; ++j) q4k_scale_min(j, wb.scales, sc[j], mn[j]);
    __m256i sumi[MB];
    for (int m = 0; m < MB; ++m) sumi[m] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {  // 64 weights: sub-blocks 2c (low nibbles), 2c + 1 (high)
      const __m256i q = load32(wb.qs + 32 * c);
      const __m256i lo = _mm256_and_si256(q, low4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
      const __m256i s0 = _mm256_set1_epi16(sc[2 * c]), s1 = _mm256_set1_epi16(sc[2 * c + 1]);
      for (int m = 0; m < MB; ++m) {
        const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load32(x[m][b].qs + 64 * c)), s0);
        const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load32(x[m][b].qs + 64 * c + 32)), s1);
        sumi[m] = _mm256_add_epi32(sumi[m], _mm256_add_epi32(p0, p1));
      }
    }
    const float d = half_to_float(wb.d), dmin = half_to_float(wb.dmin);
    uint64_t mn8;
    std::memcpy(&mn8, mn, 8);
    const __m256i mins = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(mn8)));
    for (int m = 0; m < MB; ++m) {
      // the sums of x over each sub-block of 32 (pairs of the 16-value sums), times its min
      const __m256i pairs = _mm256_madd_epi16(load32(x[m][b].bsums), _mm256_set1_epi16(1));
      const int32_t smin = hsum_epi32(_mm256_mullo_epi32(pairs, mins));
      const float dx = x[m][b].d;
      acc[m] += d * dx * static_cast<float>(hsum_epi32(sumi[m])) - dmin * dx * static_cast<float>(smin);
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = acc[m];
}

template <int MB>
void row_q6_k(const QuantLinearArgs& a, int32_t m0, int32_t n, float* out) {
  const int32_t nb = a.K / kQKK;
  const auto* w = reinterpret_cast<const BlockQ6_K*>(a.w + n * a.wrow_bytes);
  const ActQ8_256* x[MB];
  for (int m = 0; m < MB; ++m) x[m] = reinterpret_cast<const ActQ8_256*>(a.xq + (m0 + m) * a.xrow_bytes);
  float acc[MB] = {};
  const __m256i low4 = _mm256_set1_epi8(0x0f), low2 = _mm256_set1_epi8(0x03);
  for (int32_t b = 0; b < nb; ++b) {
    const BlockQ6_K& wb = w[b];
    if (MB == 1) prefetch_l2(reinterpret_cast<const char*>(&wb) + kPrefetchBytes);
    // the 16 sub-block scales as int16, and per 32 levels the pair of scales of its two halves
    const __m256i scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb.scales)));
    __m256i sumi[MB];
    for (int m = 0; m < MB; ++m) sumi[m] = _mm256_setzero_si256();
    for (int half = 0; half < 2; ++half) {
      const __m256i qa = load32(wb.ql + 64 * half), qb = load32(wb.ql + 64 * half + 32);
      const __m256i qh = load32(wb.qh + 32 * half);
      __m256i q[4];
      q[0] = _mm256_or_si256(_mm256_and_si256(qa, low4), _mm256_slli_epi16(_mm256_and_si256(qh, low2), 4));
      q[1] = _mm256_or_si256(_mm256_and_si256(qb, low4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), low2), 4));
      q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qa, 4), low4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), low2), 4));
      q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qb, 4), low4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), low2), 4));
      __m256i s[4];
      for (int i = 0; i < 4; ++i) {
        const int j = 8 * half + 2 * i;
        s[i] = _mm256_set_m128i(_mm_set1_epi16(wb.scales[j + 1]), _mm_set1_epi16(wb.scales[j]));
      }
      for (int m = 0; m < MB; ++m)
        for (int i = 0; i < 4; ++i) {
          const __m256i p = _mm256_maddubs_epi16(q[i], load32(x[m][b].qs + 128 * half + 32 * i));
          sumi[m] = _mm256_add_epi32(sumi[m], _mm256_madd_epi16(p, s[i]));
        }
    }
    const float d = half_to_float(wb.d);
    for (int m = 0; m < MB; ++m) {
      // the levels are stored + 32: take 32 * sum_j scale_j * (sum of x over sub-block j) off
      const int32_t corr = hsum_epi32(_mm256_madd_epi16(load32(x[m][b].bsums), scales16));
      acc[m] += d * x[m][b].d * static_cast<float>(hsum_epi32(sumi[m]) - 32 * corr);
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = acc[m];
}

// ---- tile loops ----

constexpr int kMB32 = 2, kR32 = 2;  // x rows x weight rows per tile, 32-weight formats, M >= 2
constexpr int kMB256 = 4;           // x rows per weight row, 256-weight formats

template <typename B, int R, int MB = kMB32>
void tile32_upto(int mb, const QuantLinearArgs& a, int32_t m0, int32_t n, float* out) {
  if constexpr (MB > 1) {
    if (mb < MB) return tile32_upto<B, R, MB - 1>(mb, a, m0, n, out);
  }
  tile32<B, MB, R>(a, m0, n, out);
}

template <typename B, int R>
void run32(const QuantLinearArgs& a, int32_t n) {
  float out[kMB32 * kR32];
  for (int32_t m0 = 0; m0 < a.M; m0 += kMB32) {
    const int mb = std::min<int32_t>(kMB32, a.M - m0);
    tile32_upto<B, R>(mb, a, m0, n, out);
    for (int m = 0; m < mb; ++m)
      for (int r = 0; r < R; ++r) quant_linear_store(a, m0 + m, n + r, out[m * R + r]);
  }
}

template <typename B>
void rows32(const QuantLinearArgs& a, int32_t n0, int32_t n1) {
  int32_t n = n0;
  if (a.M == 1) {  // one weight row at a time, in order: what the hardware prefetchers follow best
    float out;
    for (; n < n1; ++n) {
      tile32<B, 1, 1>(a, 0, n, &out);
      quant_linear_store(a, 0, n, out);
    }
    return;
  }
  for (; n + kR32 <= n1; n += kR32) run32<B, kR32>(a, n);
  for (; n < n1; ++n) run32<B, 1>(a, n);
}

template <int MB = kMB256>
void row256_upto(int mb, const QuantLinearArgs& a, int32_t m0, int32_t n, float* out) {
  if constexpr (MB > 1) {
    if (mb < MB) return row256_upto<MB - 1>(mb, a, m0, n, out);
  }
  if (a.type == QuantType::kQ4_K)
    row_q4_k<MB>(a, m0, n, out);
  else
    row_q6_k<MB>(a, m0, n, out);
}

void rows256(const QuantLinearArgs& a, int32_t n0, int32_t n1) {
  float out[kMB256];
  for (int32_t n = n0; n < n1; ++n)
    for (int32_t m0 = 0; m0 < a.M; m0 += kMB256) {
      const int mb = std::min<int32_t>(kMB256, a.M - m0);
      row256_upto(mb, a, m0, n, out);
      for (int m = 0; m < mb; ++m) quant_linear_store(a, m0 + m, n, out[m]);
    }
}

}  // namespace

void quant_linear_rows(const QuantLinearArgs& a, int32_t n0, int32_t n1) {
  switch (a.type) {
    case QuantType::kQ8_0: return rows32<BlockQ8_0>(a, n0, n1);
    case QuantType::kQ4_0: return rows32<BlockQ4_0>(a, n0, n1);
    case QuantType::kQ4_K:
    case QuantType::kQ6_K: return rows256(a, n0, n1);
  }
}

}  // namespace pyengine::kernels::cpu::PYENGINE_ISA_NS
