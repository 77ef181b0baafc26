// The AVX2 compute code of the quantized linear kernel for the interleaved layouts (Q8_0x8,
// Q5_0x8, Q5_1x8, Q4_0x8, Q4_Zx8, Q4_Kx8, Q5_Kx8, Q6_Kx8; pyengine/cpu_quant.h): a 32-byte vector
// holds 4 levels of each of 8 weight rows, so one vpmaddubsw (VNNI: vpdpbusd; see dot_add)
// against 4 activations broadcast to every lane advances all 8 rows' dot products at once; the
// sums stay one row per 32-bit lane to the end (no horizontal sums), and 8 rows' fp16 scales
// convert in one instruction. The levels of a group block are unpacked once
// and reused for up to kMBx8 (256-weight formats: kMBx8Super) rows of x; each row of x sums its blocks in the same order whatever
// the number of rows, so a row's result does not depend on the batch it is in.
//
// Included inside the anonymous namespace of linear_quant_avx2_impl.h (its helpers in scope).

constexpr int kMBx8 = 4;  // rows of x per pass over a group's weights
// The 256-weight formats in the avx512 VNNI build: 8 rows of x a pass (32 vector registers hold
// their sums; with one accumulator per row, nibble_dots). Measured on a 2-core Zen 4, M = 512,
// qwen3-0.6b shape's gate/up and down: Q4_K 1.1x, Q5_K 1.15-1.2x, Q6_K 1.07-1.1x the rate at 4
// rows; the 32-weight formats, which scale every block in fp32, ran 3-5% slower at 8.
#if PYENGINE_QUANT_VNNI == 2
constexpr int kMBx8Super = 8;
#else
constexpr int kMBx8Super = kMBx8;
#endif

// 4 activation bytes broadcast to every 32-bit lane
inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Prefetches the cache lines of `bytes` bytes at p.
inline void prefetch_lines(const void* p, int32_t bytes) {
  for (int32_t i = 0; i < bytes; i += 64) prefetch_l2(static_cast<const char*>(p) + i);
}

// Part `part` of `parts` of prefetch_lines(p, bytes): the lines that start in its share of the
// bytes (with the line holding p). The super-block kernels spread a block's prefetches over
// its sub-blocks: a burst of 19-27 (Q4_K, Q6_K) stalls on the full line-fill buffers with the
// memory idle in between (measured: half the kernel's samples on the instruction after them).
inline void prefetch_part(const void* p, int32_t bytes, int part, int parts) {
  const auto base = reinterpret_cast<uintptr_t>(p);
  const uintptr_t first = base & ~uintptr_t{63};
  const uintptr_t lo = part == 0 ? first : ((base + static_cast<uintptr_t>(bytes) * part / parts + 63) & ~uintptr_t{63});
  const uintptr_t hi = (base + static_cast<uintptr_t>(bytes) * (part + 1) / parts + 63) & ~uintptr_t{63};
  for (uintptr_t a = lo; a < hi; a += 64) prefetch_l2(reinterpret_cast<const char*>(a));
}

// Integer sums of 16 products per int16 lane stay below 2^15 for levels below 16 (16 * 15 * 127);
// 6-bit levels (Q6_K) take 4 products per lane (4 * 63 * 127) before widening.

// 32 weights of each of 8 rows in nibbles (4 chunks of 32 bytes at qs: positions 8c .. 8c + 3 in
// the low nibbles, 8c + 4 .. 8c + 7 in the high ones) against MB rows' 32 activations xq[m]:
// dot_add'ed into s[m]. With VNNI and one row of x (or !kOneSum) the high nibbles are multiplied
// where they lie (v & 0xf0, 16 times their level, no shift) into sums of their own, exact in int32
// and divided by 16 once. Otherwise they are shifted down, once per chunk for all MB rows, into
// each row's one sum (without VNNI: int16 sums, 16 products of up to 15 * 127 a lane; with it, one
// accumulator a row instead of two: at 8 rows Q4_K's three a row spilled). The same integers.
template <int MB, bool kOneSum = false>
inline void nibble_dots(const uint8_t* qs, const int8_t* const* xq, __m256i* s) {
  const __m256i low4 = _mm256_set1_epi8(0x0f);
#if PYENGINE_QUANT_VNNI
  if constexpr (!kOneSum || MB == 1) {
    __m256i s16[MB];
    for (int m = 0; m < MB; ++m) s16[m] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const __m256i v = load32(qs + 32 * c);
      const __m256i lo = _mm256_and_si256(v, low4), hi16 = _mm256_andnot_si256(low4, v);
      for (int m = 0; m < MB; ++m) {
        s[m] = dot_add(s[m], lo, broadcast4(xq[m] + 8 * c));
        s16[m] = dot_add(s16[m], hi16, broadcast4(xq[m] + 8 * c + 4));
      }
    }
    for (int m = 0; m < MB; ++m) s[m] = _mm256_add_epi32(s[m], _mm256_srai_epi32(s16[m], 4));
    return;
  }
