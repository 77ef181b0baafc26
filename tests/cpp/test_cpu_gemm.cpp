// gemm_f32 / gemm_bf16 through the C++ API, at every instruction-set level this CPU has:
// exact results where fp32 arithmetic is exact (small integers) for every panel, micro-kernel
// and K edge; random inputs within the error bound of an fp32 sum of K terms; every row's
// result bit for bit the same whatever M, its position among the rows and the thread count;
// no read past the weights or x; argument errors.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <random>
#include <stdexcept>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

#include "fp_reference.h"
#include "isa_levels.h"
#include "pyengine/cpu_gemm.h"
#include "pyengine/cpu_isa.h"
#include "test_harness.h"

using namespace pyengine::kernels;

namespace {

uint16_t bf16_exact(float f) {  // f must be representable in bf16
  return static_cast<uint16_t>(fpref::f32_bits(f) >> 16);
}

// y = x . W^T + b for small-integer x, W and b: every fp32 partial sum is exact, so gemm_f32
// must give the exact value and gemm_bf16 its bf16 rounding.
void check_integer_inputs(std::mt19937& rng, int32_t M, int32_t N, int32_t K, bool with_bias, int threads) {
  std::uniform_int_distribution<int> small(-4, 4), big(-300, 300);
  std::vector<float> x(static_cast<size_t>(M) * K), w(static_cast<size_t>(N) * K), b(N),
      y(static_cast<size_t>(M) * N, -1.0f);
  for (auto& v : x) v = static_cast<float>(small(rng));
  for (auto& v : w) v = static_cast<float>(small(rng));
  for (auto& v : b) v = static_cast<float>(fpref::bf16_value(fpref::to_bf16(big(rng))));  // bf16 values
  gemm_f32(y.data(), x.data(), w.data(), with_bias ? b.data() : nullptr, M, N, K, threads);
  std::vector<uint16_t> xh(x.size()), wh(w.size()), bh(b.size()), yh(y.size(), 0xffff);
  for (size_t i = 0; i < x.size(); ++i) xh[i] = bf16_exact(x[i]);
  for (size_t i = 0; i < w.size(); ++i) wh[i] = bf16_exact(w[i]);
  for (size_t i = 0; i < b.size(); ++i) bh[i] = bf16_exact(b[i]);
  gemm_bf16(yh.data(), xh.data(), wh.data(), with_bias ? bh.data() : nullptr, M, N, K, threads);
  int bad = 0, bad_bf16 = 0;
  for (int32_t m = 0; m < M; ++m)
    for (int32_t n = 0; n < N; ++n) {
      double exact = with_bias ? b[n] : 0.0;
      for (int32_t k = 0; k < K; ++k)
        exact += static_cast<double>(x[static_cast<size_t>(m) * K + k]) * w[static_cast<size_t>(n) * K + k];
      bad += static_cast<double>(y[static_cast<size_t>(m) * N + n]) != exact;
      bad_bf16 += yh[static_cast<size_t>(m) * N + n] != fpref::to_bf16(exact);
    }
  if (bad != 0 || bad_bf16 != 0)
    std::cerr << "  M=" << M << " N=" << N << " K=" << K << " bias=" << with_bias << "\n";
  CHECK_EQ(bad, 0);
  CHECK_EQ(bad_bf16, 0);
}

// Row counts on both sides of every level's panel height (8, 16, 32 rows) and its vectors
// (4, 8, 16 lanes), column counts on both sides of every micro-kernel width (4, 6, 12) and of
// the threads' shares, K on both sides of the 8 x 8 packing blocks.
void edges_at_the_active_level() {
  std::mt19937 rng(11);
  for (int32_t M : {1, 3, 4, 5, 8, 9, 15, 16, 17, 31, 32, 33, 47, 64, 65, 97})
    for (int32_t N : {1, 5, 6, 7, 12, 13, 25, 37})
      for (int32_t K : {1, 7, 8, 9, 17, 64})
        check_integer_inputs(rng, M, N, K, (M + N + K) % 2 == 0, (M + N) % 3 + 1);
  // bigger shapes, several packed panels per chunk of L2 and chunks of them, on 2 threads
  for (auto [M, N, K] : {std::tuple{257, 131, 576}, {130, 96, 1537}, {40, 300, 4099}})
    check_integer_inputs(rng, M, N, K, true, 2);
}

// Random values: |y - exact| <= gamma_K * sum_k |x w| (an fp32 sum of K terms in any order, each
// product rounded once or fused) plus the rounding of the bias addition.
void random_inputs_at_the_active_level() {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto [M, N, K] : {std::tuple{37, 29, 333}, {100, 64, 1024}, {19, 7, 2049}}) {
    std::vector<float> x(static_cast<size_t>(M) * K), w(static_cast<size_t>(N) * K), b(N), y(static_cast<size_t>(M) * N);
    for (auto& v : x) v = normal(rng);
    for (auto& v : w) v = normal(rng);
    for (auto& v : b) v = normal(rng);
    gemm_f32(y.data(), x.data(), w.data(), b.data(), M, N, K, 2);
    const double gamma = (K + 1) * fpref::kU32 / (1 - (K + 1) * fpref::kU32);
    int bad = 0;
    for (int32_t m = 0; m < M; ++m)
      for (int32_t n = 0; n < N; ++n) {
        double exact = b[n], magnitude = std::abs(b[n]);
        for (int32_t k = 0; k < K; ++k) {
          const double p = static_cast<double>(x[static_cast<size_t>(m) * K + k]) * w[static_cast<size_t>(n) * K + k];
          exact += p;
          magnitude += std::abs(p);
        }
        bad += !(std::abs(y[static_cast<size_t>(m) * N + n] - exact) <= gamma * magnitude);
      }
    CHECK_EQ(bad, 0);
  }
}

