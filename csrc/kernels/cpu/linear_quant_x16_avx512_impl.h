// The AVX512-VNNI build's batch-1 (M = 1) inner loop for the 4- and 6-bit interleaved layouts
// (Q4_0x8, Q4_Zx8, Q4_Kx8, Q6_Kx8): the integer sums of two consecutive blocks of a group of 8
// weight rows at once, in 512-bit vectors (lanes 0-7 block b, lanes 8-15 block b + 1). Why: at
// one row of x these kernels are bound by their instruction count (unpacking, per-sub-block
// scaling), in L2 on one thread of a 2-core Xeon (1024 x 1024): Q4_0 33.5 -> 40.3 GB/s, Q4_K
// 29.0 -> 35.2, Q6_K 25.6 -> 27.9 (the same host in a slower hour gave 40 -> 42.5 for Q4_K);
// from DRAM, where one thread reads ~15 GB/s, Q4_K and Q6_K kept up with the memory only
// partly (2-4% less time with this), Q4_0 within the noise. Two consecutive blocks keep the
// weights one forward stream: two groups side by side instead (two streams 8 rows apart)
// computed faster in L2 but read slower from DRAM, 2-10% below the 8-lane code.
//
// The integer sums are exact and the callers (group_nibbles_x8, group_q4_kx8, group_q6_kx8)
// scale them into fp32 block by block as before, so the results are the same bits as the
// 8-lane code's.
//
// Included inside the anonymous namespace of linear_quant_x8_avx2_impl.h (its helpers in scope),
// only where PYENGINE_QUANT_VNNI == 2 (the avx512 level's VNNI build).

// 32 bytes at p (lanes 0-7) and 32 at p + gap (lanes 8-15), as one vector
inline __m512i load2x32(const uint8_t* p, int64_t gap) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(load32(p)), load32(p + gap), 1);
}

// 16 bytes at p and 16 at p + gap, as one 256-bit vector
inline __m256i load2x16(const void* p, int64_t gap) {
  const auto* c = static_cast<const char*>(p);
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c))),
                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + gap)), 1);
}

// 8 bytes at p and 8 at p + gap, as the low 16 bytes of a vector
inline __m128i load2x8(const void* p, int64_t gap) {
  const auto* c = static_cast<const char*>(p);
  return _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c)),
                            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + gap)));
}

// The permutation that spreads 4-byte group j of each half of a vector of x (two blocks' 32
// bytes, load2x32) over that half's lanes.
inline __m512i x_index(int j) { return _mm512_set_epi32(8 + j, 8 + j, 8 + j, 8 + j, 8 + j, 8 + j, 8 + j, 8 + j,
                                                         j, j, j, j, j, j, j, j); }

// Q4_K and Q6_K: x spread once a call by each thread (spread_activation_pairs), each product's
// activations one load from L1 (a memory operand of vpdpbusd) instead of a shuffle per product in
// every group of 8 weight rows (1024 x 1024 in L2, one thread: Q6_K 33 -> 24-25 us, Q4_K 17.2 ->
// 15.5-16.6).
// `xs`: the pair's spread x; group j's 64 bytes.
inline __m512i spread_group(const uint8_t* xs, int j) {
  return _mm512_load_si512(reinterpret_cast<const __m512i*>(xs + 64 * j));
}

// The integer dot products of the nibbles of two 32-weight blocks of a group (Q4_0x8, Q4_Zx8:
// qs at q, the next block's bgap bytes on) with their activations (x's next block xgap bytes
// on; both gaps 0: the same block again): lanes 0-7 the first block's rows, 8-15 the second's,
// as nibble_dots sums them. Here x is shuffled per product, not spread: with spread x (8 loads a
// pair of blocks instead of 8 shuffles) this ran 4% slower in L2 and from DRAM. (Taking the
// blocks and a flag, as q4_k_sums2 does, it ran 10% slower in L2.)
inline __m512i nibble_sums2(const uint8_t* q, int64_t bgap, const int8_t* xq, int64_t xgap) {
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  const __m512i xs = load2x32(reinterpret_cast<const uint8_t*>(xq), xgap);
  __m512i lo_sum = _mm512_setzero_si512(), hi_sum = _mm512_setzero_si512();
  for (int c = 0; c < 4; ++c) {
    const __m512i v = load2x32(q + 32 * c, bgap);
    lo_sum = _mm512_dpbusd_epi32(lo_sum, _mm512_and_si512(v, low4), _mm512_permutexvar_epi32(x_index(2 * c), xs));
    hi_sum = _mm512_dpbusd_epi32(hi_sum, _mm512_andnot_si512(low4, v), _mm512_permutexvar_epi32(x_index(2 * c + 1), xs));
  }
  return _mm512_add_epi32(lo_sum, _mm512_srai_epi32(hi_sum, 4));
}

