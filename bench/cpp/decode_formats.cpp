// The linear layers of one batch-1 decode step of the W5 model (qwen3-0.6b shape: 28 layers of
// qkv 4096x1024, o 1024x2048, gate_up 6144x1024, down 1024x3072; no lm_head) in each weight
// format the engine runs -- bf16 (linear_bf16) and the interleaved Q8_0 / Q4_0 / Q4_K / Q5_K /
// Q6_K layouts (linear_quant) -- at one and at `threads` threads, the formats taking turns step by
// step in one process so that a change in the machine's memory speed hits them alike. Prints
// per format and thread count the step's time, the weight bytes read per second, and the time
// against bf16's: what a format's fewer bytes buy at batch 1 (equal rates give bf16's bytes over
// the format's: Q8_0 1.88x, Q4_0 3.56x, Q4_K 3.46x, Q5_K 2.84x, Q6_K 2.44x). Weights lie in 2 MiB pages, as
// the engine places them, and three copies are cycled so that every step reads from DRAM.
// `head`: the output projection instead (151,936 x 1024, the tied embedding table; its rows
// tile one block of 8,192 random rows), the one large matrix of a step. `qkv`, `o`, `gate_up` or
// `down`: the 28 layers' matrices of that one shape only (where a format's kernel loses time).
//
//   decode_formats [threads] [steps per format] [head | qkv | o | gate_up | down]
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "pyengine/cpu_linear.h"
#include "pyengine/cpu_quant.h"

namespace {

namespace pk = pyengine::kernels;

struct Shape {
  int32_t n, k;
};
// What a step reads: `layers` times the `shapes`.
struct Part {
  std::vector<Shape> shapes;
  int layers;
};
const Part kLayers{{{4096, 1024}, {1024, 2048}, {6144, 1024}, {1024, 3072}}, 28};
const Part kHead{{{151936, 1024}}, 1};
constexpr int32_t kTileRows = 8192;  // rows made (random) at a time; larger matrices repeat them
constexpr int kCopies = 3;
constexpr size_t kHugePage = size_t{2} << 20;

struct Format {
  const char* name;
  bool bf16;
  pk::QuantType type;  // unused for bf16
};
const Format kFormats[] = {{"bf16", true, pk::QuantType::kQ8_0},
                           {"q8_0", false, pk::QuantType::kQ8_0x8},
                           {"q4_0", false, pk::QuantType::kQ4_0x8},
                           {"q4_k", false, pk::QuantType::kQ4_Kx8},
                           {"q5_k", false, pk::QuantType::kQ5_Kx8},
                           {"q6_k", false, pk::QuantType::kQ6_Kx8}};

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int64_t row_bytes(const Format& f, int32_t k) { return f.bf16 ? int64_t{2} * k : pk::quant_row_bytes(f.type, k); }

// kCopies copies of a step's weights in one huge-page region: one layer's matrices made once
// (random values, quantized and interleaved as the engine's loader does), copied.
struct Weights {
  uint8_t* base = nullptr;
  int64_t layer_bytes = 0, step_bytes = 0;
  Weights(const Format& f, const Part& part) {
    for (const Shape& s : part.shapes) layer_bytes += s.n * row_bytes(f, s.k);
    step_bytes = layer_bytes * part.layers;
    const size_t total = static_cast<size_t>(step_bytes) * kCopies;
    void* p = mmap(nullptr, total + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) std::abort();
    base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(p) + kHugePage - 1) & ~(kHugePage - 1));
    madvise(base, total, MADV_HUGEPAGE);
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 0.02f);
    uint8_t* out = base;
    for (const Shape& s : part.shapes) {
      const int32_t rows = std::min(s.n, kTileRows);
      const int64_t tile_bytes = rows * row_bytes(f, s.k);
      std::vector<float> w(static_cast<size_t>(rows) * s.k);
      for (float& v : w) v = normal(rng);
      if (f.bf16) {
        auto* h = reinterpret_cast<uint16_t*>(out);
        for (size_t i = 0; i < w.size(); ++i) {
          uint32_t u;
          std::memcpy(&u, &w[i], 4);
          h[i] = static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
        }
      } else {
        std::vector<uint8_t> plain(static_cast<size_t>(tile_bytes));
        pk::quantize_rows(pk::plain_type(f.type), w.data(), plain.data(), rows, s.k, 0);
        pk::interleave_rows(pk::plain_type(f.type), plain.data(), out, rows, s.k);
      }
      const int64_t matrix_bytes = s.n * row_bytes(f, s.k);
      for (int64_t o = tile_bytes; o < matrix_bytes; o += tile_bytes)
        std::memcpy(out + o, out, static_cast<size_t>(std::min(tile_bytes, matrix_bytes - o)));
      out += matrix_bytes;
    }
    for (int64_t i = 1; i < int64_t{part.layers} * kCopies; ++i) std::memcpy(base + i * layer_bytes, base, layer_bytes);
  }
};

