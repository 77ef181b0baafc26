// apply_token_bitmask: see pyengine/token_bitmask.h.
#include "pyengine/token_bitmask.h"

#include "parallel.h"

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

namespace pyengine::kernels {

namespace {

// kLaneBit[b] = 1 << b
constexpr uint32_t kLaneBit[32] = {
    1u << 0,  1u << 1,  1u << 2,  1u << 3,  1u << 4,  1u << 5,  1u << 6,  1u << 7,  1u << 8,  1u << 9,  1u << 10,
    1u << 11, 1u << 12, 1u << 13, 1u << 14, 1u << 15, 1u << 16, 1u << 17, 1u << 18, 1u << 19, 1u << 20, 1u << 21,
    1u << 22, 1u << 23, 1u << 24, 1u << 25, 1u << 26, 1u << 27, 1u << 28, 1u << 29, 1u << 30, 1u << 31};

}  // namespace

void apply_token_bitmask(float* logits, int64_t logits_stride, const int32_t* bitmask, int64_t bitmask_stride,
                         int32_t num_rows, int32_t vocab_size, int32_t num_threads) {
  if (num_rows < 0) throw std::invalid_argument("num_rows: must be >= 0, got " + std::to_string(num_rows));
  if (vocab_size <= 0)
    throw std::invalid_argument("vocab_size: must be positive, got " + std::to_string(vocab_size));
  const int64_t words = (static_cast<int64_t>(vocab_size) + 31) / 32;
  if (logits_stride < vocab_size)
    throw std::invalid_argument("logits_stride: " + std::to_string(logits_stride) + " is smaller than vocab_size " +
                                std::to_string(vocab_size));
  if (bitmask_stride < words)
    throw std::invalid_argument("bitmask_stride: " + std::to_string(bitmask_stride) + " words cannot hold " +
                                std::to_string(vocab_size) + " tokens");
  if (num_rows > 0 && (logits == nullptr || bitmask == nullptr))
    throw std::invalid_argument("logits/bitmask: null pointer");
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t full_words = vocab_size / 32;  // words whose 32 tokens are all in the vocabulary
  // work items of kChunk words of one row: a batch of one row still spreads over the threads
  constexpr int64_t kChunk = 128;
  const int64_t chunks_per_row = (words + kChunk - 1) / kChunk;
  const int64_t items = static_cast<int64_t>(num_rows) * chunks_per_row;
  (void)num_threads;  // read by the OpenMP pragma only
PYENGINE_OMP(parallel for num_threads(num_threads > 0 ? num_threads : 1) schedule(static) if (items >= 32))
  for (int64_t item = 0; item < items; ++item) {
    const int64_t row = item / chunks_per_row, first = (item % chunks_per_row) * kChunk;
    const int64_t last = first + kChunk < words ? first + kChunk : words;
    const int32_t* mask = bitmask + row * bitmask_stride;
    float* row_logits = logits + row * logits_stride;
    for (int64_t word = first; word < last; ++word) {
      const uint32_t bits = static_cast<uint32_t>(mask[word]);
      if (bits == 0xFFFFFFFFu) continue;
      float* x = row_logits + word * 32;
      if (word < full_words) {
        // a fixed 32-lane select the compiler vectorizes (no branch per token; an AND with a
        // per-lane constant, as SSE2 has no per-lane variable shift)
        for (int32_t b = 0; b < 32; ++b) x[b] = (bits & kLaneBit[b]) ? x[b] : kNegInf;
      } else {
        for (int64_t b = 0; b < vocab_size - word * 32; ++b)
          if (!((bits >> b) & 1u)) x[b] = kNegInf;
      }
    }
  }
}

}  // namespace pyengine::kernels
