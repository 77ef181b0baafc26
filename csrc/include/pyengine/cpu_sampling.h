// Greedy sampling on the CPU: the argmax of each row of fp32 logits.
#pragma once

#include <cstdint>

namespace pyengine::kernels {

// out[r] = the index of the largest value of row r of `logits` (num_rows rows of `vocab_size`
// values, `logits_stride` apart), as torch.argmax defines it: the first of equal largest values,
// and the first NaN where a row has one. Long rows are split between `num_threads` threads (<= 0:
// OpenMP's default; the result does not depend on it). Throws std::invalid_argument for bad
// sizes or strides.
void argmax_rows(int32_t* out, const float* logits, int64_t logits_stride, int32_t num_rows, int32_t vocab_size,
                 int32_t num_threads = 1);

}  // namespace pyengine::kernels
