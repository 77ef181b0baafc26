// rms_norm (with and without the fused residual add), rotary_embedding and silu_mul
// (pyengine/cpu_elementwise.h) at every instruction-set level this CPU has, in float32,
// bfloat16 and float16: against straightforward double-precision references, and bit for bit
// against the generic level (the kernels are compiled with -ffp-contract=off and vectorize
// without reassociating, so every level must round identically).
//
// Tolerances (u = 2^-24 the fp32 unit roundoff, u_T that of the dtype: 2^-24, 2^-8, 2^-11;
// gamma(k) = k u / (1 - k u) bounds k successive fp32 roundings). Each bound follows the
// kernel's operation order as the header documents it; a bf16 x bf16 or fp16 x fp16 product is
// exact in fp32 (at most 22 significant bits), so it costs no rounding.
//   residual  residual + x of two dtype values is exact in fp32 for the inputs used (magnitudes
//             in [1/8, 4), so exponents differ by at most 4), so the stored sum is the reference
//             rounding of the exact sum: checked bit for bit.
//   rms_norm  the sum of squares goes through at most d = ceil(hidden / 16) + 16 roundings
//             (16 lanes, then the lanes in turn) plus the square: gamma(d + 1); the mean, + eps,
//             sqrt and 1 / x add one rounding each (sqrt halves its argument's error), giving
//             E_inv; then x * inv (fp32) and, below fp32, its rounding to the dtype, and
//             weight * y rounded to the dtype:
//               fp32: (1 + E_inv)(1 + u)^2 - 1,  bf16/fp16: (1 + E_inv)(1 + u)(1 + u_T)^2 - 1,
//             relative to |weight * x / rms|.
//   rotary    x[i] = T(T(a c) + T(-b s)): each product and the sum are rounded once to fp32
//             (fp32 only: the products are exact below fp32) and once to the dtype; the error
//             is at most (|a c| + |b s|) * ((1 + u)^k (1 + u_T)^2 - 1), k = 2 for fp32 (where
//             u_T rounding is the identity and does not count), k = 1 below.
//   silu_mul  silu(g) = g / (1 + exp(-g)) in fp32 with libm's expf (glibc: within 1 ulp, so
//             relative 2u), 1 + e (e / (1 + e) < 1, so 2u + u), the division (u):
//             E_silu = (1 + u) / (1 - ((1 + 2u)(1 + u) - 1)) - 1; then T(silu) * up:
//               fp32: (1 + E_silu)(1 + u) - 1,  bf16/fp16: (1 + E_silu)(1 + u_T)^2 - 1.
//   fp16 results below 2^-14 are subnormal, where rounding is absolute: 2^-25 per rounding to
//   fp16 (scaled by what multiplies it afterwards) is added for fp16.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "fp_reference.h"
#include "pyengine/cpu_elementwise.h"
#include "pyengine/cpu_isa.h"
#include "isa_levels.h"
#include "test_harness.h"

using namespace pyengine::kernels;
using fpref::Buffer;

namespace {

constexpr double kU = fpref::kU32;
const DType kDtypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};

double gamma(double k) { return k * kU / (1.0 - k * kU); }

uint32_t sentinel_bits(DType d) { return d == DType::kFloat32 ? 0x3f9e0651u : 0x3f9eu; }

// Random values of the dtype: magnitude in [lo, hi), random sign.
void fill(Buffer& b, std::mt19937& rng, double lo, double hi) {
  std::uniform_real_distribution<double> mag(lo, hi);
  std::bernoulli_distribution neg(0.5);
  for (size_t i = 0; i < b.size(); ++i) b.set(i, neg(rng) ? -mag(rng) : mag(rng));
}

void fill_sentinel(Buffer& b) {
  for (size_t i = 0; i < b.size(); ++i) b.set_bits(i, sentinel_bits(b.dtype));
}

struct Stats {
  int64_t checks = 0, failures = 0;
  double worst = 0.0;  // max |error| / tolerance
  void check(double got, double ref, double tol, const std::string& what) {
    ++checks;
    const double err = std::fabs(got - ref);
    if (!(err <= tol)) {
      if (failures++ < 5)
        std::cerr << "    " << what << ": got " << got << ", reference " << ref << ", tolerance "
                  << tol << "\n";
    } else if (tol > 0) {
      worst = std::max(worst, err / tol);
    }
  }
  void check_bits(uint32_t got, uint32_t want, const std::string& what) {
    ++checks;
    if (got != want && failures++ < 5)
      std::cerr << "    " << what << ": bits 0x" << std::hex << got << ", expected 0x" << want
                << std::dec << "\n";
  }
};

