// The AVX2 compute code of the quantized linear kernel: 8-bit integer block dot products with
// vpmaddubsw / vpmaddwd (32 weight-activation products per instruction pair) or, in the VNNI
// builds, vpdpbusd (32 per instruction), exact within a block (Q8_0, Q5_0, Q5_1, Q4_0, Q4_Z) or
// super-block (Q4_K, Q5_K, Q6_K), scaled into fp32 sums. Included (through linear_quant_x86_build.h) by
// linear_quant_avx2.cpp, by linear_quant_avx512.cpp, which compiles the same code for the
// AVX-512 level (a CPU with AVX-512 has AVX2), and by their VNNI builds
// (linear_quant_*_vnni.cpp, PYENGINE_QUANT_VNNI set): the integer sums are exact either way, so
// every build gives the same bits.
//
// The interleaved layouts' code is in linear_quant_x8_avx2_impl.h.
//
// Tiles: the 32-weight formats keep MB x rows by R weight rows of fp32 partial sums in
// registers (M == 1: one weight row at a time, in order, prefetched far ahead); the 256-weight
// formats take one weight row against MB x rows, its scales unpacked once per super-block.
#ifndef PYENGINE_ISA_NS
#error "define PYENGINE_ISA_NS before including linear_quant_avx2_impl.h"
#endif

namespace pyengine::kernels::cpu::PYENGINE_ISA_NS {

namespace {

constexpr int32_t kPrefetchBytes = 2048;
constexpr int32_t kPrefetchM1Bytes = 4096;

inline __m256i load32(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
#include "simd_x86.h"

// ---- byte dot products: unsigned bytes u times signed bytes s, 4 adjacent products per int32 ----
//
// An accumulator starts at zero and takes dot_add(acc, u, s) a few times; dot_lanes(acc) is then
// the int32 sums, dot_scaled(acc, lane_scales_*(...)) the sums times a scale per int32 lane.
// Without VNNI, vpmaddubsw sums products pairwise into int16 lanes which the calls add up before
// one widening: each kernel says why those int16 sums cannot overflow (vpmaddubsw itself
// saturates a pair only beyond 2 * 255 * 127, which no format reaches: Q8_0 multiplies |w| <= 128).
// With VNNI, vpdpbusd adds them straight into int32 lanes: the same integers.
#if PYENGINE_QUANT_VNNI == 2
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#elif PYENGINE_QUANT_VNNI == 1
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#endif
#if PYENGINE_QUANT_VNNI
inline __m256i dot_add(__m256i acc, __m256i u, __m256i s) { return dpbusd(acc, u, s); }
inline __m256i dot_lanes(__m256i acc) { return acc; }
// 8 scale bytes (one per int32 lane), unsigned or signed
inline __m256i lane_scales_u8(__m128i v8) { return _mm256_cvtepu8_epi32(v8); }
inline __m256i lane_scales_i8(__m128i v8) { return _mm256_cvtepi8_epi32(v8); }
inline __m256i dot_scaled(__m256i acc, __m256i scales) { return _mm256_mullo_epi32(acc, scales); }
// products widened into int32 at once (where int16 sums of several calls could overflow)
inline __m256i dot_add_wide(__m256i acc32, __m256i u, __m256i s) { return dpbusd(acc32, u, s); }
#else
inline __m256i dot_add(__m256i acc, __m256i u, __m256i s) { return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, s)); }
inline __m256i dot_lanes(__m256i acc) { return _mm256_madd_epi16(acc, _mm256_set1_epi16(1)); }
// each scale in both int16 halves of its lane: vpmaddwd multiplies and adds the pair
inline __m256i lane_scales_u8(__m128i v8) { return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(v8, v8)); }
inline __m256i lane_scales_i8(__m128i v8) { return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(v8, v8)); }
inline __m256i dot_scaled(__m256i acc, __m256i scales) { return _mm256_madd_epi16(acc, scales); }
inline __m256i dot_add_wide(__m256i acc32, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc32, dot_lanes(_mm256_maddubs_epi16(u, s)));
}
#endif

