// paged_attention and store_kv (pyengine/kernels.h) at every instruction-set level this CPU has,
// against naive double-precision references.
//
// paged_attention: small random paged caches (block ids shuffled, a sequence's unused slots and
// the spare blocks filled with NaN, so a kernel that touched them would return NaN), query and
// output rows with padding (the output padding must keep its sentinel), fp32 / bf16 / fp16
// queries and caches: decode rows, a prefill chunk after earlier KV, a full prefill, a sequence
// with no query rows in the batch, MHA / GQA / MQA, head_dim 64, 80, 96, 128, 40 and 12, up to
// 9 query heads per KV head, a sliding window
// (with the blocks no query can see absent from the block table), a long context that the
// kernel splits across threads (split-K), 1 and 3 threads; logit soft-capping (softcap * tanh(s /
// softcap), with caps small enough that the scores reach tanh's flat part) with and without a
// window, in decode, prefill and split-K shapes.
//
// Tolerance of each output element, derived from the kernel's fp32 arithmetic (u = 2^-24,
// gamma(k) = k u / (1 - k u), the usual bound on k successive roundings):
//   scores   |s^ - s| <= delta_t = gamma(D + 1) * scale * sum_i |q_i k_ti| (q scaled and rounded,
//            D products and additions in any order);
//   softcap  c * tanh(s / c) has slope <= 1, so delta_t carries over, plus c * (e_tanh + 2 u)
//            (the kernel's tanh, the rounding of s / c -- |x| sech^2 x < 1 -- and of c * tanh);
//   weights  each probability exp(s_t - m) is perturbed relatively by at most
//            eps = max_t delta_t + r * (e_exp + u * R): the score error, and r = 2 * blocks + 1
//            evaluations of the kernel's exp (the token's own, one online-softmax rescale per
//            KV block, one split-K merge per piece) with relative error e_exp each plus the
//            rounding of their argument (at most u * R, R the range of the scores);
//            a weighted mean with weights perturbed by eps moves by at most
//            eps / (1 - eps) * max_t |v_ti - o_i| <= 2 eps / (1 - eps) * Vmax_i;
//   sums     the P.V accumulator and the normaliser are fp32 sums over n tokens with a rescale
//            per block and a merge per piece: gamma(n + 2 + 3 * blocks) + gamma(n + 2 * blocks)
//            relative to Vmax_i, and gamma(2) for acc * (1 / l);
//   output   rounded to the query dtype: + u_out * (|o_i| + the above), and for fp16 the
//            subnormal step 2^-25.
// e_exp: the kernel's exp (attention_impl.h exp_neg: round x / ln 2 to n, a two-part ln 2
// reduction, a degree-7 Taylor polynomial on |r| <= ln2 / 2 and an exact scaling by 2^n) has a
// truncation error below (ln2/2)^8 / 8! < 6e-9 and 16 roundings in its Horner steps, each
// contributing at most u relative: e_exp = 16 u + 6e-9.
// e_tanh: the kernel's tanh (attention_impl.h tanh_f), absolute: below |x| = 0.3 a Taylor
// polynomial (truncation < 6e-10, Horner roundings < 8 u |x|); above, (1 - e) / (1 + e) with
// e = exp_neg(-2|x|) <= 0.55: e_exp / 2 from e, u from each of the three roundings:
// e_tanh = 12 u + 6e-9.
//
// store_kv: every source / cache dtype pair, rows with padding, slots in shuffled blocks and a
// skipped (negative) slot: each element lands at (block, head, offset) and is the reference
// rounding (fp_reference.h: nearest, ties to even) of its source value, bit for bit, including
// ties, overflow to infinity, subnormals, signed zeros and NaN (any NaN for a conversion, the
// same bits for a copy); every other cache element keeps its sentinel.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "fp_reference.h"
#include "pyengine/cpu_isa.h"
#include "pyengine/kernels.h"
#include "isa_levels.h"
#include "test_harness.h"

using namespace pyengine::kernels;
using fpref::Buffer;