// One step: the part's linears of copy `copy`, M = 1.
void step(const Format& f, const Part& part, const Weights& w, int copy, int threads, const std::vector<float>& x,
          const std::vector<uint16_t>& xb, std::vector<float>& y, std::vector<uint16_t>& yb) {
  const uint8_t* p = w.base + copy * w.step_bytes;
  for (int l = 0; l < part.layers; ++l)
    for (const Shape& s : part.shapes) {
      if (f.bf16)
        pk::linear_bf16(yb.data(), xb.data(), reinterpret_cast<const uint16_t*>(p), nullptr, 1, s.n, s.k, threads);
      else
        pk::linear_quant(y.data(), s.n, x.data(), s.k, 1, p, f.type, s.n, s.k, nullptr, threads);
      p += s.n * row_bytes(f, s.k);
    }
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  const int steps = argc > 2 ? std::atoi(argv[2]) : 21;
  if (threads < 1 || steps < 1) {
    std::fprintf(stderr,
                 "usage: decode_formats [threads >= 1] [steps per format >= 1] [head | qkv | o | gate_up | down]\n");
    return 2;
  }
  const char* const kShapeNames[] = {"qkv", "o", "gate_up", "down"};  // kLayers' shapes, in order
  const bool head = argc > 3 && std::strcmp(argv[3], "head") == 0;
  int shape = -1;
  for (int i = 0; argc > 3 && i < 4; ++i)
    if (std::strcmp(argv[3], kShapeNames[i]) == 0) shape = i;
  if (argc > 3 && !head && shape < 0) {
    std::fprintf(stderr, "decode_formats: the third argument can only be head, qkv, o, gate_up or down, got '%s'\n",
                 argv[3]);
    return 2;
  }
  const Part one_shape{{shape < 0 ? Shape{} : kLayers.shapes[shape]}, kLayers.layers};
  const Part& part = head ? kHead : shape >= 0 ? one_shape : kLayers;
  constexpr int kNumFormats = sizeof(kFormats) / sizeof(kFormats[0]);
  std::vector<Weights> weights;
  for (const Format& f : kFormats) weights.emplace_back(f, part);
  int32_t max_n = 0, max_k = 0;
  for (const Shape& s : part.shapes) max_n = std::max(max_n, s.n), max_k = std::max(max_k, s.k);
  std::vector<float> x(max_k), y(max_n);
  std::vector<uint16_t> xb(max_k), yb(max_n);
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = static_cast<float>(static_cast<int>(i % 17) - 8) * 0.1f;
    uint32_t u;
    std::memcpy(&u, &x[i], 4);
    xb[i] = static_cast<uint16_t>(u >> 16);  // exact: the values have few significant bits
  }
  const int team[2] = {1, threads};
  const int runs = threads == 1 ? 1 : 2;
  if (head)
    std::printf("the output projection of the W5 model (151936 x 1024, M = 1)");
  else if (shape >= 0)
    std::printf("the %s linears of a W5 decode step (28 x %d x %d, M = 1)", kShapeNames[shape], part.shapes[0].n,
                part.shapes[0].k);
  else
    std::printf("the linears of a W5 decode step (28 x 4, M = 1)");
  std::printf(" from DRAM, median of %d steps a format\n", steps);
  std::printf("%7s  %6s  %10s  %9s  %14s\n", "threads", "format", "step", "GB/s", "vs bf16");
  for (int r = 0; r < runs; ++r) {
    const int nt = team[r];
    std::vector<std::vector<double>> times(kNumFormats);
    for (int s = 0; s < steps + 1; ++s)  // round 0: warm-up
      for (int i = 0; i < kNumFormats; ++i) {
        const double t0 = now();
        step(kFormats[i], part, weights[i], s % kCopies, nt, x, xb, y, yb);
        if (s > 0) times[i].push_back(now() - t0);
      }
    std::vector<double> median(kNumFormats);
    for (int i = 0; i < kNumFormats; ++i) {
      std::sort(times[i].begin(), times[i].end());
      median[i] = times[i][times[i].size() / 2];
    }
    for (int i = 0; i < kNumFormats; ++i)
      std::printf("%7d  %6s  %7.2f ms  %9.1f  %6.2fx faster\n", nt, kFormats[i].name, median[i] * 1e3,
                  weights[i].step_bytes / median[i] / 1e9, median[0] / median[i]);
  }
  return 0;
}