// ---- 32-weight blocks: Q8_0, Q5_0, Q5_1, Q4_0, Q4_Z ----

// A block's levels unpacked once (and reused for every row of x), then its dot product with 32
// activations: 8 int32 partial sums. vpmaddubsw multiplies unsigned by signed bytes: Q8_0 moves
// the weights' signs onto x (|w| times +-x); Q4_0, Q5_0, Q5_1 and Q4_Z multiply their unsigned
// levels (0..15, 0..31) as they are, the offset (8, 16; Q4_Z: its zero point; Q5_1: its min m)
// being taken off (Q5_1: added) with ActQ8_32::s8.
struct Levels {
  __m256i u;  // unsigned levels (Q8_0: |w|)
  __m256i s;  // Q8_0: the signed levels (their signs go onto x)
};

inline __m256i nibbles(const uint8_t* qs) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0f));
}

inline Levels unpack(const BlockQ8_0& b) {
  const __m256i w = load32(b.qs);
  return {_mm256_sign_epi8(w, w), w};
}
inline Levels unpack(const BlockQ4_0& b) { return {nibbles(b.qs), _mm256_setzero_si256()}; }
inline Levels unpack(const BlockQ4_Z& b) { return {nibbles(b.qs), _mm256_setzero_si256()}; }
// Q5_0, Q5_1: the nibbles as Q4_0's, the fifth bits spread to bytes (byte i tests bit i of qh).
inline __m256i five_bit_levels(const uint8_t* qh4, const uint8_t* qs) {
  uint32_t qh;
  std::memcpy(&qh, qh4, 4);
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(qh)),
                                            _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                              0x0101010101010101, 0x0000000000000000));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
  return _mm256_or_si256(nibbles(qs), _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
}
inline Levels unpack(const BlockQ5_0& b) { return {five_bit_levels(b.qh, b.qs), _mm256_setzero_si256()}; }
inline Levels unpack(const BlockQ5_1& b) { return {five_bit_levels(b.qh, b.qs), _mm256_setzero_si256()}; }

template <typename B>
inline __m256i block_dot(const Levels& w, __m256i x) {
  const __m256i xs = std::is_same_v<B, BlockQ8_0> ? _mm256_sign_epi8(x, w.s) : x;
  return dot_lanes(dot_add(_mm256_setzero_si256(), w.u, xs));
}
// A block's level offset, in units of ActQ8_32::s8 (8 * d * sum(x levels)).
constexpr bool has_offset(const BlockQ8_0*) { return false; }
template <typename B>
constexpr bool has_offset(const B*) { return true; }
inline float offset_units(const BlockQ8_0&) { return 0.0f; }
inline float offset_units(const BlockQ4_0&) { return 1.0f; }
inline float offset_units(const BlockQ5_0&) { return 2.0f; }
inline float offset_units(const BlockQ4_Z& b) { return static_cast<float>(b.z) * 0.125f; }
// What a block's dot product takes off for its levels' offset (Q5_1: adds, m times the sum of x).
template <typename B>
inline float block_offset(const B& b, float dw, float s8) { return dw * (offset_units(b) * s8); }
inline float block_offset(const BlockQ5_1& b, float, float s8) { return -(half_to_float(b.m) * (0.125f * s8)); }

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
      const Levels lv = unpack(w[r][b]);
      for (int m = 0; m < MB; ++m) {
        const __m256i dot = block_dot<B>(lv, load32(x[m][b].qs));
        acc[p][m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dw * x[m][b].d), acc[p][m][r]);
        if (offset) off[m][r] += block_offset(w[r][b], dw, x[m][b].s8);
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
    for (int r = 0; r < R; ++r) out[m * R + r] = hsum8(_mm256_add_ps(acc[0][m][r], acc[1][m][r])) - off[m][r];
}

// ---- 256-weight super-blocks: Q4_K, Q5_K, Q6_K (one weight row, MB x rows) ----
// (vpmaddubsw in every build: these rows are only the fallback for N not a multiple of 8; the
// interleaved layouts take the rest)

