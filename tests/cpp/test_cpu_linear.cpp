// linear_bf16 / linear_f32 through the C++ API, at every instruction-set level this CPU has:
// exact results where fp32 arithmetic is exact (small integers), so any order of accumulation
// must give the bf16 rounding of the exact value (and in fp32 the exact value); argument errors.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <random>
#include <stdexcept>
#include <vector>

#include "pyengine/cpu_isa.h"
#include "pyengine/cpu_linear.h"
#include "test_harness.h"

using namespace pyengine::kernels;

namespace {

uint16_t to_bf16_exact(float f) {  // f must be representable in bf16
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return static_cast<uint16_t>(u >> 16);
}

float from_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Round to nearest even of an fp32-exact integer value to bf16 (8 significant bits).
float round_bf16(double v) {
  float f = static_cast<float>(v);
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

void integer_inputs_at_the_active_level() {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> small(-4, 4), big(-300, 300);
  for (int32_t M : {1, 2, 5, 15}) {
    for (auto [N, K] : {std::pair{37, 45}, {13, 1537}, {8, 32}, {1000, 576}}) {
      std::vector<uint16_t> x(M * K), w(static_cast<size_t>(N) * K), b(N), y(M * N);
      for (auto& v : x) v = to_bf16_exact(static_cast<float>(small(rng)));
      for (auto& v : w) v = to_bf16_exact(static_cast<float>(small(rng)));
      for (auto& v : b) v = to_bf16_exact(round_bf16(big(rng)));  // a bf16 value
      linear_bf16(y.data(), x.data(), w.data(), b.data(), M, N, K, 2);
      // the same values in fp32 (sums below 2^24: every partial sum is exact)
      std::vector<float> xf(x.size()), wf(w.size()), bf(b.size()), yf(y.size());
      for (size_t i = 0; i < x.size(); ++i) xf[i] = from_bf16(x[i]);
      for (size_t i = 0; i < w.size(); ++i) wf[i] = from_bf16(w[i]);
      for (size_t i = 0; i < b.size(); ++i) bf[i] = from_bf16(b[i]);
      linear_f32(yf.data(), xf.data(), wf.data(), bf.data(), M, N, K, 2);
      int bad = 0, bad_f32 = 0;
      for (int32_t m = 0; m < M; ++m)
        for (int32_t n = 0; n < N; ++n) {
          double exact = from_bf16(b[n]);
          for (int32_t k = 0; k < K; ++k)
            exact += static_cast<double>(from_bf16(x[m * K + k])) * from_bf16(w[static_cast<size_t>(n) * K + k]);
          bad += from_bf16(y[m * N + n]) != round_bf16(exact);
          bad_f32 += static_cast<double>(yf[m * N + n]) != exact;
        }
      CHECK_EQ(bad, 0);
      CHECK_EQ(bad_f32, 0);
    }
  }
}

}  // namespace

TEST(integer_inputs_give_the_rounded_exact_result_at_every_level) {
  const pyengine::CpuIsa previous = pyengine::cpu_isa();
  for (pyengine::CpuIsa level : pyengine::supported_cpu_isas()) {
    pyengine::set_cpu_isa(level);
    std::cout << "  level " << pyengine::cpu_isa_name(level) << "\n";
    integer_inputs_at_the_active_level();
  }
  pyengine::set_cpu_isa(previous);
}

TEST(arguments_are_validated) {
  uint16_t buf[4] = {};
  CHECK_THROWS(linear_bf16(nullptr, buf, buf, nullptr, 1, 1, 1, 1), std::invalid_argument, "y:");
  CHECK_THROWS(linear_bf16(buf, nullptr, buf, nullptr, 1, 1, 1, 1), std::invalid_argument, "x:");
  CHECK_THROWS(linear_bf16(buf, buf, nullptr, nullptr, 1, 1, 1, 1), std::invalid_argument, "weight:");
  CHECK_THROWS(linear_bf16(buf, buf, buf, nullptr, 0, 1, 1, 1), std::invalid_argument, "M:");
  CHECK_THROWS(linear_bf16(buf, buf, buf, nullptr, kLinearBf16MaxRows + 1, 1, 1, 1),
               std::invalid_argument, "M:");
  CHECK_THROWS(linear_bf16(buf, buf, buf, nullptr, 1, 0, 1, 1), std::invalid_argument, "N:");
  CHECK_THROWS(linear_bf16(buf, buf, buf, nullptr, 1, 1, 0, 1), std::invalid_argument, "K:");
}

TEST_MAIN()
