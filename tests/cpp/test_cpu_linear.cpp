// linear_bf16 / linear_f32 through the C++ API, at every instruction-set level this CPU has:
// exact results where fp32 arithmetic is exact (small integers), so any order of accumulation
// must give the bf16 rounding of the exact value (and in fp32 the exact value), for every tail
// length and tile edge; no level reads past the last weight row; argument errors.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <random>
#include <stdexcept>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

#include "pyengine/cpu_isa.h"
#include "pyengine/cpu_linear.h"
#include "isa_levels.h"
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

// y = x . W^T + b for small-integer x, W and b (or no bias): fp32 sums below 2^24 are exact
// whatever the order, so linear_f32 must give the exact value and linear_bf16 its bf16 rounding.
void check_integer_inputs(std::mt19937& rng, int32_t M, int32_t N, int32_t K, bool with_bias) {
  std::uniform_int_distribution<int> small(-4, 4), big(-300, 300);
  std::vector<uint16_t> x(M * K), w(static_cast<size_t>(N) * K), b(N), y(M * N);
  for (auto& v : x) v = to_bf16_exact(static_cast<float>(small(rng)));
  for (auto& v : w) v = to_bf16_exact(static_cast<float>(small(rng)));
  for (auto& v : b) v = to_bf16_exact(round_bf16(big(rng)));  // a bf16 value
  const uint16_t* bias = with_bias ? b.data() : nullptr;
  linear_bf16(y.data(), x.data(), w.data(), bias, M, N, K, 2);
  // the same values in fp32 (sums below 2^24: every partial sum is exact)
  std::vector<float> xf(x.size()), wf(w.size()), bf(b.size()), yf(y.size());
  for (size_t i = 0; i < x.size(); ++i) xf[i] = from_bf16(x[i]);
  for (size_t i = 0; i < w.size(); ++i) wf[i] = from_bf16(w[i]);
  for (size_t i = 0; i < b.size(); ++i) bf[i] = from_bf16(b[i]);
  linear_f32(yf.data(), xf.data(), wf.data(), with_bias ? bf.data() : nullptr, M, N, K, 2);
  int bad = 0, bad_f32 = 0;
  for (int32_t m = 0; m < M; ++m)
    for (int32_t n = 0; n < N; ++n) {
      double exact = with_bias ? from_bf16(b[n]) : 0.0;
      for (int32_t k = 0; k < K; ++k)
        exact += static_cast<double>(from_bf16(x[m * K + k])) * from_bf16(w[static_cast<size_t>(n) * K + k]);
      bad += from_bf16(y[m * N + n]) != round_bf16(exact);
      bad_f32 += static_cast<double>(yf[m * N + n]) != exact;
    }
  if (bad != 0 || bad_f32 != 0)
    std::cerr << "  M=" << M << " N=" << N << " K=" << K << " bias=" << with_bias << "\n";
  CHECK_EQ(bad, 0);
  CHECK_EQ(bad_f32, 0);
}

void integer_inputs_at_the_active_level() {
  std::mt19937 rng(7);
  for (int32_t M : {1, 2, 5, 15})
    for (auto [N, K] : {std::pair{37, 45}, {13, 1537}, {8, 32}, {1000, 576}})
      check_integer_inputs(rng, M, N, K, true);
}

// Every length of a row's last partial step (K mod 8, 16 and 32), K below one step, row counts
// on both sides of the kernels' tiles (x rows 1..5 and 15, weight rows 1..9), with and without
// bias.
void tails_at_the_active_level() {
  std::mt19937 rng(11);
  for (int32_t K : {1, 3, 7, 8, 9, 15, 16, 17, 31, 33, 40, 63, 65, 100, 129})
    for (int32_t M : {1, 2, 3, 4, 5, 15})
      for (int32_t N : {1, 3, 4, 5, 9}) check_integer_inputs(rng, M, N, K, (K + M + N) % 2 == 0);
}

// The weights end where an inaccessible page begins: a kernel that read past the last row
// (instead of masking or copying its tail) would fault.
template <typename T>
void no_read_past_the_weights_at_the_active_level() {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  void* mem = mmap(nullptr, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  CHECK(mem != MAP_FAILED);
  if (mem == MAP_FAILED) return;
  CHECK_EQ(mprotect(static_cast<char*>(mem) + page, page, PROT_NONE), 0);
  for (int32_t K : {1, 5, 13, 45, 77})
    for (int32_t M : {1, 3}) {
      const int32_t N = 5;
      const size_t count = static_cast<size_t>(N) * K;
      T* w = reinterpret_cast<T*>(static_cast<char*>(mem) + page) - count;
      for (size_t i = 0; i < count; ++i) w[i] = T{};
      std::vector<T> x(static_cast<size_t>(M) * K), y(static_cast<size_t>(M) * N);
      for (size_t i = 0; i < x.size(); ++i) {
        if constexpr (sizeof(T) == 2)
          x[i] = to_bf16_exact(1.0f);
        else
          x[i] = 1.0f;
      }
      for (int32_t n = 0; n < N; ++n) {
        if constexpr (sizeof(T) == 2)
          w[static_cast<size_t>(n) * K + K - 1] = to_bf16_exact(static_cast<float>(n + 1));
        else
          w[static_cast<size_t>(n) * K + K - 1] = static_cast<float>(n + 1);
      }
      if constexpr (sizeof(T) == 2)
        linear_bf16(y.data(), x.data(), w, nullptr, M, N, K, 1);
      else
        linear_f32(y.data(), x.data(), w, nullptr, M, N, K, 1);
      for (int32_t m = 0; m < M; ++m)
        for (int32_t n = 0; n < N; ++n) {
          float v;
          if constexpr (sizeof(T) == 2)
            v = from_bf16(y[m * N + n]);
          else
            v = y[m * N + n];
          CHECK_EQ(v, static_cast<float>(n + 1));
        }
    }
  munmap(mem, 2 * page);
}

}  // namespace

TEST(integer_inputs_give_the_rounded_exact_result_at_every_level) {
  at_every_level_logged([] { integer_inputs_at_the_active_level(); });
}

TEST(every_tail_length_and_tile_edge_is_exact_at_every_level) {
  at_every_level_logged([] { tails_at_the_active_level(); });
}

TEST(no_level_reads_past_the_last_weight_row) {
  at_every_level_logged([] {
    no_read_past_the_weights_at_the_active_level<uint16_t>();
    no_read_past_the_weights_at_the_active_level<float>();
  });
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
