// apply_token_bitmask (pyengine/token_bitmask.h): every row x token against the bit it reads,
// at vocabulary sizes that end mid-word, with strides wider than the data, on 1 and 2 threads;
// bad sizes and strides throw.
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <stdexcept>
#include <vector>

#include "pyengine/token_bitmask.h"
#include "test_harness.h"

using pyengine::kernels::apply_token_bitmask;

namespace {

void check_against_bits(int32_t rows, int32_t vocab, int64_t logits_stride, int64_t mask_stride, int32_t threads) {
  std::mt19937 rng(rows * 7919 + vocab);
  std::vector<float> logits(rows * logits_stride);
  for (auto& v : logits) v = std::uniform_real_distribution<float>(-5, 5)(rng);
  std::vector<int32_t> mask(rows * mask_stride);
  for (int32_t r = 0; r < rows; ++r)
    for (int64_t w = 0; w < mask_stride; ++w) {
      // whole words allowed, whole words masked, and mixed ones
      const int kind = static_cast<int>(rng() % 3);
      mask[r * mask_stride + w] = kind == 0 ? -1 : kind == 1 ? 0 : static_cast<int32_t>(rng());
    }
  const std::vector<float> before = logits;
  apply_token_bitmask(logits.data(), logits_stride, mask.data(), mask_stride, rows, vocab, threads);
  for (int32_t r = 0; r < rows; ++r)
    for (int64_t t = 0; t < logits_stride; ++t) {
      const float got = logits[r * logits_stride + t], was = before[r * logits_stride + t];
      if (t >= vocab) {  // past the vocabulary (the stride's padding): untouched
        CHECK_EQ(got, was);
        continue;
      }
      const bool allowed = (static_cast<uint32_t>(mask[r * mask_stride + t / 32]) >> (t % 32)) & 1u;
      if (allowed) {
        CHECK_EQ(got, was);
      } else {
        CHECK(std::isinf(got) && got < 0);
      }
    }
}

}  // namespace

TEST(masks_exactly_the_tokens_whose_bit_is_clear) {
  for (int32_t threads : {1, 2})
    for (int32_t vocab : {1, 31, 32, 33, 100, 4099}) {
      const int64_t words = (vocab + 31) / 32;
      check_against_bits(3, vocab, vocab, words, threads);
      check_against_bits(5, vocab, vocab + 13, words + 2, threads);
    }
  check_against_bits(64, 49152, 49152, 1536, 2);  // a real vocabulary, over the parallel threshold
}

TEST(no_rows_is_a_no_op) { apply_token_bitmask(nullptr, 8, nullptr, 1, 0, 8, 2); }

TEST(bad_arguments_throw) {
  std::vector<float> logits(64);
  std::vector<int32_t> mask(2, -1);
  CHECK_THROWS(apply_token_bitmask(logits.data(), 64, mask.data(), 1, 1, 64, 1), std::invalid_argument,
               "bitmask_stride: 1 words cannot hold 64 tokens");
  CHECK_THROWS(apply_token_bitmask(logits.data(), 32, mask.data(), 2, 1, 64, 1), std::invalid_argument,
               "logits_stride: 32 is smaller than vocab_size 64");
  CHECK_THROWS(apply_token_bitmask(logits.data(), 64, mask.data(), 2, -1, 64, 1), std::invalid_argument,
               "num_rows: must be >= 0");
  CHECK_THROWS(apply_token_bitmask(logits.data(), 64, mask.data(), 2, 1, 0, 1), std::invalid_argument,
               "vocab_size: must be positive");
  CHECK_THROWS(apply_token_bitmask(nullptr, 64, mask.data(), 2, 1, 64, 1), std::invalid_argument, "null pointer");
}

TEST_MAIN()