#endif
  for (int c = 0; c < 4; ++c) {
    const __m256i v = load32(qs + 32 * c);
    const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    for (int m = 0; m < MB; ++m) {
      s[m] = dot_add(s[m], lo, broadcast4(xq[m] + 8 * c));
      s[m] = dot_add(s[m], hi, broadcast4(xq[m] + 8 * c + 4));
    }
  }
}

// As nibble_dots, levels of 5 bits: a Q5_Kx8 sub-block or a Q5_0x8 / Q5_1x8 block, its low 4 bits
// in nibbles (qs) and its fifth bits in qh (bit 2c, 2c + 1 of a byte: chunk c's low, high nibble;
// pyengine/cpu_quant.h), the levels (0..31) put together in bytes. Without VNNI two int16 sums
// (chunks 0-1, 2-3: 8 products of up to 31 * 127 a lane each), both scaled by sc into s; with
// VNNI one int32 sum. kScaled false (Q5_0x8, Q5_1x8: a scale per block, applied in fp32): the
// int32 sums, unscaled.
template <int MB, bool kScaled = true>
inline void nibble5_dots(const uint8_t* qs, const uint8_t* qh, const int8_t* const* xq, __m256i sc, __m256i* s) {
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  __m256i h = load32(qh);
  __m256i part[2][MB];
  for (int m = 0; m < MB; ++m) part[0][m] = part[1][m] = _mm256_setzero_si256();
  for (int c = 0; c < 4; ++c) {
    const __m256i v = load32(qs + 32 * c);
    __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    or_fifth_bits(h, lo, hi);
    for (int m = 0; m < MB; ++m) {
#if PYENGINE_QUANT_VNNI
      __m256i& acc = part[0][m];
#else
      __m256i& acc = part[c / 2][m];
#endif
      acc = dot_add(acc, lo, broadcast4(xq[m] + 8 * c));
      acc = dot_add(acc, hi, broadcast4(xq[m] + 8 * c + 4));
    }
  }
  auto widen = [&](__m256i v) { return kScaled ? dot_scaled(v, sc) : dot_lanes(v); };
  for (int m = 0; m < MB; ++m) {
#if PYENGINE_QUANT_VNNI
    s[m] = _mm256_add_epi32(s[m], widen(part[0][m]));
#else
    s[m] = _mm256_add_epi32(s[m], _mm256_add_epi32(widen(part[0][m]), widen(part[1][m])));
#endif
  }
}

#if PYENGINE_QUANT_VNNI == 2
#include "linear_quant_x16_avx512_impl.h"
// M = 1: the integer sums of two blocks at once (zmm); Q4_K and Q6_K where x is spread
// (QuantLinearArgs::xspread)
constexpr bool kBlockPairsM1 = true;
inline bool block_pairs(const QuantLinearArgs& a, int mb) { return mb == 1 && a.xspread != nullptr; }
#else
constexpr bool kBlockPairsM1 = false;
inline bool block_pairs(const QuantLinearArgs&, int) { return false; }
#endif