// Q4_K's 8 sub-block scales (bytes 0..7) and mins (bytes 8..15) from its 12 packed bytes: the
// low 6 bits of bytes 0..3 / 4..7 for sub-blocks 0..3; for 4..7 the nibbles of bytes 8..11 with
// the top 2 bits of bytes 0..3 / 4..7 above them (q4k_scale_min, four at a time).
inline __m128i q4k_scales_mins(const uint8_t* packed) {
  uint32_t v[3];
  std::memcpy(v, packed, 12);
  const uint32_t six = 0x3f3f3f3fu, four = 0x0f0f0f0fu, two = 0x03030303u;
  const uint32_t sc_lo = v[0] & six, mn_lo = v[1] & six;
  const uint32_t sc_hi = (v[2] & four) | (((v[0] >> 6) & two) << 4);
  const uint32_t mn_hi = ((v[2] >> 4) & four) | (((v[1] >> 6) & two) << 4);
  return _mm_set_epi32(static_cast<int32_t>(mn_hi), static_cast<int32_t>(mn_lo), static_cast<int32_t>(sc_hi),
                       static_cast<int32_t>(sc_lo));
}

// The int16 lanes of `v16` (8 values, repeated in both halves) broadcast: lane j everywhere.
inline __m256i broadcast_word(__m256i v16, int j) {
  const __m256i pick = _mm256_set1_epi16(static_cast<int16_t>((2 * j) | ((2 * j + 1) << 8)));
  return _mm256_shuffle_epi8(v16, pick);
}

// The fifth bits of 5-bit levels (Q5_K, Q5_0x8, Q5_1x8), for chunk c of 32 nibble bytes: bits 2c
// (the low nibbles' levels) and 2c + 1 (the high ones') of each byte of h or'ed into lo and hi
// as bit 4; h then moves on to the next chunk's bits (a right shift of 16-bit lanes: bits 0 and
// 1 of each byte stay its own).
inline void or_fifth_bits(__m256i& h, __m256i& lo, __m256i& hi) {
  const __m256i bit4 = _mm256_set1_epi8(0x10);
  lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(h, 4), bit4));
  hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(h, 3), bit4));
  h = _mm256_srli_epi16(h, 2);
}

// Q4_K and Q5_K (B): per super-block the integer sums stay in vectors and go into fp32 vector
// accumulators (the scaled levels and the mins' term apart), one horizontal sum per row at the
// end: the same order for every MB. Q5_K's fifth bits join the nibbles as bit 4 (levels up to 31:
// a vpmaddubsw pair sums at most 2 * 31 * 127, within int16).
template <typename B, int MB>
void row_k_min(const QuantLinearArgs& a, int32_t m0, int32_t n, float* out) {
  constexpr bool kFifthBits = std::is_same_v<B, BlockQ5_K>;
  const int32_t nb = a.K / kQKK;
  const auto* w = reinterpret_cast<const B*>(a.w + n * a.wrow_bytes);
  const ActQ8_256* x[MB];
  for (int m = 0; m < MB; ++m) x[m] = reinterpret_cast<const ActQ8_256*>(a.xq + (m0 + m) * a.xrow_bytes);
  __m256 acc[MB], accmin[MB];
  for (int m = 0; m < MB; ++m) acc[m] = accmin[m] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  for (int32_t b = 0; b < nb; ++b) {
    const B& wb = w[b];
    if (MB == 1) prefetch_l2(reinterpret_cast<const char*>(&wb) + kPrefetchBytes);
    const __m128i sm = q4k_scales_mins(wb.scales);
    const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));   // 8 scales, twice
    const __m256i mins = _mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8));          // 8 mins
    __m256i sumi[MB];
    for (int m = 0; m < MB; ++m) sumi[m] = _mm256_setzero_si256();
    [[maybe_unused]] __m256i qh = _mm256_setzero_si256();  // Q5_K: its fifth bits
    if constexpr (kFifthBits) qh = load32(wb.qh);
    for (int c = 0; c < 4; ++c) {  // 64 weights: sub-blocks 2c (low nibbles), 2c + 1 (high)
      const __m256i q = load32(wb.qs + 32 * c);
      __m256i lo = _mm256_and_si256(q, low4);
      __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
      if constexpr (kFifthBits) or_fifth_bits(qh, lo, hi);
      const __m256i s0 = broadcast_word(sc16, 2 * c), s1 = broadcast_word(sc16, 2 * c + 1);
      for (int m = 0; m < MB; ++m) {
        const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load32(x[m][b].qs + 64 * c)), s0);
        const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load32(x[m][b].qs + 64 * c + 32)), s1);
        sumi[m] = _mm256_add_epi32(sumi[m], _mm256_add_epi32(p0, p1));
      }
    }
    const float d = half_to_float(wb.d), dmin = half_to_float(wb.dmin);
    for (int m = 0; m < MB; ++m) {
      // the sums of x over each sub-block of 32 (pairs of the 16-value sums), times its min
      const __m256i pairs = _mm256_madd_epi16(load32(x[m][b].bsums), _mm256_set1_epi16(1));
      const float dx = x[m][b].d;
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[m]), _mm256_set1_ps(d * dx), acc[m]);
      accmin[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_mullo_epi32(pairs, mins)), _mm256_set1_ps(dmin * dx),
                                  accmin[m]);
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = hsum8(acc[m]) - hsum8(accmin[m]);
}

