// argmax_rows: see pyengine/cpu_sampling.h.
#include "parallel.h"

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "column_split.h"
#include "elementwise_common.h"
#include "isa_target.h"
#include "pyengine/cpu_sampling.h"

namespace pyengine::kernels {

namespace {

// Below this many values a row's argmax is one span (a fork/join would cost more).
constexpr int32_t kMinSpanValues = 16384;

// The row's answer from its spans' (in order): the first NaN of the first span holding one; else
// the largest key, the first span holding it giving the index; a largest value of zero, which
// -0.0 and 0.0 share (keys tell them apart, torch does not), by a scan for the first zero.
int32_t combine(const cpu::ArgmaxSpan* spans, int32_t n, const float* row, int32_t vocab_size) {
  for (int32_t s = 0; s < n; ++s)
    if (spans[s].first_nan >= 0) return spans[s].first_nan;
  int32_t best = -1;
  for (int32_t s = 0; s < n; ++s)
    if (spans[s].index >= 0 && (best < 0 || spans[s].key > spans[best].key)) best = s;
  if (best < 0) return 0;  // (not reached: a row without NaNs has a largest value)
  const int32_t key = spans[best].key;
  if (key == 0 || key == -1) {  // +0.0 or -0.0
    for (int32_t i = 0; i < vocab_size; ++i)
      if (row[i] == 0.0f) return i;
  }
  return spans[best].index;
}

}  // namespace

void argmax_rows(int32_t* out, const float* logits, int64_t logits_stride, int32_t num_rows, int32_t vocab_size,
                 int32_t num_threads) {
  if (num_rows < 0) throw std::invalid_argument("num_rows: must be >= 0, got " + std::to_string(num_rows));
  if (vocab_size <= 0)
    throw std::invalid_argument("vocab_size: must be positive, got " + std::to_string(vocab_size));
  if (logits_stride < vocab_size)
    throw std::invalid_argument("logits_stride: " + std::to_string(logits_stride) + " is smaller than vocab_size " +
                                std::to_string(vocab_size));
  if (num_rows > 0 && (out == nullptr || logits == nullptr)) throw std::invalid_argument("out/logits: null pointer");
  (void)cpu_isa();  // throws here if PYENGINE_CPU_ISA is invalid
  // Each row in contiguous spans, one per thread: the output projection's threads have just
  // written about these shares of the row, so each thread reads its own from its cache.
  const int32_t spans = std::max(1, std::min(cpu::resolve_threads(num_threads), vocab_size / kMinSpanValues));
  std::vector<cpu::ArgmaxSpan> found(static_cast<size_t>(num_rows) * spans);
  auto run = [&](int32_t r, int32_t s) {
    const cpu::GroupRange g = cpu::thread_groups(vocab_size, s, spans);
    PYENGINE_ISA_CALL(argmax_span, logits + r * logits_stride, g.begin, g.end, found[static_cast<size_t>(r) * spans + s]);
  };
  if (spans == 1) {
    for (int32_t r = 0; r < num_rows; ++r) run(r, 0);
  } else {
PYENGINE_OMP(parallel num_threads(spans))
    {
      for (int32_t s = cpu::thread_id(); s < spans; s += cpu::team_size())
        for (int32_t r = 0; r < num_rows; ++r) run(r, s);
    }
  }
  for (int32_t r = 0; r < num_rows; ++r)
    out[r] = combine(found.data() + static_cast<size_t>(r) * spans, spans, logits + r * logits_stride, vocab_size);
}

}  // namespace pyengine::kernels
