// Internal interface between the front ends of the fused elementwise kernels and the KV store
// (elementwise.cpp, kv_store.cpp: argument checks, ISA dispatch) and their compute code
// (elementwise_impl.h, compiled once per instruction-set level).
#pragma once

#include <cstdint>

#include "pyengine/kernels.h"

namespace pyengine::kernels::cpu {

struct RmsNormArgs {
  void* out;
  int64_t out_stride;
  const void* x;
  int64_t x_stride;
  void* residual;  // null: no residual add
  int64_t residual_stride;
  const void* weight;
  DType dtype;
  int32_t rows, hidden;
  float eps;
  int32_t num_threads;
};

struct RotaryArgs {
  void* x;
  int64_t x_stride;
  int32_t tokens, heads, head_dim;
  const void* cos;
  const void* sin;
  const int32_t* positions;  // checked: inside the tables
  DType dtype;
  int32_t num_threads;
};

struct SiluMulArgs {
  void* out;
  const void* gate_up;
  DType dtype;
  int32_t rows, inter;
  int32_t num_threads;
};

struct StoreKvArgs {
  const void* key;
  const void* value;
  int64_t key_row_stride, value_row_stride;
  DType src_dtype;
  void* k_cache;
  void* v_cache;
  DType cache_dtype;
  const int32_t* slot_mapping;
  int32_t num_tokens, num_kv_heads, head_dim, tokens_per_block;
};

// One span [begin, end) of a row of fp32 logits, for argmax_rows: the first NaN's index (-1:
// none), the largest value's order key (the float's bits with a negative value's magnitude bits
// flipped, so that keys order as the values; NaNs aside) and the first index holding that key.
struct ArgmaxSpan {
  int32_t first_nan;
  int32_t key;
  int32_t index;
};

#define PYENGINE_ELEMENTWISE_ENTRY_POINTS                                       \
  void rms_norm(const RmsNormArgs& a);                                          \
  void rotary_embedding(const RotaryArgs& a);                                   \
  void silu_mul(const SiluMulArgs& a);                                          \
  void store_kv(const StoreKvArgs& a);                                          \
  void argmax_span(const float* x, int32_t begin, int32_t end, ArgmaxSpan& out);

namespace isa_generic { PYENGINE_ELEMENTWISE_ENTRY_POINTS }
namespace isa_avx2 { PYENGINE_ELEMENTWISE_ENTRY_POINTS }
namespace isa_avx512 { PYENGINE_ELEMENTWISE_ENTRY_POINTS }
namespace isa_neon { PYENGINE_ELEMENTWISE_ENTRY_POINTS }

#undef PYENGINE_ELEMENTWISE_ENTRY_POINTS

}  // namespace pyengine::kernels::cpu