// Relative error bound of rms_norm's 1 / sqrt(mean(x^2) + eps) in fp32.
double rms_inv_bound(int32_t hidden) {
  const double d = (hidden + 15) / 16 + 16;
  const double arg = (1 + gamma(d + 1)) * (1 + kU) * (1 + kU) - 1;  // sum, / hidden, + eps
  const double root = std::sqrt(1 + arg) * (1 + kU) - 1;
  return (1 + kU) / (1 - root) - 1;
}

void check_rms_norm(DType dt, int32_t rows, int32_t hidden, bool with_residual, std::mt19937& rng,
                    Stats& st) {
  const int64_t xs = hidden + 3, os = hidden + 5, rs = hidden + 7;
  const float eps = 1e-6f;
  Buffer x(dt, rows * xs), w(dt, hidden), out(dt, rows * os), res(dt, rows * rs);
  fill(x, rng, 0.125, 4.0);
  fill(w, rng, 0.5, 2.0);
  fill(res, rng, 0.125, 4.0);
  fill_sentinel(out);
  const Buffer res_before = res;
  rms_norm(out.data(), os, x.data(), xs, with_residual ? res.data() : nullptr, rs, w.data(), dt,
           rows, hidden, eps, 2);

  const double uT = fpref::unit_roundoff(dt);
  const double e_inv = rms_inv_bound(hidden);
  const double rel = dt == DType::kFloat32 ? (1 + e_inv) * (1 + kU) * (1 + kU) - 1
                                           : (1 + e_inv) * (1 + kU) * (1 + uT) * (1 + uT) - 1;
  const std::string what = std::string("rms_norm ") + fpref::name_of(dt) +
                           (with_residual ? " with residual" : "") + " hidden " +
                           std::to_string(hidden);
  for (int32_t r = 0; r < rows; ++r) {
    std::vector<double> v(hidden);
    for (int32_t i = 0; i < hidden; ++i) {
      v[i] = x.get(r * xs + i);
      if (with_residual) {
        const double sum = res_before.get(r * rs + i) + v[i];  // exact (see the header)
        st.check_bits(res.bits(r * rs + i), Buffer::encode(dt, sum), what + " residual");
        v[i] = res.get(r * rs + i);
      }
    }
    double ss = 0.0;
    for (double a : v) ss += a * a;
    const double inv = 1.0 / std::sqrt(ss / hidden + static_cast<double>(eps));
    for (int32_t i = 0; i < hidden; ++i) {
      const double wi = w.get(i);
      const double ref = wi * v[i] * inv;
      const double abs =
          dt == DType::kFloat16 ? fpref::kF16SubnormalHalfStep * (std::fabs(wi) + 1) : 0.0;
      st.check(out.get(r * os + i), ref, std::fabs(ref) * rel + abs, what);
    }
    for (int64_t i = hidden; i < os; ++i)
      st.check_bits(out.bits(r * os + i), sentinel_bits(dt), what + " padding");
    if (!with_residual)  // untouched without a residual
      for (int64_t i = 0; i < rs; ++i)
        st.check_bits(res.bits(r * rs + i), res_before.bits(r * rs + i),
                      what + " residual untouched");
  }
}