namespace {

constexpr double kU = fpref::kU32;
constexpr double kExpRelErr = 16 * kU + 6e-9;
constexpr double kTanhAbsErr = 12 * kU + 6e-9;

double gamma(double k) { return k * kU / (1.0 - k * kU); }

uint32_t nan_bits(DType d) {
  return d == DType::kFloat32 ? 0x7fc00000u : d == DType::kBFloat16 ? 0x7fc0u : 0x7e00u;
}
uint32_t sentinel_bits(DType d) { return d == DType::kFloat32 ? 0x3f9e0651u : 0x3f9eu; }  // ~1.2345

const DType kDtypePairs[][2] = {{DType::kFloat32, DType::kFloat32},
                                {DType::kBFloat16, DType::kBFloat16},
                                {DType::kFloat32, DType::kBFloat16},
                                {DType::kFloat16, DType::kFloat16}};

struct Seq {
  int32_t len, q_len;  // KV length including this step's rows; query rows this step
};

struct Shape {
  const char* name;
  int32_t heads, kv_heads, head_dim, tokens_per_block, window;
  std::vector<Seq> seqs;
  float softcap = 0.0f;  // > 0: logit soft-capping
};

const std::vector<Shape>& shapes() {
  static const std::vector<Shape> s = {
      {"decode rows, MHA, head_dim 64, a sequence without query rows", 4, 4, 64, 16, 0,
       {{1, 1}, {17, 1}, {70, 1}, {33, 0}, {16, 1}}},
      {"prefill chunk after earlier KV, full prefill and a decode row, GQA 8:2, head_dim 80", 8, 2,
       80, 16, 0, {{45, 13}, {29, 29}, {50, 1}}},
      {"sliding window 7, MQA 4:1, head_dim 64, 5 tokens per block", 4, 1, 64, 5, 7,
       {{40, 12}, {23, 23}, {31, 1}, {6, 2}}},
      {"long decode context (split-K with threads), GQA 4:2, head_dim 80", 4, 2, 80, 16, 0,
       {{700, 1}, {520, 2}}},
      {"long prefill chunk with sliding window 100, GQA 8:2, head_dim 64", 8, 2, 64, 16, 100,
       {{300, 40}}},
      // the decode kernel takes row groups of 4 and head_dim in pieces of 64 (AVX-512) / 16 (AVX2)
      {"decode rows, GQA 18:2 (9 rows per KV head: groups of 4, 4, 1), head_dim 128, 8 tokens per block",
       18, 2, 128, 8, 0, {{1, 1}, {31, 1}, {32, 1}, {33, 1}, {97, 1}, {130, 1}}},
      {"decode rows with sliding window 40 across chunk edges, GQA 6:2, head_dim 96", 6, 2, 96, 16, 40,
       {{100, 1}, {41, 1}, {64, 1}, {39, 1}}},
      {"head_dim 40 and 3 tokens per block, GQA 6:3", 6, 3, 40, 3, 0, {{20, 7}, {9, 1}}},
      {"head_dim 12, MQA 2:1", 2, 1, 12, 16, 0, {{37, 5}, {2, 2}}},
      // scores up to ~1.5 here: a cap of 0.4 takes tanh far into its flat part, 2.5 barely bends it
      {"softcap 0.4: decode rows, a prefill chunk and a full prefill, GQA 8:2, head_dim 80", 8, 2, 80, 16, 0,
       {{45, 13}, {29, 29}, {50, 1}, {1, 1}}, 0.4f},
      {"softcap 2.5 with sliding window 7, MQA 4:1, head_dim 64, 5 tokens per block", 4, 1, 64, 5, 7,
       {{40, 12}, {23, 23}, {31, 1}}, 2.5f},
      {"softcap 0.25, long decode context (split-K), GQA 4:2, head_dim 64", 4, 2, 64, 16, 0,
       {{700, 1}, {520, 2}}, 0.25f},
  };
  return s;
}

struct Problem {
  const Shape& sh;
  DType q_dtype, cache_dtype;
  int32_t num_blocks = 0, max_blocks = 0, num_tokens = 0;
  int64_t q_stride = 0, out_stride = 0;
  std::vector<int32_t> block_tables, query_start_loc, seq_lens;
  Buffer query, k_cache, v_cache;