// The integer sums over the 8 sub-blocks of Q4_Kx8 block wb (lanes 0-7) and the next (lanes
// 8-15; !two: wb again), scaled by the sub-blocks' scales; xs: the pair's spread activations.
inline __m512i q4_k_sums2(const BlockQ4_Kx8& wb, const uint8_t* xs, bool two) {
  const int64_t bgap = two ? sizeof(BlockQ4_Kx8) : 0;
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  const auto* base = reinterpret_cast<const uint8_t*>(&wb);
  __m512i sumi = _mm512_setzero_si512();
  for (int s = 0; s < 8; ++s) {
    prefetch_part(base + kPrefetchM1Bytes, static_cast<int32_t>(2 * sizeof(BlockQ4_Kx8)), s, 8);
    const __m512i sc = _mm512_cvtepu8_epi32(load2x8(wb.scales + kRows8 * s, bgap));
    __m512i lo_sum = _mm512_setzero_si512(), hi_sum = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {  // as nibble_dots: high nibbles multiplied in place (x16)
      const __m512i v = load2x32(wb.qs + 128 * s + 32 * c, bgap);
      lo_sum = _mm512_dpbusd_epi32(lo_sum, _mm512_and_si512(v, low4), spread_group(xs, 8 * s + 2 * c));
      hi_sum = _mm512_dpbusd_epi32(hi_sum, _mm512_andnot_si512(low4, v), spread_group(xs, 8 * s + 2 * c + 1));
    }
    sumi = _mm512_add_epi32(sumi, _mm512_mullo_epi32(_mm512_add_epi32(lo_sum, _mm512_srai_epi32(hi_sum, 4)), sc));
  }
  return sumi;
}

// As q4_k_sums2, Q6_Kx8 (the levels as stored, + 32). Fewer instructions than the 8-lane code
// per sub-block: a pair of sub-blocks' scales widened once ([row][2] int8 -> int16, then each
// int32 lane's low or high half), and each 6-bit level as one bit-select (low nibble from the
// low-bits byte, the rest from the shifted high-bits byte) and a mask.
inline __m512i q6_k_sums2(const BlockQ6_Kx8& wb, const uint8_t* xs, bool two) {
  const int64_t bgap = two ? sizeof(BlockQ6_Kx8) : 0;
  const __m512i low4 = _mm512_set1_epi8(0x0f), low6 = _mm512_set1_epi8(0x3f);
  // bitwise low4 ? a : b
  const auto select = [&](__m512i a, __m512i b) { return _mm512_ternarylogic_epi32(low4, a, b, 0xca); };
  const auto* base = reinterpret_cast<const uint8_t*>(&wb);
  __m512i sumi = _mm512_setzero_si512(), pair_scales = _mm512_setzero_si512();
  for (int s = 0; s < 16; ++s) {
    prefetch_part(base + kPrefetchM1Bytes, static_cast<int32_t>(2 * sizeof(BlockQ6_Kx8)), s, 16);
    if (s % 2 == 0)  // int32 lane r (0-7 block b, 8-15 the next): row r's scales of sub-blocks s (low half), s + 1 (high)
      pair_scales = _mm512_cvtepi8_epi16(load2x16(wb.scales + 16 * (s / 2), bgap));
    const __m512i sc = s % 2 == 0 ? _mm512_srai_epi32(_mm512_slli_epi32(pair_scales, 16), 16)
                                  : _mm512_srai_epi32(pair_scales, 16);
    const __m512i A = load2x32(wb.q[s], bgap), B = load2x32(wb.q[s] + 32, bgap), H = load2x32(wb.q[s] + 64, bgap);
    const __m512i v0 = _mm512_and_si512(select(A, _mm512_slli_epi16(H, 4)), low6);
    const __m512i v1 = _mm512_and_si512(select(_mm512_srli_epi16(A, 4), _mm512_slli_epi16(H, 2)), low6);
    const __m512i v2 = _mm512_and_si512(select(B, H), low6);
    const __m512i v3 = _mm512_and_si512(select(_mm512_srli_epi16(B, 4), _mm512_srli_epi16(H, 2)), low6);
    __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v0, spread_group(xs, 4 * s));
    p = _mm512_dpbusd_epi32(p, v1, spread_group(xs, 4 * s + 1));
    p = _mm512_dpbusd_epi32(p, v2, spread_group(xs, 4 * s + 2));
    p = _mm512_dpbusd_epi32(p, v3, spread_group(xs, 4 * s + 3));
    sumi = _mm512_add_epi32(sumi, _mm512_mullo_epi32(p, sc));
  }
  return sumi;
}

// Block b's integer sums from sums(two) -- the sums of blocks b and b + 1 (two: b + 1 < nb), which
// it computes at every even b into `pair` -- lanes 0-7 for an even b, 8-15 for an odd one.
template <typename Sums>
inline __m256i block_pair_sums(int32_t b, int32_t nb, __m512i& pair, Sums sums) {
  if (b % 2 == 0) pair = b + 1 < nb ? sums(true) : sums(false);
  return b % 2 == 0 ? _mm512_castsi512_si256(pair) : _mm512_extracti64x4_epi64(pair, 1);
}

