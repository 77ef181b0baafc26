// The decode kernel of the paged-attention back end (included by attention_impl.h inside the
// level's namespace): the G rows of one query position -- the query heads of one KV head --
// against a KV range, written once over a small vector interface with an AVX-512 (16 lanes) and
// an AVX2 (8 lanes) implementation.
//
// Why a kernel of its own: the block kernels pay per 16-key block for a max, an exp of the
// running max and a rescale of the accumulators, stage bf16/fp16 blocks as fp32 in scratch, and
// run P.V with one FMA chain per row (latency-bound). Here the keys go in chunks of
// kDecodeChunk positions (aligned to absolute positions, across blocks): scores for the whole
// chunk, one online-softmax update per chunk, P.V over several vectors of head_dim per row at
// once (independent FMA chains), K/V widened to fp32 in registers, and the next chunk's K/V rows
// prefetched while this chunk's scores are computed. Measured on a 2-core AMD EPYC (AVX-512),
// 64 sequences x 335 positions, 3 KV heads x 64, from DRAM: fp32 21 -> 30 GB/s, bf16 14 -> 28 GB/s.
// The scores take several keys a pass (decode_score_keys: >= 8 independent FMA chains, where one
// key's R rows gave R), and the prefetches run one (head, chunk) ahead, so that a context of one
// chunk -- every decode step of the first 32 positions -- is prefetched too, head after head.
// Measured on a 2-core Xeon (AVX-512), the W5 model's 28 layers x 8 KV heads x 128 (fp16), a
// sequence from DRAM, the sum of per-layer medians: one thread 263-272 -> 204-216 us at 16
// positions, 817-839 -> 726-752 at 64, 1,562-1,603 -> 1,428-1,462 at 128; two threads 4-10% less
// time; in the engine (Q4_K, 128 tokens from a 1-token prompt) 698-709 -> 644-657 us a step.
//
// head_dim must be a multiple of 16 (the callers fall back to the block kernels otherwise).

#if defined(PYENGINE_ATTN_AVX512) || defined(PYENGINE_ATTN_AVX2)
#define PYENGINE_ATTN_DECODE 1

constexpr int32_t kDecodeChunk = 32;
constexpr int64_t kDecodeScoreStride = kDecodeChunk + 16;

