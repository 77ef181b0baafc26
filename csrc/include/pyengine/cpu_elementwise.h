// CPU kernels for the memory-bound steps between a decoder layer's matmuls, in bfloat16 or
// float16: each replaces several torch operations (and their per-call overhead, which
// dominates a batch-1 decode step) with one pass over the rows.
//
// Each follows transformers' operation order and rounding: math in fp32, the result of every
// step that transformers stores in the activation dtype rounded to it (nearest even). Rows are
// `*_stride` elements apart; the elements of a row are contiguous. Invalid arguments throw
// std::invalid_argument naming the argument. `num_threads` <= 0 uses OpenMP's default; rows
// are split across threads only when there are several.
#pragma once

#include <cstdint>

#include "pyengine/kernels.h"

namespace pyengine::kernels {

// RMSNorm of each row of x: out = weight * to_dtype(x * rsqrt(mean(x^2) + eps)).
// With `residual` (not null): first residual = to_dtype(residual + x) in place, and the norm is
// taken of that sum (a decoder layer's residual add fused with the next norm).
void rms_norm(void* out, int64_t out_stride, const void* x, int64_t x_stride, void* residual,
              int64_t residual_stride, const void* weight, DType dtype, int32_t num_rows,
              int32_t hidden, float eps, int32_t num_threads);

// Rotary embedding in place (rotate-half layout) on x [num_tokens, num_heads, head_dim], heads
// contiguous within a row: for i < head_dim / 2, with a = x[i], b = x[i + head_dim / 2],
//   x[i]                = to_dtype(to_dtype(a * cos[i]) + to_dtype(-b * sin[i]))
//   x[i + head_dim / 2] = to_dtype(to_dtype(b * cos[i + d/2]) + to_dtype(a * sin[i + d/2]))
// where cos/sin are the rows `positions[t]` of [max_position, head_dim] tables.
void rotary_embedding(void* x, int64_t x_stride, int32_t num_tokens, int32_t num_heads,
                      int32_t head_dim, const void* cos, const void* sin, int32_t max_position,
                      const int32_t* positions, DType dtype, int32_t num_threads);

// SwiGLU: out[t, i] = to_dtype(to_dtype(silu(gate)) * up) with gate = gate_up[t, i] and
// up = gate_up[t, inter + i]; gate_up rows are 2 * inter, out rows inter elements.
void silu_mul(void* out, const void* gate_up, DType dtype, int32_t num_rows, int32_t inter,
              int32_t num_threads);

}  // namespace pyengine::kernels