// Each row of a 70-row call equals, bit for bit, the same row computed alone, among 19 other
// rows at another position, and on 1, 2 or 3 threads.
void rows_are_batch_and_thread_invariant_at_the_active_level() {
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int32_t M = 70, N = 45, K = 300;
  std::vector<float> x(static_cast<size_t>(M) * K), w(static_cast<size_t>(N) * K), b(N);
  for (auto& v : x) v = normal(rng);
  for (auto& v : w) v = normal(rng);
  for (auto& v : b) v = normal(rng);
  std::vector<float> all(static_cast<size_t>(M) * N);
  gemm_f32(all.data(), x.data(), w.data(), b.data(), M, N, K, 2);
  for (int threads : {1, 3}) {
    std::vector<float> again(all.size());
    gemm_f32(again.data(), x.data(), w.data(), b.data(), M, N, K, threads);
    CHECK(again == all);
  }
  for (int32_t m : {0, 17, 33, 69}) {
    std::vector<float> one(N);
    gemm_f32(one.data(), x.data() + static_cast<size_t>(m) * K, w.data(), b.data(), 1, N, K, 1);
    CHECK(std::memcmp(one.data(), all.data() + static_cast<size_t>(m) * N, N * sizeof(float)) == 0);
    // row m as the last of 20 rows (the others from elsewhere in x)
    std::vector<float> twenty(static_cast<size_t>(20) * K), out(static_cast<size_t>(20) * N);
    for (int32_t i = 0; i < 19; ++i)
      std::memcpy(twenty.data() + static_cast<size_t>(i) * K, x.data() + static_cast<size_t>((m + 1 + i) % M) * K, K * sizeof(float));
    std::memcpy(twenty.data() + static_cast<size_t>(19) * K, x.data() + static_cast<size_t>(m) * K, K * sizeof(float));
    gemm_f32(out.data(), twenty.data(), w.data(), b.data(), 20, N, K, 2);
    CHECK(std::memcmp(out.data() + static_cast<size_t>(19) * N, all.data() + static_cast<size_t>(m) * N, N * sizeof(float)) == 0);
  }
}