#ifdef PYENGINE_ATTN_AVX512
struct DecodeVec {
  using V = __m512;
  static constexpr int kW = 16;
  static constexpr int kPvVectors = 4;  // vectors of head_dim per row in one P.V pass (4 x R <= 16 chains)
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const bf16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static V load(const fp16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static void store(float* p, V x) { _mm512_storeu_ps(p, x); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  // the sums of kW vectors of stage (kW floats apart), one per lane
  static V hsum_all(const float* stage) { return hsum16x16(stage); }
  // max(m, x) in the lanes below n, m elsewhere
  static V max_live(V m, V x, int32_t n) { return _mm512_mask_max_ps(m, tail_mask(n), m, x); }
  // e^(x - mx) in the lanes below n, 0 elsewhere
  static V exp_live(V x, V mx, int32_t n) { return _mm512_maskz_mov_ps(tail_mask(n), exp_neg_v(_mm512_sub_ps(x, mx))); }
  static float reduce_add(V x) { return _mm512_reduce_add_ps(x); }
  static float reduce_max(V x) { return _mm512_reduce_max_ps(x); }
};
#else
struct DecodeVec {
  using V = __m256;
  static constexpr int kW = 8;
  static constexpr int kPvVectors = 2;  // 2 x R <= 8 accumulators of the 16 ymm registers
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const bf16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static V load(const fp16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static void store(float* p, V x) { _mm256_storeu_ps(p, x); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V hsum_all(const float* stage) { return hsum8x8(stage); }
  static V max_live(V m, V x, int32_t n) {
    return _mm256_max_ps(m, _mm256_blendv_ps(m, x, _mm256_castsi256_ps(lanes_below(n))));
  }
  static V exp_live(V x, V mx, int32_t n) {
    return _mm256_and_ps(_mm256_castsi256_ps(lanes_below(n)), exp_neg_v8(_mm256_sub_ps(x, mx)));
  }
  static float reduce_add(V x) { return hsum8(x); }
  static float reduce_max(V x) { return hmax8(x); }
};
#endif

template <typename KV>
static inline void prefetch_kv_row(const KV* row, int32_t d) {
  const char* c = reinterpret_cast<const char*>(row);
  const int32_t bytes = d * static_cast<int32_t>(sizeof(KV));
  for (int32_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, 0, 2);
}

// Keys a score pass takes at once: KB keys x R rows of independent FMA chains (>= 8 to cover the
// FMA latency; within the vector registers: 16 ymm for AVX2, 32 zmm for AVX-512). Divides kW.
template <typename VT, int R>
constexpr int decode_score_keys() {
  return R == 1 ? 8 : (R == 2 || VT::kW == 16) ? 4 : 2;
}

// Scores of R rows (q: R rows, d apart) against the n (<= kDecodeChunk) keys at element offsets
// off[] of k, into s (rows kDecodeScoreStride apart); prefetches the K/V rows at next[0, n_next)
// of pk and pv. Lanes of s at n and beyond hold the last key's scores again (finite; the callers
// mask them).
template <typename VT, typename KV, int R>
static inline void decode_scores(const float* __restrict q, const KV* __restrict k, const KV* pk, const KV* pv,
                                 const int64_t* off, int32_t n, const int64_t* next, int32_t n_next, int32_t d,
                                 float* __restrict s, float* __restrict stage) {
  using V = typename VT::V;
  constexpr int W = VT::kW;
  constexpr int KB = decode_score_keys<VT, R>();
  for (int32_t j0 = 0; j0 < n; j0 += W) {
    for (int32_t j = 0; j < W; j += KB) {
      const KV* kr[KB];
      for (int b = 0; b < KB; ++b) kr[b] = k + off[imin(j0 + j + b, n - 1)];
      V acc[KB][R];
      for (int b = 0; b < KB; ++b)
        for (int r = 0; r < R; ++r) acc[b][r] = VT::zero();
      for (int32_t i = 0; i < d; i += W) {
        V qv[R];
        for (int r = 0; r < R; ++r) qv[r] = VT::load(q + static_cast<int64_t>(r) * d + i);
        for (int b = 0; b < KB; ++b) {
          const V kv = VT::load(kr[b] + i);
          for (int r = 0; r < R; ++r) acc[b][r] = VT::fmadd(qv[r], kv, acc[b][r]);
        }
      }
      for (int b = 0; b < KB; ++b) {
        if (j0 + j + b < n_next) {
          prefetch_kv_row(pk + next[j0 + j + b], d);
          prefetch_kv_row(pv + next[j0 + j + b], d);
        }
        for (int r = 0; r < R; ++r) VT::store(stage + W * W * r + W * (j + b), acc[b][r]);
      }
    }
    for (int r = 0; r < R; ++r) VT::store(s + r * kDecodeScoreStride + j0, VT::hsum_all(stage + W * W * r));
  }
}

// One chunk of n keys for R rows: scores, the online-softmax update (running max m, sum l), and
// acc = acc * alpha + P.V (alpha = e^(m_old - m_new), 0 for the first keys).
template <typename VT, typename KV, int R>
static inline void decode_chunk(const float* __restrict q, const KV* __restrict k, const KV* __restrict v,
                                const KV* pk, const KV* pv, const int64_t* off, int32_t n, const int64_t* next,
                                int32_t n_next, int32_t d,
                                float cap, float* __restrict acc, float* m, float* l, float* __restrict stage) {
  using V = typename VT::V;
  constexpr int W = VT::kW;
  constexpr int NV = VT::kPvVectors;
  alignas(64) float s[R * kDecodeScoreStride];
  decode_scores<VT, KV, R>(q, k, pk, pv, off, n, next, n_next, d, s, stage);
  float alpha[R];
  for (int r = 0; r < R; ++r) {
    float* sr = s + r * kDecodeScoreStride;
    if (cap > 0.0f) softcap_row(sr, 0, n, cap);
    V mx = VT::set1(kNegInf);
    for (int32_t t0 = 0; t0 < n; t0 += W) mx = VT::max_live(mx, VT::load(sr + t0), n - t0);
    const float m_old = m[r];
    const float m_chunk = VT::reduce_max(mx);
    const float m_new = m_chunk > m_old ? m_chunk : m_old;
    const V mv = VT::set1(m_new);
    V sum = VT::zero();
    for (int32_t t0 = 0; t0 < n; t0 += W) {
      const V pv = VT::exp_live(VT::load(sr + t0), mv, n - t0);
      VT::store(sr + t0, pv);
      sum = VT::add(sum, pv);
    }
    alpha[r] = m_new > m_old ? (m_old == kNegInf ? 0.0f : exp_neg(m_old - m_new)) : 1.0f;
    l[r] = l[r] * alpha[r] + VT::reduce_add(sum);
    m[r] = m_new;
  }
  for (int32_t i0 = 0; i0 < d; i0 += NV * W) {
    const int32_t nc = imin(NV, (d - i0) / W);
    V ac[R][NV];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < NV; ++c)
        ac[r][c] = c < nc ? VT::mul(VT::load(acc + static_cast<int64_t>(r) * d + i0 + W * c), VT::set1(alpha[r]))
                          : VT::zero();
    if (nc == NV) {
      for (int32_t t = 0; t < n; ++t) {
        const KV* vr = v + off[t] + i0;
        V vv[NV];
        for (int c = 0; c < NV; ++c) vv[c] = VT::load(vr + W * c);
        for (int r = 0; r < R; ++r) {
          const V p = VT::set1(s[r * kDecodeScoreStride + t]);
          for (int c = 0; c < NV; ++c) ac[r][c] = VT::fmadd(p, vv[c], ac[r][c]);
        }
      }
    } else {
      for (int32_t t = 0; t < n; ++t) {
        const KV* vr = v + off[t] + i0;
        for (int c = 0; c < nc; ++c) {
          const V vv = VT::load(vr + W * c);
          for (int r = 0; r < R; ++r) ac[r][c] = VT::fmadd(VT::set1(s[r * kDecodeScoreStride + t]), vv, ac[r][c]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < nc; ++c) VT::store(acc + static_cast<int64_t>(r) * d + i0 + W * c, ac[r][c]);
  }
}

template <typename VT, typename KV>
static inline void decode_chunk_rows(int32_t R, const float* q, const KV* k, const KV* v, const KV* pk,
                                     const KV* pv, const int64_t* off, int32_t n, const int64_t* next,
                                     int32_t n_next, int32_t d, float cap, float* acc, float* m, float* l,
                                     float* stage) {
  switch (R) {
    case 1:
      return decode_chunk<VT, KV, 1>(q, k, v, pk, pv, off, n, next, n_next, d, cap, acc, m, l, stage);
    case 2:
      return decode_chunk<VT, KV, 2>(q, k, v, pk, pv, off, n, next, n_next, d, cap, acc, m, l, stage);
    case 3:
      return decode_chunk<VT, KV, 3>(q, k, v, pk, pv, off, n, next, n_next, d, cap, acc, m, l, stage);
    default:
      return decode_chunk<VT, KV, 4>(q, k, v, pk, pv, off, n, next, n_next, d, cap, acc, m, l, stage);
  }
}

// Element offsets (from the cache base) of the K/V rows of positions [c0, c1) of one KV head.
static inline int32_t decode_offsets(const int32_t* btab, int32_t c0, int32_t c1, int32_t T, int32_t H,
                                     int32_t kv_head, int32_t d, int64_t* off) {
  for (int32_t t = c0; t < c1; ++t)
    off[t - c0] = ((static_cast<int64_t>(btab[t / T]) * H + kv_head) * T + t % T) * d;
  return c1 > c0 ? c1 - c0 : 0;
}

// The G rows (Q, acc: d apart; m, l: one per row) of each of `heads` KV heads from kv_head (rows
// head-major) of one query position against keys [a, e), in row groups of up to 4 per chunk
// (each chunk's K/V stays in cache across the groups). Chunk by chunk, the heads one after
// another: their slices of a block lie side by side, so the reads run through the block in order.
// `stage`: 4 * kW * kW floats.
template <typename VT, typename KV>
static void decode_rows(const float* Q, int32_t G, int32_t heads, const KV* k, const KV* v, const int32_t* btab,
                        int32_t T, int32_t H, int32_t kv_head, int32_t a, int32_t e, int32_t d, float cap,
                        float* acc, float* m, float* l, float* stage) {
  int64_t offs[2][kDecodeChunk];
  int32_t cur = 0;
  int32_t c1 = imin(e, (a / kDecodeChunk + 1) * kDecodeChunk);
  int32_t n = decode_offsets(btab, a, c1, T, H, kv_head, d, offs[cur]);
  for (int32_t t = 0; t < n; ++t) {  // the first head's first chunk; the rest a (head, chunk) ahead
    prefetch_kv_row(k + offs[cur][t], d);
    prefetch_kv_row(v + offs[cur][t], d);
  }
  while (n > 0) {
    const int32_t n1 = imin(e, c1 + kDecodeChunk);
    const int32_t n_next = decode_offsets(btab, c1, n1, T, H, kv_head, d, offs[cur ^ 1]);
    for (int32_t h = 0; h < heads; ++h) {
      const int64_t slice = static_cast<int64_t>(h) * T * d;  // head kv_head + h's rows of a block
      // what comes next: this chunk of the next head, or the next chunk of the first
      const bool last = h + 1 == heads;
      const int64_t next_slice = last ? 0 : slice + static_cast<int64_t>(T) * d;
      const int64_t* next = last ? offs[cur ^ 1] : offs[cur];
      const int32_t nn = last ? n_next : n;
      for (int32_t g0 = 0; g0 < G; g0 += 4) {
        const int64_t r = static_cast<int64_t>(h) * G + g0;
        decode_chunk_rows<VT, KV>(imin(4, G - g0), Q + r * d, k + slice, v + slice, k + next_slice, v + next_slice,
                                  offs[cur], n, next, g0 == 0 ? nn : 0, d, cap, acc + r * d, m + r, l + r, stage);
      }
    }
    c1 = n1;
    n = n_next;
    cur ^= 1;
  }
}

#endif  // PYENGINE_ATTN_AVX512 || PYENGINE_ATTN_AVX2