// Q4_0x8, Q4_Zx8, Q5_0x8, Q5_1x8: unsigned 4- or 5-bit levels less an offset, 8 for Q4_0, 16 for
// Q5_0, each row's own zero point z for Q4_Z; Q5_1 adds each row's m instead.
template <typename B, int MB>
void group_nibbles_x8(const QuantLinearArgs& a, int32_t m0, int32_t g, __m256* out) {
  constexpr bool kZeroPoints = std::is_same_v<B, BlockQ4_Zx8>;
  constexpr bool kMin = std::is_same_v<B, BlockQ5_1x8>;
  constexpr bool kFifthBits = kMin || std::is_same_v<B, BlockQ5_0x8>;
  constexpr bool kPairs = kBlockPairsM1 && MB == 1 && !kFifthBits;
  const int32_t nb = a.K / kQK;
  const auto* w = reinterpret_cast<const B*>(a.w + g * kRows8 * a.wrow_bytes);
  const ActQ8_32* x[MB];
  for (int m = 0; m < MB; ++m) x[m] = reinterpret_cast<const ActQ8_32*>(a.xq + (m0 + m) * a.xrow_bytes);
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
#if PYENGINE_QUANT_VNNI == 2
  [[maybe_unused]] __m512i pair_sums = _mm512_setzero_si512();  // M = 1: blocks b & ~1 and b | 1
#endif
  for (int32_t b = 0; b < nb; ++b) {
    const B& wb = w[b];
    if (MB == 1) prefetch_lines(reinterpret_cast<const char*>(&wb) + kPrefetchM1Bytes, sizeof(B));
    __m256i s[MB];
    for (int m = 0; m < MB; ++m) s[m] = _mm256_setzero_si256();
#if PYENGINE_QUANT_VNNI == 2
    if constexpr (kPairs) {  // blocks two at a time in 512-bit vectors (linear_quant_x16_avx512_impl.h)
      if (b % 2 == 0) {
        const bool two = b + 1 < nb;
        pair_sums = nibble_sums2(wb.qs, two ? sizeof(B) : 0, x[0][b].qs, two ? sizeof(ActQ8_32) : 0);
      }
      s[0] = b % 2 == 0 ? _mm512_castsi512_si256(pair_sums) : _mm512_extracti64x4_epi64(pair_sums, 1);
    }
#endif
    if constexpr (!kPairs) {
      const int8_t* xq[MB];
      for (int m = 0; m < MB; ++m) xq[m] = x[m][b].qs;
      if constexpr (kFifthBits)
        nibble5_dots<MB, false>(wb.qs, wb.qh, xq, _mm256_setzero_si256(), s);  // (int32 sums)
      else
        nibble_dots<MB>(wb.qs, xq, s);
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb.d)));
    [[maybe_unused]] __m256 z = _mm256_setzero_ps();  // Q4_Z: the rows' zero points; Q5_1: their m
    if constexpr (kZeroPoints)
      z = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wb.z))));
    if constexpr (kMin) z = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb.m)));
    for (int m = 0; m < MB; ++m) {
      // d_w * (d_x * sum(q x) - offset * d_x * sum(x)); s8 = 8 d_x sum(x), so s8 / 8 exactly d_x sum(x)
      const __m256 dot = _mm256_cvtepi32_ps(kFifthBits ? s[m] : dot_lanes(s[m]));
      if constexpr (kMin) {  // d_w * d_x * sum(q x) + m * d_x * sum(x)
        acc[m] = _mm256_fmadd_ps(dw, _mm256_mul_ps(dot, _mm256_set1_ps(x[m][b].d)), acc[m]);
        acc[m] = _mm256_fmadd_ps(z, _mm256_set1_ps(x[m][b].s8 * 0.125f), acc[m]);
      } else {
        const __m256 off = kZeroPoints ? _mm256_mul_ps(z, _mm256_set1_ps(x[m][b].s8 * 0.125f))
                                       : _mm256_set1_ps(kFifthBits ? 2.0f * x[m][b].s8 : x[m][b].s8);
        acc[m] = _mm256_fmadd_ps(dw, _mm256_fmsub_ps(dot, _mm256_set1_ps(x[m][b].d), off), acc[m]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = acc[m];
}

// Q8_0x8: signed levels; vpmaddubsw takes |w| and x with w's signs (two products of up to
// 128 * 127 per int16 lane: widened to int32 per chunk).
template <int MB>
void group_q8_0x8(const QuantLinearArgs& a, int32_t m0, int32_t g, __m256* out) {
  const int32_t nb = a.K / kQK;
  const auto* w = reinterpret_cast<const BlockQ8_0x8*>(a.w + g * kRows8 * a.wrow_bytes);
  const ActQ8_32* x[MB];
  for (int m = 0; m < MB; ++m) x[m] = reinterpret_cast<const ActQ8_32*>(a.xq + (m0 + m) * a.xrow_bytes);
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  for (int32_t b = 0; b < nb; ++b) {
    const BlockQ8_0x8& wb = w[b];
    if (MB == 1) prefetch_lines(reinterpret_cast<const char*>(&wb) + kPrefetchM1Bytes, sizeof(BlockQ8_0x8));
    __m256i s[MB];
    for (int m = 0; m < MB; ++m) s[m] = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {  // positions 4c .. 4c + 3
      const __m256i v = load32(wb.qs + 32 * c);
      const __m256i u = _mm256_sign_epi8(v, v);
      for (int m = 0; m < MB; ++m) s[m] = dot_add_wide(s[m], u, _mm256_sign_epi8(broadcast4(x[m][b].qs + 4 * c), v));
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb.d)));
    for (int m = 0; m < MB; ++m)
      acc[m] = _mm256_fmadd_ps(dw, _mm256_mul_ps(_mm256_cvtepi32_ps(s[m]), _mm256_set1_ps(x[m][b].d)), acc[m]);
  }
  for (int m = 0; m < MB; ++m) out[m] = acc[m];
}