// spread_activation_pairs' body (the exported function calls it, outside the anonymous namespace)
inline void spread_pairs(const uint8_t* xq, int32_t K, uint8_t* out) {
  const int32_t nb = K / kQKK;
  const auto* x = reinterpret_cast<const ActQ8_256*>(xq);
  for (int32_t b = 0; b < nb; b += 2) {
    const auto* x0 = reinterpret_cast<const uint8_t*>(x[b].qs);
    const int64_t gap = b + 1 < nb ? sizeof(ActQ8_256) : 0;
    for (int32_t c = 0; c < kQKK / 32; ++c) {  // 8 groups at a time
      const __m512i xs = load2x32(x0 + 32 * c, gap);
      for (int j = 0; j < 8; ++j)
        _mm512_store_si512(reinterpret_cast<__m512i*>(out + 64 * (8 * c + j)), _mm512_permutexvar_epi32(x_index(j), xs));
    }
    // (kSpreadPairBytes) lanes 0-7 block b, 8-15 the next (a lone last block: b again)
    auto* pair_sums = reinterpret_cast<uint32_t*>(out + kSpreadSums);
    auto* d = reinterpret_cast<float*>(out + kSpreadD);
    for (int half = 0; half < 2; ++half) {
      const ActQ8_256& xb = x[half == 0 || gap == 0 ? b : b + 1];
      for (int p = 0; p < 4; ++p) {  // the sums over sub-blocks 2p, 2p + 1 (32 values each; |sum| <= 4096)
        const auto s0 = static_cast<int16_t>(xb.bsums[4 * p] + xb.bsums[4 * p + 1]);
        const auto s1 = static_cast<int16_t>(xb.bsums[4 * p + 2] + xb.bsums[4 * p + 3]);
        const uint32_t packed = static_cast<uint16_t>(s0) | static_cast<uint32_t>(static_cast<uint16_t>(s1)) << 16;
        for (int r = 0; r < kRows8; ++r) pair_sums[16 * p + 8 * half + r] = packed;
      }
      for (int r = 0; r < kRows8; ++r) d[8 * half + r] = xb.d;
    }
    out += kSpreadPairBytes;
  }
}

// Q4_Kx8 blocks wb (lanes 0-7) and the next (8-15; !two: wb again): per row, the sum over the
// sub-blocks of min times x's sum over the sub-block (the mins' term), from x's sums as spread.
inline __m512i q4_k_min_sums2(const BlockQ4_Kx8& wb, const uint8_t* xs, bool two) {
  const int64_t bgap = two ? sizeof(BlockQ4_Kx8) : 0;
  __m512i sum = _mm512_setzero_si512();
  for (int p = 0; p < 4; ++p)  // mins [pair][row][2] as int16 pairs against the sums' int16 pairs
    sum = _mm512_dpwssd_epi32(sum, _mm512_cvtepu8_epi16(load2x16(wb.mins + 16 * p, bgap)),
                              spread_group(xs + kSpreadSums, p));
  return sum;
}

// lanes 8-15
inline __m256 high_half(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }

// Q4_Kx8, one row of x: blocks two at a time (q4_k_sums2, q4_k_min_sums2, their scales in 512-bit
// vectors), then added into acc block by block in the 8-lane code's order, with the same
// products: the same bits as the 8-lane code, in about 20 instructions a pair of blocks instead of
// 60 for the scaling.
inline __m256 group_q4_kx8_pairs(const BlockQ4_Kx8* w, int32_t nb, const uint8_t* xspread) {
  __m256 acc = _mm256_setzero_ps();
  for (int32_t b = 0; b < nb; b += 2) {
    const bool two = b + 1 < nb;
    const int64_t bgap = two ? sizeof(BlockQ4_Kx8) : 0;
    const uint8_t* xs = xspread + (b / 2) * kSpreadPairBytes;
    const __m512 sumi = _mm512_cvtepi32_ps(q4_k_sums2(w[b], xs, two));
    const __m512 mins = _mm512_cvtepi32_ps(q4_k_min_sums2(w[b], xs, two));
    const __m512 dx = _mm512_load_ps(reinterpret_cast<const float*>(xs + kSpreadD));
    const __m512 d = _mm512_mul_ps(_mm512_cvtph_ps(load2x16(w[b].d, bgap)), dx);
    const __m512 dmin = _mm512_mul_ps(_mm512_cvtph_ps(load2x16(w[b].dmin, bgap)), dx);
    acc = _mm256_fmadd_ps(_mm512_castps512_ps256(sumi), _mm512_castps512_ps256(d), acc);
    acc = _mm256_fnmadd_ps(_mm512_castps512_ps256(mins), _mm512_castps512_ps256(dmin), acc);
    if (two) {
      acc = _mm256_fmadd_ps(high_half(sumi), high_half(d), acc);
      acc = _mm256_fnmadd_ps(high_half(mins), high_half(dmin), acc);
    }
  }
  return acc;
}