// The weights, and in a second pass x, end where an inaccessible page begins: a kernel that read
// past the last weight row or the last row of x would fault.
template <typename T>
void no_read_past_the_inputs_at_the_active_level() {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  void* mem = mmap(nullptr, 4 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  CHECK(mem != MAP_FAILED);
  if (mem == MAP_FAILED) return;
  CHECK_EQ(mprotect(static_cast<char*>(mem) + 3 * page, page, PROT_NONE), 0);
  const auto one = [](float f) {
    if constexpr (sizeof(T) == 2)
      return static_cast<T>(bf16_exact(f));
    else
      return static_cast<T>(f);
  };
  for (bool x_last : {false, true})
    for (int32_t K : {1, 5, 13, 45})
      for (int32_t M : {1, 9, 20}) {
        const int32_t N = 7;
        const size_t wn = static_cast<size_t>(N) * K, xn = static_cast<size_t>(M) * K;
        T* end = reinterpret_cast<T*>(static_cast<char*>(mem) + 3 * page);
        T* w = x_last ? end - xn - wn : end - wn;
        T* x = x_last ? end - xn : end - wn - xn;
        for (size_t i = 0; i < wn; ++i) w[i] = one(0.0f);
        for (size_t i = 0; i < xn; ++i) x[i] = one(1.0f);
        for (int32_t n = 0; n < N; ++n) w[static_cast<size_t>(n) * K + K - 1] = one(static_cast<float>(n + 1));
        std::vector<T> y(static_cast<size_t>(M) * N);
        if constexpr (sizeof(T) == 2)
          gemm_bf16(y.data(), x, w, nullptr, M, N, K, 1);
        else
          gemm_f32(y.data(), x, w, nullptr, M, N, K, 1);
        for (int32_t m = 0; m < M; ++m)
          for (int32_t n = 0; n < N; ++n) CHECK_EQ(y[static_cast<size_t>(m) * N + n], one(static_cast<float>(n + 1)));
      }
  munmap(mem, 4 * page);
}

}  // namespace

TEST(integer_inputs_give_the_exact_result_at_every_edge_and_level) {
  at_every_level_logged([] { edges_at_the_active_level(); });
}

TEST(random_inputs_stay_within_the_fp32_sum_bound_at_every_level) {
  at_every_level_logged([] { random_inputs_at_the_active_level(); });
}

TEST(rows_do_not_depend_on_the_batch_or_the_threads_at_every_level) {
  at_every_level_logged([] { rows_are_batch_and_thread_invariant_at_the_active_level(); });
}

TEST(no_level_reads_past_the_weights_or_x) {
  at_every_level_logged([] {
    no_read_past_the_inputs_at_the_active_level<uint16_t>();
    no_read_past_the_inputs_at_the_active_level<float>();
  });
}

TEST(arguments_are_validated) {
  float buf[4] = {};
  CHECK_THROWS(gemm_f32(nullptr, buf, buf, nullptr, 1, 1, 1, 1), std::invalid_argument, "y:");
  CHECK_THROWS(gemm_f32(buf, nullptr, buf, nullptr, 1, 1, 1, 1), std::invalid_argument, "x:");
  CHECK_THROWS(gemm_f32(buf, buf, nullptr, nullptr, 1, 1, 1, 1), std::invalid_argument, "weight:");
  CHECK_THROWS(gemm_f32(buf, buf, buf, nullptr, 0, 1, 1, 1), std::invalid_argument, "M: must be > 0, got 0");
  CHECK_THROWS(gemm_f32(buf, buf, buf, nullptr, 1, -2, 1, 1), std::invalid_argument, "N: must be > 0, got -2");
  uint16_t h[4] = {};
  CHECK_THROWS(gemm_bf16(h, h, h, nullptr, 1, 1, 0, 1), std::invalid_argument, "K: must be > 0, got 0");
}

TEST_MAIN()