// Q4_Kx8, or Q5_Kx8 (B): the sub-blocks' scaled level sums, less the mins' term per super-block.
template <typename B, int MB>
void group_k_min_x8(const QuantLinearArgs& a, int32_t m0, int32_t g, __m256* out) {
  constexpr bool kFifthBits = std::is_same_v<B, BlockQ5_Kx8>;
  const int32_t nb = a.K / kQKK;
  const auto* w = reinterpret_cast<const B*>(a.w + g * kRows8 * a.wrow_bytes);
  const ActQ8_256* x[MB];
  for (int m = 0; m < MB; ++m) x[m] = reinterpret_cast<const ActQ8_256*>(a.xq + (m0 + m) * a.xrow_bytes);
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
#if PYENGINE_QUANT_VNNI == 2
  if constexpr (!kFifthBits)  // (x is spread for Q4_Kx8 only)
    if (block_pairs(a, MB)) {  // blocks two at a time in 512-bit vectors (linear_quant_x16_avx512_impl.h)
      out[0] = group_q4_kx8_pairs(w, nb, a.xspread);
      return;
    }
#endif
  for (int32_t b = 0; b < nb; ++b) {
    const B& whole = w[b];
    const BlockQ4_Kx8& wb = [&]() -> const BlockQ4_Kx8& {
      if constexpr (kFifthBits) return whole.low; else return whole;
    }();
    __m256i sumi[MB];
    for (int m = 0; m < MB; ++m) sumi[m] = _mm256_setzero_si256();
    for (int s = 0; s < 8; ++s) {
      if (MB == 1) prefetch_part(reinterpret_cast<const char*>(&whole) + kPrefetchM1Bytes, sizeof(B), s, 8);
      // the 8 rows' scales of sub-block s, each in both int16 halves of its row's lane
      const __m256i sc = lane_scales_u8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wb.scales + kRows8 * s)));
      const int8_t* xq[MB];
      for (int m = 0; m < MB; ++m) xq[m] = x[m][b].qs + 32 * s;
      if constexpr (kFifthBits) {
        nibble5_dots<MB>(wb.qs + 128 * s, whole.qh[s], xq, sc, sumi);
      } else {
        __m256i s16[MB];
        for (int m = 0; m < MB; ++m) s16[m] = _mm256_setzero_si256();
        nibble_dots<MB, true>(wb.qs + 128 * s, xq, s16);
        for (int m = 0; m < MB; ++m) sumi[m] = _mm256_add_epi32(sumi[m], dot_scaled(s16[m], sc));
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb.d)));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb.dmin)));
    for (int m = 0; m < MB; ++m) {
      // sum over sub-blocks of min * (the sum of x over the sub-block): per pair of sub-blocks,
      // the rows' (min 2p, min 2p + 1) against (x sum 2p, x sum 2p + 1)
      const __m256i sums = _mm256_madd_epi16(load32(x[m][b].bsums), ones);  // x sums of sub-blocks 0..7
      alignas(32) int32_t pairs[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(pairs), _mm256_packs_epi32(sums, sums));  // 0,1 2,3 . . 4,5 6,7
      __m256i minsum = _mm256_setzero_si256();
      for (int p = 0; p < 4; ++p) {
        const __m256i mins = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb.mins + 16 * p)));
        minsum = _mm256_add_epi32(minsum, _mm256_madd_epi16(mins, _mm256_set1_epi32(pairs[p < 2 ? p : p + 2])));
      }
      const __m256 dx = _mm256_set1_ps(x[m][b].d);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[m]), _mm256_mul_ps(d, dx), acc[m]);
      acc[m] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(minsum), _mm256_mul_ps(dmin, dx), acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = acc[m];
}

