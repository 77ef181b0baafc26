// The linear layers of one batch-1 decode step of the W2 model (smollm-135m shape: 30 layers of
// qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536, then a 49,152-row lm_head), run
// back to back through linear_bf16 / linear_f32, against a plain streaming read (a sum over the
// same weights, on the same threads) in the same run. Prints the weights' bytes per second of
// each, and their ratio: how close the kernels come to reading memory as fast as it can be read.
// Several copies of the model's weights are cycled so that every step reads from DRAM.
//
//   decode_linears [bf16|f32] [steps] [threads]
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "pyengine/cpu_linear.h"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace {

struct Shape {
  int32_t n, k;
};

const Shape kLayer[] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};
constexpr int kLayers = 30;
const Shape kLmHead = {49152, 576};
constexpr int64_t kCycleBytes = int64_t{1} << 30;  // copies of the weights beyond any L3

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// A streaming read of the n 32-bit words at p by `threads` threads, each its contiguous share
// (what a split over output columns reads), summed as integers (a reduction the compiler
// vectorizes) so that the loads cannot be dropped.
uint32_t stream_read(const uint32_t* p, int64_t n, int threads) {
  uint32_t total = 0;
#pragma omp parallel for num_threads(threads) reduction(+ : total) schedule(static)
  for (int64_t i = 0; i < n; ++i) total += p[i];
  return total;
}

template <typename T>
struct Model {
  std::vector<std::vector<T>> layers;  // kLayers * 4 matrices, then the lm_head
  int64_t bytes = 0;
  explicit Model(unsigned seed) {
    std::srand(seed);
    auto add = [&](Shape s) {
      std::vector<T> w(static_cast<size_t>(s.n) * s.k);
      for (auto& v : w) {
        const float f = (std::rand() % 2001 - 1000) * 1e-4f;
        if constexpr (sizeof(T) == 2) {
          uint32_t u;
          std::memcpy(&u, &f, 4);
          v = static_cast<T>(u >> 16);
        } else {
          v = f;
        }
      }
      bytes += static_cast<int64_t>(w.size()) * sizeof(T);
      layers.push_back(std::move(w));
    };
    for (int l = 0; l < kLayers; ++l)
      for (const Shape& s : kLayer) add(s);
    add(kLmHead);
  }
};

template <typename T>
void linear(T* y, const T* x, const T* w, int32_t n, int32_t k, int threads) {
  if constexpr (sizeof(T) == 2)
    pyengine::kernels::linear_bf16(y, x, w, nullptr, 1, n, k, threads);
  else
    pyengine::kernels::linear_f32(y, x, w, nullptr, 1, n, k, threads);
}

template <typename T>
int run(int steps, int threads) {
  std::vector<Model<T>> models;
  models.emplace_back(1);
  const int copies = static_cast<int>(std::max<int64_t>(2, kCycleBytes / models[0].bytes));
  for (int c = 1; c < copies; ++c) models.emplace_back(c + 1);
  std::vector<T> x(49152, static_cast<T>(0)), y(49152);
  for (size_t i = 0; i < x.size(); ++i) {
    if constexpr (sizeof(T) == 2)
      x[i] = static_cast<T>(0x3f80 + i % 7);
    else
      x[i] = 1.0f + static_cast<float>(i % 7) * 0.01f;
  }
  // the same bytes as one buffer: the streaming read with no call boundaries
  std::vector<uint32_t> flat(static_cast<size_t>(models[0].bytes / 4) * 2, 1u);
  std::vector<double> kernel, read, read_flat;
  double per_shape[5] = {0, 0, 0, 0, 0};  // seconds in each of the 4 layer shapes and the lm_head
  volatile uint32_t sink = 0;
  for (int s = 0; s < steps + 2; ++s) {
    const Model<T>& m = models[s % copies];
    double t0 = now();
    double t = t0;
    for (int l = 0; l < kLayers; ++l)
      for (int i = 0; i < 4; ++i) {
        linear(y.data(), x.data(), m.layers[l * 4 + i].data(), kLayer[i].n, kLayer[i].k, threads);
        const double u = now();
        if (s >= 2) per_shape[i] += u - t;
        t = u;
      }
    linear(y.data(), x.data(), m.layers.back().data(), kLmHead.n, kLmHead.k, threads);
    double t1 = now();
    if (s >= 2) per_shape[4] += t1 - t;
    const Model<T>& r = models[(s + 1) % copies];
    uint32_t acc = 0;
    for (const auto& w : r.layers)
      acc += stream_read(reinterpret_cast<const uint32_t*>(w.data()),
                         static_cast<int64_t>(w.size()) * sizeof(T) / 4, threads);
    sink = sink + acc;
    double t2 = now();
    sink = sink + stream_read(flat.data() + (s % 2) * (flat.size() / 2), static_cast<int64_t>(flat.size() / 2),
                              threads);
    double t3 = now();
    if (s >= 2) kernel.push_back(t1 - t0), read.push_back(t2 - t1), read_flat.push_back(t3 - t2);
  }
  std::sort(kernel.begin(), kernel.end());
  std::sort(read.begin(), read.end());
  std::sort(read_flat.begin(), read_flat.end());
  const double gb = models[0].bytes / 1e9;
  const double k = kernel[kernel.size() / 2], r = read[read.size() / 2];
  std::printf("%s, %d threads, %.1f MB of weights per step, median of %d steps:\n",
              sizeof(T) == 2 ? "bf16" : "f32", threads, gb * 1e3, steps);
  std::printf("  linears          %7.3f ms  %6.1f GB/s\n", k * 1e3, gb / k);
  std::printf("  read, per matrix %7.3f ms  %6.1f GB/s\n", r * 1e3, gb / r);
  const double f = read_flat[read_flat.size() / 2];
  std::printf("  read, one buffer %7.3f ms  %6.1f GB/s\n", f * 1e3, gb / f);
  const char* names[5] = {"qkv", "o", "gate_up", "down", "lm_head"};
  for (int i = 0; i < 5; ++i) {
    const Shape sh = i < 4 ? kLayer[i] : kLmHead;
    const double calls = static_cast<double>(steps) * (i < 4 ? kLayers : 1);
    const double call_s = per_shape[i] / calls;
    std::printf("    %-8s %5d x %4d: %7.1f us a call, %6.1f GB/s\n", names[i], sh.n, sh.k, call_s * 1e6,
                static_cast<double>(sh.n) * sh.k * sizeof(T) / call_s / 1e9);
  }
  std::printf("  linears / read: %.2f, / read of one buffer: %.2f\n", r / k, f / k);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string dtype = argc > 1 ? argv[1] : "bf16";
  const int steps = argc > 2 ? std::atoi(argv[2]) : 30;
  const int threads = argc > 3 ? std::atoi(argv[3]) : 2;
  if (dtype == "bf16") return run<uint16_t>(steps, threads);
  if (dtype == "f32") return run<float>(steps, threads);
  std::fprintf(stderr, "usage: %s [bf16|f32] [steps] [threads]\n", argv[0]);
  return 2;
}