template <int MB>
void row_q6_k(const QuantLinearArgs& a, int32_t m0, int32_t n, float* out) {
  const int32_t nb = a.K / kQKK;
  const auto* w = reinterpret_cast<const BlockQ6_K*>(a.w + n * a.wrow_bytes);
  const ActQ8_256* x[MB];
  for (int m = 0; m < MB; ++m) x[m] = reinterpret_cast<const ActQ8_256*>(a.xq + (m0 + m) * a.xrow_bytes);
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0f), low2 = _mm256_set1_epi8(0x03);
  // per 32 levels, the scales of its two sub-blocks of 16 (low, high 128-bit lane)
  const __m256i pair_pick = _mm256_set_epi8(3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2,
                                            1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0);
  for (int32_t b = 0; b < nb; ++b) {
    const BlockQ6_K& wb = w[b];
    if (MB == 1) prefetch_l2(reinterpret_cast<const char*>(&wb) + kPrefetchBytes);
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
      // the 8 scales of this half as int16 in both 128-bit lanes, then pairs (2i, 2i + 1); the
      // immediate spelled out in each branch: it must be a constant even when the loop is not
      // unrolled (-O0, sanitizer builds)
      const __m256i sc = half == 0 ? _mm256_permute4x64_epi64(scales16, 0x44)
                                   : _mm256_permute4x64_epi64(scales16, 0xee);
      for (int i = 0; i < 4; ++i) {
        const __m256i s = _mm256_shuffle_epi8(sc, _mm256_add_epi8(pair_pick, _mm256_set1_epi8(static_cast<char>(4 * i))));
        for (int m = 0; m < MB; ++m) {
          const __m256i p = _mm256_maddubs_epi16(q[i], load32(x[m][b].qs + 128 * half + 32 * i));
          sumi[m] = _mm256_add_epi32(sumi[m], _mm256_madd_epi16(p, s));
        }
      }
    }
    const float d = half_to_float(wb.d);
    for (int m = 0; m < MB; ++m) {
      // the levels are stored + 32: take 32 * sum_j scale_j * (sum of x over sub-block j) off
      const __m256i corr = _mm256_madd_epi16(load32(x[m][b].bsums), scales16);
      const __m256i total = _mm256_sub_epi32(sumi[m], _mm256_slli_epi32(corr, 5));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_set1_ps(d * x[m][b].d), acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = hsum8(acc[m]);
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
    row_k_min<BlockQ4_K, MB>(a, m0, n, out);
  else if (a.type == QuantType::kQ5_K)
    row_k_min<BlockQ5_K, MB>(a, m0, n, out);
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

#include "linear_quant_x8_avx2_impl.h"

// ---- activations to 8 bits (as quantize_act_32 / _256, bit for bit: the same fp32 division,
// reciprocal and products, and vcvtps2dq rounds to nearest even as nearest_int does) ----

inline __m256 abs_ps(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }

// 32 values times `id`, rounded to int8 in order at out; the int32 sums of the first 16 and of
// the last 16, 8 lanes each.
inline void quantize32(const float* v, __m256 id, int8_t* out, __m256i& sum_lo, __m256i& sum_hi) {
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * i), id));
  sum_lo = _mm256_add_epi32(q[0], q[1]);
  sum_hi = _mm256_add_epi32(q[2], q[3]);
  // packs interleave the 128-bit lanes: restore the order of the 32 values
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

