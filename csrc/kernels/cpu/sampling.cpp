// argmax_rows: see pyengine/cpu_sampling.h.
#include "pyengine/cpu_sampling.h"

#include <climits>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace pyengine::kernels {

namespace {

// Passes over a row that sits in cache (the output projection has just written it), each a plain
// loop gcc vectorizes: whether it holds a NaN; its largest value, in 16 independent lanes (the
// max of a set does not depend on the order it is taken in); the first index holding it.
bool has_nan(const float* x, int32_t n) {
  int32_t nans = 0;
  for (int32_t i = 0; i < n; ++i) nans += x[i] != x[i];
  return nans != 0;
}

// The largest value of a row without NaNs. On integers: float compare-selects are not vectorized
// without -ffast-math, integer ones are. Flipping the magnitude bits of negative values orders
// the bit patterns as the values (-0.0 just below +0.0: either is a largest value then).
float max_value(const float* x, int32_t n) {
  int32_t best = INT32_MIN;
  for (int32_t i = 0; i < n; ++i) {
    int32_t bits;
    std::memcpy(&bits, x + i, sizeof(bits));
    const int32_t key = bits ^ ((bits >> 31) & INT32_MAX);
    best = key > best ? key : best;
  }
  best ^= (best >> 31) & INT32_MAX;  // the flip is its own inverse
  float value;
  std::memcpy(&value, &best, sizeof(value));
  return value;
}

int32_t argmax_row(const float* x, int32_t n) {
  if (has_nan(x, n)) {
    for (int32_t i = 0; i < n; ++i)
      if (x[i] != x[i]) return i;
  }
  const float best = max_value(x, n);
  for (int32_t i = 0; i < n; ++i)
    if (x[i] == best) return i;
  return 0;  // (not reached: best is one of the values)
}

}  // namespace

void argmax_rows(int32_t* out, const float* logits, int64_t logits_stride, int32_t num_rows, int32_t vocab_size) {
  if (num_rows < 0) throw std::invalid_argument("num_rows: must be >= 0, got " + std::to_string(num_rows));
  if (vocab_size <= 0)
    throw std::invalid_argument("vocab_size: must be positive, got " + std::to_string(vocab_size));
  if (logits_stride < vocab_size)
    throw std::invalid_argument("logits_stride: " + std::to_string(logits_stride) + " is smaller than vocab_size " +
                                std::to_string(vocab_size));
  if (num_rows > 0 && (out == nullptr || logits == nullptr)) throw std::invalid_argument("out/logits: null pointer");
  for (int32_t r = 0; r < num_rows; ++r) out[r] = argmax_row(logits + r * logits_stride, vocab_size);
}

}  // namespace pyengine::kernels