template <int MB>
void group_q6_kx8(const QuantLinearArgs& a, int32_t m0, int32_t g, __m256* out) {
  const int32_t nb = a.K / kQKK;
  const auto* w = reinterpret_cast<const BlockQ6_Kx8*>(a.w + g * kRows8 * a.wrow_bytes);
  const ActQ8_256* x[MB];
  for (int m = 0; m < MB; ++m) x[m] = reinterpret_cast<const ActQ8_256*>(a.xq + (m0 + m) * a.xrow_bytes);
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0f), top2 = _mm256_set1_epi8(0x30);
  // from a pair of sub-blocks' scales ([row][2] bytes), the first's or second's: one byte per row
  const __m128i pick[2] = {_mm_set_epi8(-1, -1, -1, -1, -1, -1, -1, -1, 14, 12, 10, 8, 6, 4, 2, 0),
                           _mm_set_epi8(-1, -1, -1, -1, -1, -1, -1, -1, 15, 13, 11, 9, 7, 5, 3, 1)};
#if PYENGINE_QUANT_VNNI == 2
  [[maybe_unused]] __m512i pair_sums = _mm512_setzero_si512();  // M = 1: blocks b & ~1 and b | 1
#endif
  const bool pairs = block_pairs(a, MB);
  for (int32_t b = 0; b < nb; ++b) {
    const BlockQ6_Kx8& wb = w[b];
    __m256i sumi[MB];
    for (int m = 0; m < MB; ++m) sumi[m] = _mm256_setzero_si256();
#if PYENGINE_QUANT_VNNI == 2
    if (pairs)  // blocks two at a time in 512-bit vectors (linear_quant_x16_avx512_impl.h)
      sumi[0] = block_pair_sums(b, nb, pair_sums, [&](bool two) {
        return q6_k_sums2(wb, a.xspread + (b / 2) * kSpreadPairBytes, two);
      });
#endif
    for (int s = 0; s < (pairs ? 0 : 16); ++s) {
      if (MB == 1) prefetch_part(reinterpret_cast<const char*>(&wb) + kPrefetchM1Bytes, sizeof(BlockQ6_Kx8), s, 16);
      const __m128i pair = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb.scales + 16 * (s / 2)));
      const __m256i sc = lane_scales_i8(_mm_shuffle_epi8(pair, pick[s % 2]));
      const __m256i A = load32(wb.q[s]), B = load32(wb.q[s] + 32), H = load32(wb.q[s] + 64);
      const __m256i v0 = _mm256_or_si256(_mm256_and_si256(A, low4), _mm256_and_si256(_mm256_slli_epi16(H, 4), top2));
      const __m256i v1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(A, 4), low4),
                                         _mm256_and_si256(_mm256_slli_epi16(H, 2), top2));
      const __m256i v2 = _mm256_or_si256(_mm256_and_si256(B, low4), _mm256_and_si256(H, top2));
      const __m256i v3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(B, 4), low4),
                                         _mm256_and_si256(_mm256_srli_epi16(H, 2), top2));
      const __m256i zero = _mm256_setzero_si256();
      for (int m = 0; m < MB; ++m) {
        const int8_t* xq = x[m][b].qs + 16 * s;
        const __m256i p01 = dot_add(dot_add(zero, v0, broadcast4(xq)), v1, broadcast4(xq + 4));
#if PYENGINE_QUANT_VNNI  // int32 sums: all 16 products in one accumulator, one scaling
        const __m256i p = dot_add(dot_add(p01, v2, broadcast4(xq + 8)), v3, broadcast4(xq + 12));
        sumi[m] = _mm256_add_epi32(sumi[m], dot_scaled(p, sc));
#else  // int16 sums: 8 products of up to 63 * 127 would overflow; two halves
        const __m256i p23 = dot_add(dot_add(zero, v2, broadcast4(xq + 8)), v3, broadcast4(xq + 12));
        sumi[m] = _mm256_add_epi32(sumi[m], _mm256_add_epi32(dot_scaled(p01, sc), dot_scaled(p23, sc)));
#endif
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb.d)));
    for (int m = 0; m < MB; ++m) {
      // the levels are stored + 32: take 32 * sum_s scale_s * (the sum of x over sub-block s) off
      __m256i corr = _mm256_setzero_si256();
      for (int p = 0; p < 8; ++p) {
        int32_t xs;
        std::memcpy(&xs, x[m][b].bsums + 2 * p, 4);
        const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb.scales + 16 * p)));
        corr = _mm256_add_epi32(corr, _mm256_madd_epi16(sc, _mm256_set1_epi32(xs)));
      }
      const __m256i total = _mm256_sub_epi32(sumi[m], _mm256_slli_epi32(corr, 5));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, _mm256_set1_ps(x[m][b].d)), acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = acc[m];
}

