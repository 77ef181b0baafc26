// store_kv: scatter this step's K/V rows into their paged-cache slots (with dtype conversion).
// The front end: argument checks, then the build of the active level (elementwise_impl.h).
#include <cstdint>
#include <stdexcept>
#include <string>

#include "dtype_check.h"
#include "elementwise_common.h"
#include "isa_target.h"
#include "pyengine/kernels.h"

namespace pyengine::kernels {

void cpu::check_dtype(DType dtype, const char* name) {
  if (dtype == DType::kFloat8E4M3) {
    throw std::invalid_argument(std::string(name) +
                                ": float8_e4m3 is a CUDA-only KV cache type; the CPU kernels take "
                                "float32, bfloat16 or float16");
  }
  const auto v = static_cast<int32_t>(dtype);
  if (v < 0 || v > 2) {
    throw std::invalid_argument(std::string(name) + ": unknown DType value " + std::to_string(v));
  }
}

int dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return 4;
    case DType::kBFloat16:
    case DType::kFloat16:
      return 2;
    case DType::kFloat8E4M3:
      return 1;
  }
  throw std::invalid_argument("dtype: unknown DType value " +
                              std::to_string(static_cast<int32_t>(dtype)));
}

void check_kv_slots(const int32_t* slot_mapping, int32_t num_tokens, int32_t tokens_per_block,
                    int32_t num_blocks) {
  if (tokens_per_block <= 0) throw std::invalid_argument("tokens_per_block: must be > 0");
  const int64_t num_slots = static_cast<int64_t>(num_blocks) * tokens_per_block;
  for (int32_t t = 0; t < num_tokens; ++t)
    if (slot_mapping[t] >= num_slots)
      throw std::invalid_argument("slot_mapping: entry " + std::to_string(t) + " is " +
                                  std::to_string(slot_mapping[t]) + ", beyond the cache's " +
                                  std::to_string(num_slots) + " slots (" + std::to_string(num_blocks) +
                                  " blocks of " + std::to_string(tokens_per_block) + ")");
}

void store_kv(const void* key, const void* value, int64_t key_row_stride, int64_t value_row_stride,
              DType src_dtype, void* k_cache, void* v_cache, DType cache_dtype,
              const int32_t* slot_mapping, int32_t num_tokens, int32_t num_kv_heads,
              int32_t head_dim, int32_t tokens_per_block, int32_t num_blocks) {
  cpu::check_dtype(src_dtype, "src_dtype");
  cpu::check_dtype(cache_dtype, "cache_dtype");
  if (num_tokens < 0) throw std::invalid_argument("num_tokens: must be >= 0");
  if (num_kv_heads <= 0) throw std::invalid_argument("num_kv_heads: must be > 0");
  if (head_dim <= 0) throw std::invalid_argument("head_dim: must be > 0");
  if (tokens_per_block <= 0) throw std::invalid_argument("tokens_per_block: must be > 0");
  if (num_blocks < 0) throw std::invalid_argument("num_blocks: must be >= 0");
  if (num_tokens == 0) return;
  if (key == nullptr) throw std::invalid_argument("key: null pointer");
  if (value == nullptr) throw std::invalid_argument("value: null pointer");
  if (k_cache == nullptr) throw std::invalid_argument("k_cache: null pointer");
  if (v_cache == nullptr) throw std::invalid_argument("v_cache: null pointer");
  if (slot_mapping == nullptr) throw std::invalid_argument("slot_mapping: null pointer");
  const int64_t row = static_cast<int64_t>(num_kv_heads) * head_dim;
  if (key_row_stride < row)
    throw std::invalid_argument("key_row_stride: must be >= num_kv_heads * head_dim");
  if (value_row_stride < row)
    throw std::invalid_argument("value_row_stride: must be >= num_kv_heads * head_dim");

  check_kv_slots(slot_mapping, num_tokens, tokens_per_block, num_blocks);

  const cpu::StoreKvArgs a{key,          value,      key_row_stride, value_row_stride,
                           src_dtype,    k_cache,    v_cache,        cache_dtype,
                           slot_mapping, num_tokens, num_kv_heads,   head_dim,
                           tokens_per_block};
  PYENGINE_ISA_CALL(store_kv, a);
}

}  // namespace pyengine::kernels