// A block of n values' scale d = max|v| / 127 (returned) and its reciprocal (0 for d = 0).
inline float block_scale(const float* v, int n, __m256& id) {
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < n; i += 8) m = _mm256_max_ps(m, abs_ps(_mm256_loadu_ps(v + i)));
  const float d = hmax8(m) / 127.0f;
  id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
  return d;
}

void act_row_32(const float* x, ActQ8_32* out, int32_t K) {
  for (int32_t b = 0; b < K / kQK; ++b) {
    const float* v = x + b * kQK;
    __m256 id;
    const float d = out[b].d = block_scale(v, kQK, id);
    __m256i lo, hi;
    quantize32(v, id, out[b].qs, lo, hi);
    out[b].s8 = static_cast<float>(8 * hsum8_epi32(_mm256_add_epi32(lo, hi))) * d;
  }
}

void act_row_256(const float* x, ActQ8_256* out, int32_t K) {
  for (int32_t b = 0; b < K / kQKK; ++b) {
    const float* v = x + b * kQKK;
    __m256 id;
    out[b].d = block_scale(v, kQKK, id);
    for (int g = 0; g < kQKK / 32; ++g) {
      __m256i lo, hi;
      quantize32(v + 32 * g, id, out[b].qs + 32 * g, lo, hi);
      out[b].bsums[2 * g] = static_cast<int16_t>(hsum8_epi32(lo));
      out[b].bsums[2 * g + 1] = static_cast<int16_t>(hsum8_epi32(hi));
    }
  }
}

}  // namespace

void quantize_activations(const float* x, int64_t ldx, int32_t m0, int32_t m1, int32_t K, int32_t block,
                          uint8_t* xq, int64_t xrow_bytes) {
  quantize_activation_rows(x, ldx, m0, m1, K, block, xq, xrow_bytes, act_row_32, act_row_256);
}

void quant_linear_rows(const QuantLinearArgs& a, int32_t n0, int32_t n1) {
  switch (a.type) {
    case QuantType::kQ8_0: return rows32<BlockQ8_0>(a, n0, n1);
    case QuantType::kQ4_0: return rows32<BlockQ4_0>(a, n0, n1);
    case QuantType::kQ5_0: return rows32<BlockQ5_0>(a, n0, n1);
    case QuantType::kQ5_1: return rows32<BlockQ5_1>(a, n0, n1);
    case QuantType::kQ4_Z: return rows32<BlockQ4_Z>(a, n0, n1);
    case QuantType::kQ4_K:
    case QuantType::kQ5_K:
    case QuantType::kQ6_K: return rows256(a, n0, n1);
    case QuantType::kQ4_0x8:
    case QuantType::kQ5_0x8:
    case QuantType::kQ5_1x8:
    case QuantType::kQ8_0x8:
    case QuantType::kQ4_Zx8:
    case QuantType::kQ4_Kx8:
    case QuantType::kQ5_Kx8:
    case QuantType::kQ6_Kx8: return rows_x8(a, n0, n1);
  }
}

#if PYENGINE_QUANT_VNNI == 2
void spread_activation_pairs(const uint8_t* xq, int32_t K, uint8_t* out) { spread_pairs(xq, K, out); }
#endif

}  // namespace pyengine::kernels::cpu::PYENGINE_ISA_NS
