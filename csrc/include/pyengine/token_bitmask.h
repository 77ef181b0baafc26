// Structured output: masking the logits of the tokens a grammar does not allow next.
#pragma once

#include <cstdint>

namespace pyengine::kernels {

// Row r of `logits` (float32, num_rows rows of stride logits_stride) keeps token t's logit when
// bit t % 32 of bitmask[r * bitmask_stride + t / 32] is set and gets -inf otherwise (xgrammar's
// bitmask layout: int32 words, least significant bit first), for t < vocab_size. Words whose
// bits are all set are skipped and words with none set are filled, so a grammar state that
// allows a few tokens costs little more than a memset. Throws std::invalid_argument for bad
// sizes or strides.
void apply_token_bitmask(float* logits, int64_t logits_stride, const int32_t* bitmask, int64_t bitmask_stride,
                         int32_t num_rows, int32_t vocab_size, int32_t num_threads);

}  // namespace pyengine::kernels