  Problem(const Shape& s, DType qd, DType cd, std::mt19937& rng)
      : sh(s), q_dtype(qd), cache_dtype(cd), query(qd, 0), k_cache(cd, 0), v_cache(cd, 0) {
    const int32_t T = s.tokens_per_block, H = s.kv_heads, D = s.head_dim;
    std::vector<int32_t> need;
    for (const Seq& q : s.seqs) {
      need.push_back((q.len + T - 1) / T);
      max_blocks = std::max(max_blocks, need.back() + 1);
      num_blocks += need.back();
    }
    num_blocks += 3;  // spare blocks, never referenced (NaN)
    std::vector<int32_t> ids(num_blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    block_tables.assign(static_cast<size_t>(s.seqs.size()) * max_blocks, -1);
    size_t next = 0;
    for (size_t i = 0; i < s.seqs.size(); ++i)
      for (int32_t b = 0; b < need[i]; ++b) block_tables[i * max_blocks + b] = ids[next++];

    std::uniform_real_distribution<double> uni(-1.0, 1.0);
    k_cache = Buffer(cd, static_cast<size_t>(num_blocks) * H * T * D);
    v_cache = Buffer(cd, k_cache.size());
    for (size_t i = 0; i < k_cache.size(); ++i) {
      k_cache.set_bits(i, nan_bits(cd));
      v_cache.set_bits(i, nan_bits(cd));
    }
    query_start_loc.push_back(0);
    for (size_t i = 0; i < s.seqs.size(); ++i) {
      const Seq& q = s.seqs[i];
      seq_lens.push_back(q.len);
      query_start_loc.push_back(query_start_loc.back() + q.q_len);
      int32_t* bt = block_tables.data() + i * max_blocks;
      if (q.q_len == 0) {
        std::fill(bt, bt + max_blocks, -1);  // not in this step: the kernel must not look
        continue;
      }
      for (int32_t p = 0; p < q.len; ++p)
        for (int32_t h = 0; h < H; ++h)
          for (int32_t d = 0; d < D; ++d) {
            const size_t at = ((static_cast<size_t>(bt[p / T]) * H + h) * T + p % T) * D + d;
            k_cache.set(at, uni(rng));
            v_cache.set(at, uni(rng));
          }
      if (s.window > 0) {  // blocks before every query's window: absent from the table
        const int32_t first_visible = std::max(0, q.len - q.q_len - s.window + 1);
        for (int32_t b = 0; (b + 1) * T <= first_visible; ++b) bt[b] = -1;
      }
    }
    num_tokens = query_start_loc.back();
    q_stride = static_cast<int64_t>(s.heads) * D + 8;
    out_stride = static_cast<int64_t>(s.heads) * D + 4;
    query = Buffer(qd, static_cast<size_t>(num_tokens) * q_stride);
    for (size_t i = 0; i < query.size(); ++i) query.set_bits(i, nan_bits(qd));  // the padding
    for (int32_t t = 0; t < num_tokens; ++t)
      for (int64_t j = 0; j < static_cast<int64_t>(s.heads) * D; ++j)
        query.set(t * q_stride + j, uni(rng));
  }

  double kv(const Buffer& c, size_t seq, int32_t pos, int32_t h, int32_t d) const {
    const int32_t T = sh.tokens_per_block;
    const int32_t bid = block_tables[seq * max_blocks + pos / T];
    return c.get(((static_cast<size_t>(bid) * sh.kv_heads + h) * T + pos % T) * sh.head_dim + d);
  }
};

struct Stats {
  int64_t checks = 0, failures = 0;
  double worst = 0.0;  // max |error| / tolerance
};

// Runs paged_attention on `pb` and compares every output element with the reference.
void check_problem(const Problem& pb, int32_t threads, Stats& st) {
  const Shape& sh = pb.sh;
  const int32_t D = sh.head_dim, G = sh.heads / sh.kv_heads, T = sh.tokens_per_block;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  Buffer out(pb.q_dtype, static_cast<size_t>(pb.num_tokens) * pb.out_stride);
  for (size_t i = 0; i < out.size(); ++i) out.set_bits(i, sentinel_bits(pb.q_dtype));
  paged_attention(out.data(), pb.out_stride, pb.query.data(), pb.q_stride, pb.q_dtype,
                  pb.k_cache.data(), pb.v_cache.data(), pb.cache_dtype, pb.query_start_loc.data(),
                  pb.seq_lens.data(), pb.block_tables.data(), static_cast<int32_t>(sh.seqs.size()),
                  pb.num_tokens, pb.max_blocks, sh.heads, sh.kv_heads, D, T, pb.num_blocks, scale,
                  sh.window, sh.softcap, threads);

  const double u_out = fpref::unit_roundoff(pb.q_dtype);
  const double abs_out = pb.q_dtype == DType::kFloat16 ? fpref::kF16SubnormalHalfStep : 0.0;
  int printed = 0;
  for (size_t s = 0; s < sh.seqs.size(); ++s) {
    const Seq& q = sh.seqs[s];
    for (int32_t j = 0; j < q.q_len; ++j) {
      const int64_t tok = pb.query_start_loc[s] + j;
      const int32_t pos = q.len - q.q_len + j;
      const int32_t lo = sh.window > 0 ? std::max(0, pos - sh.window + 1) : 0;
      const int32_t n = pos - lo + 1;
      const int32_t blocks = pos / T - lo / T + 1;
      for (int32_t h = 0; h < sh.heads; ++h) {
        const int32_t kh = h / G;
        std::vector<double> sc(n), delta(n);
        for (int32_t t = 0; t < n; ++t) {
          double dot = 0.0, mag = 0.0;
          for (int32_t d = 0; d < D; ++d) {
            const double prod = pb.query.get(tok * pb.q_stride + static_cast<int64_t>(h) * D + d) *
                                pb.kv(pb.k_cache, s, lo + t, kh, d);
            dot += prod;
            mag += std::fabs(prod);
          }
          sc[t] = dot * scale;
          delta[t] = gamma(D + 1) * scale * mag;
          if (sh.softcap > 0) {
            const double c = sh.softcap;
            sc[t] = c * std::tanh(sc[t] / c);
            delta[t] += c * (kTanhAbsErr + 2 * kU);
          }
        }
        const double mx = *std::max_element(sc.begin(), sc.end());
        const double mn = *std::min_element(sc.begin(), sc.end());
        const double max_delta = *std::max_element(delta.begin(), delta.end());
        const double range = mx - mn + 2 * max_delta;
        const double r = 2.0 * blocks + 1.0;
        const double eps = max_delta + r * (kExpRelErr + kU * range);
        std::vector<double> w(n);
        double wsum = 0.0;
        for (int32_t t = 0; t < n; ++t) wsum += (w[t] = std::exp(sc[t] - mx));
        for (int32_t d = 0; d < D; ++d) {
          double o = 0.0, vmax = 0.0;
          for (int32_t t = 0; t < n; ++t) {
            const double v = pb.kv(pb.v_cache, s, lo + t, kh, d);
            o += w[t] * v;
            vmax = std::max(vmax, std::fabs(v));
          }
          o /= wsum;
          const double tol32 = vmax * (2 * eps / (1 - eps) + gamma(n + 2 + 3.0 * blocks) +
                                       gamma(n + 2.0 * blocks) + gamma(2));
          const double tol = tol32 + u_out * (std::fabs(o) + tol32) + abs_out;
          const double got = out.get(tok * pb.out_stride + static_cast<int64_t>(h) * D + d);
          const double err = std::fabs(got - o);
          ++st.checks;
          if (!(err <= tol)) {
            ++st.failures;
            if (printed++ < 5)
              std::cerr << "    " << sh.name << " [" << fpref::name_of(pb.q_dtype) << " query, "
                        << fpref::name_of(pb.cache_dtype) << " cache, " << threads
                        << " threads] seq " << s << " row " << j << " head " << h << " dim " << d
                        << ": got " << got << ", reference " << o << ", tolerance " << tol << "\n";
          } else if (tol > 0) {
            st.worst = std::max(st.worst, err / tol);
          }
        }
      }
      // the row padding keeps its sentinel
      for (int64_t i = static_cast<int64_t>(sh.heads) * D; i < pb.out_stride; ++i) {
        ++st.checks;
        if (out.bits(tok * pb.out_stride + i) != sentinel_bits(pb.q_dtype)) ++st.failures;
      }
    }
  }
}

// ---- store_kv ----

// Source values for the conversions: specials and rounding edges of each target format first,
// then random bit patterns (16-bit formats: any pattern; fp32: random exponents in 2^-30..2^20
// and a few anywhere).
std::vector<uint32_t> source_bits(DType d, size_t count, std::mt19937& rng) {
  std::vector<uint32_t> v;
  if (d == DType::kFloat32) {
    const float specials[] = {
        0.0f, -0.0f, 1.0f, -1.0f, INFINITY, -INFINITY, NAN, -NAN,
        // bf16 ties and just past one
        1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, -(1.0f + 0x1p-8f), 1.0f + 0x1p-8f + 0x1p-20f,
        // fp16 ties and just past one
        1.0f + 0x1p-11f, 1.0f + 3 * 0x1p-11f, 1.0f + 0x1p-11f + 0x1p-22f,
        3.3895314e38f, 3.4028235e38f, 1e-40f, -1e-45f, 0x1p-126f,  // bf16 overflow, subnormals
        65504.0f, 65519.996f, 65520.0f, -65520.0f, 1e5f,            // fp16 largest, overflow
        0x1p-24f, 0x1p-25f, 3 * 0x1p-25f, 0x1p-26f, 0x1p-14f - 0x1p-25f, 0x1p-14f, 5.5e-8f};
    for (float f : specials) v.push_back(fpref::f32_bits(f));
    std::uniform_int_distribution<int> expo(-30, 20);
    std::uniform_int_distribution<uint32_t> any;
    while (v.size() < count) {
      const uint32_t r = any(rng);
      if (v.size() % 16 == 0) {
        v.push_back(r);  // anything, NaN and infinities included
      } else {
        const uint32_t e = static_cast<uint32_t>(127 + expo(rng)) << 23;
        v.push_back((r & 0x807fffffu) | e);
      }
    }
  } else {
    std::uniform_int_distribution<uint32_t> any(0, 0xffff);
    for (uint32_t s : {0x0000u, 0x8000u, 0x0001u, 0x8001u}) v.push_back(s);
    while (v.size() < count) v.push_back(any(rng));
  }
  v.resize(count);
  return v;
}

// What storing the source value of bits b (format s) into format c must give.
uint32_t expected_bits(DType s, DType c, uint32_t b) {
  if (s == c) return b;
  Buffer one(s, 1);
  one.set_bits(0, b);
  return Buffer::encode(c, one.get(0));
}

bool is_nan(DType d, uint32_t b) {
  Buffer one(d, 1);
  one.set_bits(0, b);
  return std::isnan(one.get(0));
}

void check_store_kv(DType src, DType cache, std::mt19937& rng, int64_t& failures) {
  const int32_t tokens = 7, H = 3, D = 20, T = 4, blocks = 6;
  const int64_t ks = static_cast<int64_t>(H) * D + 5, vs = static_cast<int64_t>(H) * D + 9;
  const std::vector<int32_t> slots = {5, 0, 23, -1, 9, 14, 3};  // block 5 offset 3, ..., skipped
  Buffer key(src, tokens * ks), value(src, tokens * vs);
  const auto kb = source_bits(src, key.size(), rng), vb = source_bits(src, value.size(), rng);
  for (size_t i = 0; i < key.size(); ++i) key.set_bits(i, kb[i]);
  for (size_t i = 0; i < value.size(); ++i) value.set_bits(i, vb[i]);
  Buffer kc(cache, static_cast<size_t>(blocks) * H * T * D), vc(cache, kc.size());
  for (size_t i = 0; i < kc.size(); ++i) {
    kc.set_bits(i, sentinel_bits(cache));
    vc.set_bits(i, sentinel_bits(cache));
  }
  store_kv(key.data(), value.data(), ks, vs, src, kc.data(), vc.data(), cache, slots.data(), tokens,
           H, D, T, blocks);
  std::vector<char> written(kc.size(), 0);
  int printed = 0;
  auto expect = [&](const Buffer& got, size_t at, const Buffer& from, size_t src_at) {
    const uint32_t want = expected_bits(src, cache, from.bits(src_at));
    const uint32_t have = got.bits(at);
    const bool ok = have == want || (src != cache && is_nan(cache, want) && is_nan(cache, have));
    if (!ok) {
      ++failures;
      if (printed++ < 5)
        std::cerr << "    store_kv " << fpref::name_of(src) << " -> " << fpref::name_of(cache)
                  << ": source bits 0x" << std::hex << from.bits(src_at) << " stored as 0x" << have
                  << ", expected 0x" << want << std::dec << "\n";
    }
  };
  for (int32_t t = 0; t < tokens; ++t) {
    if (slots[t] < 0) continue;
    const int32_t b = slots[t] / T, off = slots[t] % T;
    for (int32_t h = 0; h < H; ++h)
      for (int32_t d = 0; d < D; ++d) {
        const size_t at = ((static_cast<size_t>(b) * H + h) * T + off) * D + d;
        written[at] = 1;
        expect(kc, at, key, t * ks + h * D + d);
        expect(vc, at, value, t * vs + h * D + d);
      }
  }
  for (size_t i = 0; i < kc.size(); ++i)
    if (!written[i] && (kc.bits(i) != sentinel_bits(cache) || vc.bits(i) != sentinel_bits(cache)))
      ++failures;
}

}  // namespace

TEST(paged_attention_matches_a_double_reference_at_every_level) {
  at_every_level([](const char* level) {
    std::mt19937 rng(2024);
    std::cout << "  level " << level << ":\n";
    for (const auto& dt : kDtypePairs) {
      Stats st;
      for (const Shape& sh : shapes()) {
        const Problem pb(sh, dt[0], dt[1], rng);
        for (int32_t threads : {1, 3}) check_problem(pb, threads, st);
      }
      std::cout << "    " << fpref::name_of(dt[0]) << " query, " << fpref::name_of(dt[1])
                << " cache: " << st.checks << " outputs checked, " << st.failures
                << " outside tolerance, largest error / tolerance " << st.worst << "\n";
      CHECK_EQ(st.failures, int64_t{0});
    }
  });
}

TEST(store_kv_places_and_converts_every_dtype_pair_at_every_level) {
  at_every_level([](const char* level) {
    std::mt19937 rng(99);
    int64_t failures = 0;
    const DType all[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
    for (DType src : all)
      for (DType cache : all) check_store_kv(src, cache, rng, failures);
    std::cout << "  level " << level << ": 9 dtype pairs, " << failures << " wrong elements\n";
    CHECK_EQ(failures, int64_t{0});
  });
}

TEST(the_reference_rounding_agrees_with_known_values) {
  // the test's own reference, checked against hand-computed bit patterns
  CHECK_EQ(fpref::to_bf16(1.0 + 0x1p-8), uint16_t{0x3f80});        // tie -> even (down)
  CHECK_EQ(fpref::to_bf16(1.0 + 3 * 0x1p-8), uint16_t{0x3f82});    // tie -> even (up)
  CHECK_EQ(fpref::to_bf16(3.4028235e38), uint16_t{0x7f80});        // overflow -> inf
  CHECK_EQ(fpref::to_bf16(-0.0), uint16_t{0x8000});
  CHECK_EQ(fpref::to_f16(65504.0), uint16_t{0x7bff});
  CHECK_EQ(fpref::to_f16(65519.0), uint16_t{0x7bff});
  CHECK_EQ(fpref::to_f16(65520.0), uint16_t{0x7c00});             // tie past the largest -> inf
  CHECK_EQ(fpref::to_f16(0x1p-25), uint16_t{0x0000});             // tie -> even (zero)
  CHECK_EQ(fpref::to_f16(3 * 0x1p-25), uint16_t{0x0002});         // tie -> even
  CHECK_EQ(fpref::to_f16(1.0 + 0x1p-11), uint16_t{0x3c00});
  CHECK_EQ(fpref::to_f16(1.0 + 3 * 0x1p-11), uint16_t{0x3c02});
  CHECK(fpref::f16_value(0x0001) == 0x1p-24 && fpref::f16_value(0x3c00) == 1.0);
  CHECK(fpref::bf16_value(0x0001) == 0x1p-133 && fpref::bf16_value(0xbf80) == -1.0);
}

TEST(the_cpu_kernels_refuse_float8) {
  float buf[4] = {};
  int32_t zero[2] = {0, 1};
  CHECK_THROWS(paged_attention(buf, 1, buf, 1, DType::kFloat32, buf, buf, DType::kFloat8E4M3,
                               zero, zero + 1, zero, 1, 1, 1, 1, 1, 1, 1, 1, 1.0f, 0, 0.0f, 1),
               std::invalid_argument, "cache_dtype: float8_e4m3");
  CHECK_THROWS(store_kv(buf, buf, 1, 1, DType::kFloat32, buf, buf, DType::kFloat8E4M3, zero, 1, 1,
                        1, 1, 1),
               std::invalid_argument, "cache_dtype: float8_e4m3");
}

// Indices from a caller are checked against the pool before anything is read or written: a
// slot or block id past the cache, or query rows past the query, is an error, never an
// out-of-bounds access (the buffers here are exactly the declared sizes: ASan would see one).
TEST(the_cpu_kernels_bound_every_index) {
  const int32_t H = 1, D = 4, T = 2, blocks = 3;
  std::vector<float> cache(static_cast<size_t>(blocks) * H * T * D, 0.0f), v_cache(cache.size(), 0.0f);
  std::vector<float> rows(2 * H * D, 1.0f), out(2 * H * D, 0.0f);
  std::vector<int32_t> slots{5, 6};  // 6 = blocks * T: one past the last slot
  CHECK_THROWS(store_kv(rows.data(), rows.data(), H * D, H * D, DType::kFloat32, cache.data(), v_cache.data(),
                        DType::kFloat32, slots.data(), 2, H, D, T, blocks),
               std::invalid_argument, "slot_mapping: entry 1 is 6, beyond the cache's 6 slots (3 blocks of 2)");
  slots = {5, -1};  // a negative slot skips its row
  store_kv(rows.data(), rows.data(), H * D, H * D, DType::kFloat32, cache.data(), v_cache.data(),
           DType::kFloat32, slots.data(), 2, H, D, T, blocks);
  CHECK_EQ(cache[5 * D], 1.0f);

  std::vector<int32_t> qsl{0, 1}, lens{3}, table{0, 3};  // block 3 does not exist
  CHECK_THROWS(paged_attention(out.data(), H * D, rows.data(), H * D, DType::kFloat32, cache.data(),
                               v_cache.data(), DType::kFloat32, qsl.data(), lens.data(), table.data(), 1, 2, 2, H,
                               H, D, T, blocks, 0.5f, 0, 0.0f, 1),
               std::invalid_argument, "block_tables: block id 3 for sequence 0, block 1 is outside the cache's 3 blocks");
  table = {0, 2};
  qsl = {0, 3};  // three query rows, the query has two
  CHECK_THROWS(paged_attention(out.data(), H * D, rows.data(), H * D, DType::kFloat32, cache.data(),
                               v_cache.data(), DType::kFloat32, qsl.data(), lens.data(), table.data(), 1, 2, 2, H,
                               H, D, T, blocks, 0.5f, 0, 0.0f, 1),
               std::invalid_argument, "query_start_loc: ends at 3, beyond the 2 query rows");
  lens = {5};  // needs 3 blocks, the table has 2
  qsl = {0, 1};
  CHECK_THROWS(paged_attention(out.data(), H * D, rows.data(), H * D, DType::kFloat32, cache.data(),
                               v_cache.data(), DType::kFloat32, qsl.data(), lens.data(), table.data(), 1, 2, 2, H,
                               H, D, T, blocks, 0.5f, 0, 0.0f, 1),
               std::invalid_argument, "seq_lens: seq_lens[0] = 5 needs more than max_blocks_per_seq blocks");
  lens = {3};
  paged_attention(out.data(), H * D, rows.data(), H * D, DType::kFloat32, cache.data(), v_cache.data(),
                  DType::kFloat32, qsl.data(), lens.data(), table.data(), 1, 2, 2, H, H, D, T, blocks, 0.5f, 0, 0.0f, 1);
}

TEST(paged_attention_refuses_a_negative_or_non_finite_softcap) {
  const int32_t H = 1, D = 4, T = 2, blocks = 2;
  std::vector<float> cache(static_cast<size_t>(blocks) * H * T * D, 0.5f), rows(H * D, 1.0f), out(H * D, 0.0f);
  std::vector<int32_t> qsl{0, 1}, lens{3}, table{0, 1};
  auto run = [&](float softcap) {
    paged_attention(out.data(), H * D, rows.data(), H * D, DType::kFloat32, cache.data(), cache.data(),
                    DType::kFloat32, qsl.data(), lens.data(), table.data(), 1, 1, 2, H, H, D, T, blocks, 0.5f, 0,
                    softcap, 1);
  };
  CHECK_THROWS(run(-1.0f), std::invalid_argument, "softcap: must be finite and >= 0 (0 disables it), got -1");
  CHECK_THROWS(run(NAN), std::invalid_argument, "softcap: must be finite and >= 0");
  CHECK_THROWS(run(INFINITY), std::invalid_argument, "softcap: must be finite and >= 0");
  run(0.0f);  // off
  CHECK_EQ(out[0], 0.5f);
  run(30.0f);
  CHECK_EQ(out[0], 0.5f);  // every key the same: any cap gives the mean of equal values
}

TEST_MAIN()