void check_rotary(DType dt, int32_t tokens, int32_t heads, int32_t head_dim, std::mt19937& rng,
                  Stats& st) {
  const int32_t max_pos = 300, half = head_dim / 2;
  const int64_t xs = static_cast<int64_t>(heads) * head_dim + 6;
  Buffer x(dt, tokens * xs), cos(dt, static_cast<size_t>(max_pos) * head_dim), sin(dt, cos.size());
  for (int32_t p = 0; p < max_pos; ++p)
    for (int32_t i = 0; i < head_dim; ++i) {
      const double theta = p * std::pow(10000.0, -2.0 * (i % half) / head_dim);
      cos.set(static_cast<size_t>(p) * head_dim + i, std::cos(theta));
      sin.set(static_cast<size_t>(p) * head_dim + i, std::sin(theta));
    }
  fill(x, rng, 0.0, 2.0);
  for (int32_t t = 0; t < tokens; ++t)  // the row padding
    for (int64_t i = static_cast<int64_t>(heads) * head_dim; i < xs; ++i)
      x.set_bits(t * xs + i, sentinel_bits(dt));
  std::vector<int32_t> pos(tokens);
  std::uniform_int_distribution<int32_t> any_pos(0, max_pos - 1);
  for (auto& p : pos) p = any_pos(rng);
  pos[0] = 0;  // sin = 0, cos = 1
  const Buffer before = x;
  rotary_embedding(x.data(), xs, tokens, heads, head_dim, cos.data(), sin.data(), max_pos,
                   pos.data(), dt, 2);

  const double uT = fpref::unit_roundoff(dt);
  const double rel =
      dt == DType::kFloat32 ? (1 + kU) * (1 + kU) - 1 : (1 + kU) * (1 + uT) * (1 + uT) - 1;
  const double abs = dt == DType::kFloat16 ? 3 * fpref::kF16SubnormalHalfStep : 0.0;
  const std::string what = std::string("rotary_embedding ") + fpref::name_of(dt) + " head_dim " +
                           std::to_string(head_dim);
  for (int32_t t = 0; t < tokens; ++t) {
    const size_t row = static_cast<size_t>(pos[t]) * head_dim;
    for (int32_t h = 0; h < heads; ++h) {
      const int64_t base = t * xs + static_cast<int64_t>(h) * head_dim;
      for (int32_t i = 0; i < half; ++i) {
        const double a = before.get(base + i), b = before.get(base + i + half);
        const double c0 = cos.get(row + i), s0 = sin.get(row + i);
        const double c1 = cos.get(row + i + half), s1 = sin.get(row + i + half);
        st.check(x.get(base + i), a * c0 - b * s0,
                 (std::fabs(a * c0) + std::fabs(b * s0)) * rel + abs, what);
        st.check(x.get(base + i + half), b * c1 + a * s1,
                 (std::fabs(b * c1) + std::fabs(a * s1)) * rel + abs, what);
      }
    }
    for (int64_t i = static_cast<int64_t>(heads) * head_dim; i < xs; ++i)
      st.check_bits(x.bits(t * xs + i), sentinel_bits(dt), what + " padding");
  }
}

void check_silu_mul(DType dt, int32_t rows, int32_t inter, std::mt19937& rng, Stats& st) {
  Buffer gate_up(dt, static_cast<size_t>(rows) * 2 * inter);
  Buffer out(dt, static_cast<size_t>(rows) * inter);
  fill(gate_up, rng, 0.0, 8.0);
  // the up halves in [-2, 2)
  for (int32_t r = 0; r < rows; ++r)
    for (int32_t i = 0; i < inter; ++i) {
      const size_t at = static_cast<size_t>(r) * 2 * inter + inter + i;
      gate_up.set(at, gate_up.get(at) / 4);
    }
  silu_mul(out.data(), gate_up.data(), dt, rows, inter, 2);

  const double uT = fpref::unit_roundoff(dt);
  const double e_silu = (1 + kU) / (1 - ((1 + 2 * kU) * (1 + kU) - 1)) - 1;
  const double rel = dt == DType::kFloat32 ? (1 + e_silu) * (1 + kU) - 1
                                           : (1 + e_silu) * (1 + uT) * (1 + uT) - 1;
  const std::string what = std::string("silu_mul ") + fpref::name_of(dt);
  for (int32_t r = 0; r < rows; ++r)
    for (int32_t i = 0; i < inter; ++i) {
      const double g = gate_up.get(static_cast<size_t>(r) * 2 * inter + i);
      const double up = gate_up.get(static_cast<size_t>(r) * 2 * inter + inter + i);
      const double ref = g / (1 + std::exp(-g)) * up;
      const double abs =
          dt == DType::kFloat16 ? fpref::kF16SubnormalHalfStep * (std::fabs(up) + 1) : 0.0;
      st.check(out.get(static_cast<size_t>(r) * inter + i), ref, std::fabs(ref) * rel + abs, what);
    }
}

void report(const char* level, DType dt, const Stats& st) {
  std::cout << "    " << level << " " << fpref::name_of(dt) << ": " << st.checks << " checks, "
            << st.failures << " failed, largest error / tolerance " << st.worst << "\n";
}