template <int MB>
void group_x8(const QuantLinearArgs& a, int32_t m0, int32_t g, __m256* out) {
  switch (a.type) {
    case QuantType::kQ4_0x8: return group_nibbles_x8<BlockQ4_0x8, MB>(a, m0, g, out);
    case QuantType::kQ8_0x8: return group_q8_0x8<MB>(a, m0, g, out);
    case QuantType::kQ4_Zx8: return group_nibbles_x8<BlockQ4_Zx8, MB>(a, m0, g, out);
    case QuantType::kQ5_0x8: return group_nibbles_x8<BlockQ5_0x8, MB>(a, m0, g, out);
    case QuantType::kQ5_1x8: return group_nibbles_x8<BlockQ5_1x8, MB>(a, m0, g, out);
    case QuantType::kQ4_Kx8: return group_k_min_x8<BlockQ4_Kx8, MB>(a, m0, g, out);
    case QuantType::kQ5_Kx8: return group_k_min_x8<BlockQ5_Kx8, MB>(a, m0, g, out);
    default: return group_q6_kx8<MB>(a, m0, g, out);
  }
}

template <int MB = kMBx8>
void group_x8_upto(int mb, const QuantLinearArgs& a, int32_t m0, int32_t g, __m256* out) {
  if constexpr (MB > 1) {
    if (mb < MB) return group_x8_upto<MB - 1>(mb, a, m0, g, out);
  }
  group_x8<MB>(a, m0, g, out);
}

// Weight rows [n0, n1) (whole groups of 8) against every row of x, MB rows of x a pass.
template <int MB>
void rows_x8_tiles(const QuantLinearArgs& a, int32_t n0, int32_t n1) {
  __m256 out[MB];
  for (int32_t g = n0 / kRows8; g < n1 / kRows8; ++g) {
    const __m256 bias = a.bias != nullptr ? _mm256_loadu_ps(a.bias + kRows8 * g) : _mm256_setzero_ps();
    for (int32_t m0 = 0; m0 < a.M; m0 += MB) {
      const int mb = std::min<int32_t>(MB, a.M - m0);
      group_x8_upto<MB>(mb, a, m0, g, out);
      for (int m = 0; m < mb; ++m)
        _mm256_storeu_ps(a.y + (m0 + m) * a.ldy + kRows8 * g, a.bias != nullptr ? _mm256_add_ps(out[m], bias) : out[m]);
    }
  }
}

void rows_x8(const QuantLinearArgs& a, int32_t n0, int32_t n1) {
  if (act_block_elems(a.type) == kQKK) return rows_x8_tiles<kMBx8Super>(a, n0, n1);
  rows_x8_tiles<kMBx8>(a, n0, n1);
}
