// Batch-1 decode attention of the W5 model (qwen3-0.6b shape: 28 layers, 16 query heads, 8 KV
// heads of 128, fp16 cache, 16 tokens a block) from DRAM: one step's paged_attention over every
// layer for one sequence of each context length, with the KV pool in 4 KiB pages and in 2 MiB
// pages (madvise(MADV_HUGEPAGE), as the engine allocates it), in the same run. Prints per step
// the time and the KV bytes read per second, and in parentheses the sum of the layers' median
// calls (the steadier figure for comparing builds on a shared host). A 512 MB read between steps
// pushes the cache out of every cache level, as a decode step's weight stream does.
//
//   decode_attention [threads] [contexts, comma-separated] [steps]
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "pyengine/kernels.h"

namespace {

constexpr int kLayers = 28, kHeads = 16, kKvHeads = 8, kHeadDim = 128, kTokensPerBlock = 16;
constexpr int kBlocks = 160;  // 2,560 tokens a layer
constexpr size_t kHugePage = size_t{2} << 20;

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// fp16 K and V of every layer, [layer][K/V][block][kv head][token][dim], in one mapping.
struct Pool {
  uint16_t* base = nullptr;
  size_t bytes = 0;
  explicit Pool(bool huge) {
    const size_t n = size_t{kLayers} * 2 * kBlocks * kKvHeads * kTokensPerBlock * kHeadDim;
    bytes = (n * sizeof(uint16_t) + kHugePage - 1) / kHugePage * kHugePage;
    void* p = mmap(nullptr, bytes + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) std::abort();
    base = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(p) + kHugePage - 1) & ~(kHugePage - 1));
    madvise(base, bytes, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    for (size_t i = 0; i < n; ++i) base[i] = static_cast<uint16_t>(0x3000 + (i * 2654435761u >> 22) % 1024);
  }
  const uint16_t* k(int layer) const {
    return base + size_t{2} * layer * kBlocks * kKvHeads * kTokensPerBlock * kHeadDim;
  }
  const uint16_t* v(int layer) const { return k(layer) + size_t{kBlocks} * kKvHeads * kTokensPerBlock * kHeadDim; }
};

// Seconds of one step (all layers) at this context: the median step, and the sum of each layer's
// median call (steadier on a shared host: one slow moment moves one call, not the step).
struct StepTimes {
  double step, layers;
};

StepTimes step_seconds(const Pool& pool, int context, int threads, int steps, std::vector<char>& flush) {
  std::vector<float> q(kHeads * kHeadDim), out(kHeads * kHeadDim);
  for (size_t i = 0; i < q.size(); ++i) q[i] = static_cast<float>(i % 13) * 0.05f - 0.3f;
  std::vector<int32_t> table(kBlocks);
  for (int b = 0; b < kBlocks; ++b) table[b] = b;
  const int32_t query_start[2] = {0, 1}, seq_len[1] = {context};
  std::vector<double> times;
  std::vector<std::vector<double>> layer_times(kLayers);
  volatile char sink = 0;
  for (int s = 0; s < steps + 1; ++s) {
    for (size_t i = 0; i < flush.size(); i += 64) sink = sink + flush[i];
    const double t0 = now();
    double t = t0;
    for (int l = 0; l < kLayers; ++l) {
      pyengine::kernels::paged_attention(out.data(), kHeads * kHeadDim, q.data(), kHeads * kHeadDim,
                                         pyengine::kernels::DType::kFloat32, pool.k(l), pool.v(l),
                                         pyengine::kernels::DType::kFloat16, query_start, seq_len, table.data(), 1,
                                         1, kBlocks, kHeads, kKvHeads, kHeadDim, kTokensPerBlock, kBlocks,
                                         1.0f / 11.3f, 0, 0.0f, threads);
      const double t1 = now();
      if (s > 0) layer_times[l].push_back(t1 - t);
      t = t1;
    }
    if (s > 0) times.push_back(t - t0);  // the first: warm-up
  }
  auto median = [](std::vector<double>& v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  StepTimes r{median(times), 0.0};
  for (auto& lt : layer_times) r.layers += median(lt);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  std::vector<int> contexts;
  std::stringstream list(argc > 2 ? argv[2] : "64,192,1024,2048");
  for (std::string item; std::getline(list, item, ',');) contexts.push_back(std::stoi(item));
  const int steps = argc > 3 ? std::atoi(argv[3]) : 21;
  for (int c : contexts)
    if (c < 1 || c > kBlocks * kTokensPerBlock) {
      std::fprintf(stderr, "context %d: must be in [1, %d]\n", c, kBlocks * kTokensPerBlock);
      return 2;
    }
  const Pool small_pages(false), huge_pages(true);
  std::vector<char> flush(size_t{512} << 20, 1);
  std::printf("decode attention, %d layers x %d KV heads x %d (fp16 cache), %d threads, median of %d steps "
              "(and the sum of the layers' median calls)\n",
              kLayers, kKvHeads, kHeadDim, threads, steps);
  std::printf("%8s  %34s  %34s\n", "context", "4 KiB pages", "2 MiB pages");
  for (int c : contexts) {
    const double kv_bytes = double{kLayers} * c * kKvHeads * kHeadDim * 2 * sizeof(uint16_t);
    const StepTimes a = step_seconds(small_pages, c, threads, steps, flush);
    const StepTimes b = step_seconds(huge_pages, c, threads, steps, flush);
    std::printf("%8d  %9.1f us %6.1f GB/s (%9.1f)  %9.1f us %6.1f GB/s (%9.1f)\n", c, a.step * 1e6,
                kv_bytes / a.step / 1e9, a.layers * 1e6, b.step * 1e6, kv_bytes / b.step / 1e9, b.layers * 1e6);
  }
  return 0;
}