// The outputs of all three kernels (and the updated residual) for one dtype, on fixed inputs
// large enough for every vector width and tail, several rows on 2 threads.
std::vector<uint8_t> all_outputs(DType dt) {
  std::mt19937 rng(5);
  std::vector<uint8_t> bytes;
  auto append = [&](const Buffer& b) { bytes.insert(bytes.end(), b.bytes.begin(), b.bytes.end()); };
  {
    const int32_t rows = 6, hidden = 4096 + 13;
    Buffer x(dt, rows * hidden), w(dt, hidden), out(dt, rows * hidden), res(dt, rows * hidden);
    fill(x, rng, 0.0, 4.0);
    fill(w, rng, 0.0, 2.0);
    fill(res, rng, 0.0, 4.0);
    rms_norm(out.data(), hidden, x.data(), hidden, nullptr, 0, w.data(), dt, rows, hidden, 1e-6f,
             2);
    append(out);
    rms_norm(out.data(), hidden, x.data(), hidden, res.data(), hidden, w.data(), dt, rows, hidden,
             1e-6f, 2);
    append(out);
    append(res);
  }
  for (int32_t head_dim : {128, 80, 6}) {
    const int32_t tokens = 5, heads = 6, max_pos = 64;
    Buffer x(dt, static_cast<size_t>(tokens) * heads * head_dim);
    Buffer cos(dt, static_cast<size_t>(max_pos) * head_dim), sin(dt, cos.size());
    fill(x, rng, 0.0, 2.0);
    fill(cos, rng, 0.0, 1.0);
    fill(sin, rng, 0.0, 1.0);
    const std::vector<int32_t> pos = {3, 0, 63, 17, 17};
    rotary_embedding(x.data(), static_cast<int64_t>(heads) * head_dim, tokens, heads, head_dim,
                     cos.data(), sin.data(), max_pos, pos.data(), dt, 2);
    append(x);
  }
  {
    const int32_t rows = 5, inter = 2048 + 11;
    Buffer gate_up(dt, static_cast<size_t>(rows) * 2 * inter);
    Buffer out(dt, static_cast<size_t>(rows) * inter);
    fill(gate_up, rng, 0.0, 8.0);
    silu_mul(out.data(), gate_up.data(), dt, rows, inter, 2);
    append(out);
  }
  return bytes;
}

}  // namespace

TEST(rms_norm_matches_a_double_reference_at_every_level) {
  at_every_level([](const char* level) {
    std::cout << "  level " << level << ":\n";
    for (DType dt : kDtypes) {
      std::mt19937 rng(1);
      Stats st;
      for (int32_t hidden : {7, 16, 384, 1000 + 3})
        for (int32_t rows : {1, 5})
          for (bool residual : {false, true}) check_rms_norm(dt, rows, hidden, residual, rng, st);
      report(level, dt, st);
      CHECK_EQ(st.failures, int64_t{0});
    }
  });
}

TEST(rotary_embedding_matches_a_double_reference_at_every_level) {
  at_every_level([](const char* level) {
    std::cout << "  level " << level << ":\n";
    for (DType dt : kDtypes) {
      std::mt19937 rng(2);
      Stats st;
      for (int32_t head_dim : {128, 80, 64, 6})
        for (int32_t tokens : {1, 6}) check_rotary(dt, tokens, 3, head_dim, rng, st);
      report(level, dt, st);
      CHECK_EQ(st.failures, int64_t{0});
    }
  });
}

TEST(silu_mul_matches_a_double_reference_at_every_level) {
  at_every_level([](const char* level) {
    std::cout << "  level " << level << ":\n";
    for (DType dt : kDtypes) {
      std::mt19937 rng(3);
      Stats st;
      for (int32_t inter : {1, 7, 64, 1000 + 5})
        for (int32_t rows : {1, 5}) check_silu_mul(dt, rows, inter, rng, st);
      report(level, dt, st);
      CHECK_EQ(st.failures, int64_t{0});
    }
  });
}

TEST(every_level_gives_bit_identical_results) {
  for (DType dt : kDtypes) {
    std::vector<uint8_t> generic;
    at_every_level([&](const char* level) {
      const std::vector<uint8_t> got = all_outputs(dt);
      if (generic.empty()) {
        generic = got;  // supported_cpu_isas() starts with generic
        std::cout << "  " << fpref::name_of(dt) << ": level " << level << ": " << got.size()
                  << " bytes of output (the reference)\n";
        return;
      }
      size_t differ = 0;
      for (size_t i = 0; i < got.size(); ++i) differ += got[i] != generic[i];
      std::cout << "  " << fpref::name_of(dt) << ": level " << level << " vs generic: " << differ
                << " of " << got.size() << " bytes differ\n";
      CHECK(got.size() == generic.size());
      CHECK_EQ(differ, size_t{0});
    });
  }
}

TEST_MAIN()
