// One quantized linear call at one row of x (M = 1) with its weights in cache, per format (Q4_0,
// Q4_K, Q6_K interleaved) and shape, at one and at `threads` threads: what a call costs beside
// streaming its weights -- quantizing x, preparing it for the kernel, waking the other threads,
// and whatever the threads read from one another's caches. decode_formats measures the same
// kernels from DRAM, where a few microseconds a call hide in its run-to-run spread; here they
// show. (A call's x prepared by one thread and read by the others cost Q4_K 2-6 us a call at two
// threads on a 2-core Xeon, a third of a small matrix's time; the fix, each thread preparing its
// own copy, gave back ~3% of the W5 model's decode step.)
//
//   quant_calls [threads] [calls per shape and format]
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "pyengine/cpu_quant.h"

namespace {

namespace pk = pyengine::kernels;

struct Shape {
  int32_t n, k;
};
// The W5 model's widths (K = hidden 1024, attention 2048, intermediate 3072); 64 rows: a call
// that is almost all fixed cost; 1,024 rows of Q4_K at K = 3072 (1.8 MB) still fit a 2 MB L2.
const Shape kShapes[] = {{64, 1024}, {64, 3072}, {1024, 1024}, {1024, 2048}, {1024, 3072}};
struct Format {
  const char* name;
  pk::QuantType type;
};
const Format kFormats[] = {{"q4_0", pk::QuantType::kQ4_0x8}, {"q4_k", pk::QuantType::kQ4_Kx8}, {"q6_k", pk::QuantType::kQ6_Kx8}};

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// One format's weights for one shape, made from the same random values for every format.
std::vector<uint8_t> make_weights(const Format& f, const Shape& s) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<float> w(static_cast<size_t>(s.n) * s.k);
  for (float& v : w) v = normal(rng);
  const pk::QuantType plain = pk::plain_type(f.type);
  std::vector<uint8_t> rows(static_cast<size_t>(s.n * pk::quant_row_bytes(plain, s.k)));
  std::vector<uint8_t> group(static_cast<size_t>(s.n * pk::quant_row_bytes(f.type, s.k)));
  pk::quantize_rows(plain, w.data(), rows.data(), s.n, s.k, 0);
  pk::interleave_rows(plain, rows.data(), group.data(), s.n, s.k);
  return group;
}

// The median time of `calls` calls (after a tenth as many to warm up).
double median_call(const Format& f, const Shape& s, const std::vector<uint8_t>& weights, int threads, int calls) {
  std::vector<float> x(s.k), y(s.n);
  for (int32_t i = 0; i < s.k; ++i) x[i] = static_cast<float>(i % 17 - 8) * 0.01f;
  std::vector<double> times;
  for (int i = 0; i < calls + calls / 10; ++i) {
    const double t0 = now();
    pk::linear_quant(y.data(), s.n, x.data(), s.k, 1, weights.data(), f.type, s.n, s.k, nullptr, threads);
    if (i >= calls / 10) times.push_back(now() - t0);
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  const int calls = argc > 2 ? std::atoi(argv[2]) : 2000;
  if (threads < 1 || calls < 10) {
    std::fprintf(stderr, "usage: quant_calls [threads >= 1] [calls per shape and format >= 10]\n");
    return 2;
  }
  std::printf("one linear_quant call, M = 1, weights in cache: median of %d calls, us (against q4_0)\n", calls);
  std::printf("%7s  %11s", "threads", "N x K");
  for (const Format& f : kFormats) std::printf("  %16s", f.name);
  std::printf("\n");
  constexpr int kNumShapes = sizeof(kShapes) / sizeof(kShapes[0]);
  constexpr int kNumFormats = sizeof(kFormats) / sizeof(kFormats[0]);
  std::vector<uint8_t> weights[kNumShapes][kNumFormats];  // made once, timed at each thread count
  for (int i = 0; i < kNumShapes; ++i)
    for (int f = 0; f < kNumFormats; ++f) weights[i][f] = make_weights(kFormats[f], kShapes[i]);
  const int team[2] = {1, threads};
  for (int r = 0; r < (threads == 1 ? 1 : 2); ++r)
    for (int i = 0; i < kNumShapes; ++i) {
      std::printf("%7d  %5d x %4d", team[r], kShapes[i].n, kShapes[i].k);
      double times[kNumFormats];
      for (int f = 0; f < kNumFormats; ++f) {
        times[f] = median_call(kFormats[f], kShapes[i], weights[i][f], team[r], calls);
        std::printf("  %7.2f (%5.2fx)", times[f] * 1e6, times[f] / times[0]);
      }
      std::printf("\n");
    }
  return 0;
}
