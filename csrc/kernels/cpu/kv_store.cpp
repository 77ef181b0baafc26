// store_kv: scatter this step's K/V rows into their paged-cache slots (with dtype conversion).
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "dtype_check.h"
#include "dtype_convert.h"
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

namespace {

using cpu::bf16_t;
using cpu::fp16_t;

template <typename Src, typename Dst>
void convert_row(const Src* __restrict src, Dst* __restrict dst, int32_t n) {
  for (int32_t i = 0; i < n; ++i) cpu::store_f32(dst + i, cpu::to_f32(src[i]));
}

template <typename Src, typename Dst>
void store_typed(const void* key, const void* value, int64_t key_row_stride,
                 int64_t value_row_stride, void* k_cache, void* v_cache,
                 const int32_t* slot_mapping, int32_t num_tokens, int32_t num_kv_heads,
                 int32_t head_dim, int32_t tokens_per_block) {
  const Src* k = static_cast<const Src*>(key);
  const Src* v = static_cast<const Src*>(value);
  Dst* kc = static_cast<Dst*>(k_cache);
  Dst* vc = static_cast<Dst*>(v_cache);
  const int64_t work = static_cast<int64_t>(num_tokens) * num_kv_heads * head_dim;
#pragma omp parallel for schedule(static) if (work >= (int64_t{1} << 18))
  for (int32_t t = 0; t < num_tokens; ++t) {
    const int32_t slot = slot_mapping[t];
    if (slot < 0) continue;
    const int64_t block = slot / tokens_per_block;
    const int64_t off = slot % tokens_per_block;
    for (int32_t h = 0; h < num_kv_heads; ++h) {
      // cache index of (block, h, off, 0)
      const int64_t dst = ((block * num_kv_heads + h) * tokens_per_block + off) * head_dim;
      const Src* ks = k + t * key_row_stride + static_cast<int64_t>(h) * head_dim;
      const Src* vs = v + t * value_row_stride + static_cast<int64_t>(h) * head_dim;
      if constexpr (std::is_same_v<Src, Dst>) {
        std::memcpy(kc + dst, ks, sizeof(Src) * head_dim);
        std::memcpy(vc + dst, vs, sizeof(Src) * head_dim);
      } else {
        convert_row(ks, kc + dst, head_dim);
        convert_row(vs, vc + dst, head_dim);
      }
    }
  }
}

template <typename Src>
void store_dispatch_dst(DType cache_dtype, const void* key, const void* value,
                        int64_t key_row_stride, int64_t value_row_stride, void* k_cache,
                        void* v_cache, const int32_t* slot_mapping, int32_t num_tokens,
                        int32_t num_kv_heads, int32_t head_dim, int32_t tokens_per_block) {
  switch (cache_dtype) {
    case DType::kFloat32:
      return store_typed<Src, float>(key, value, key_row_stride, value_row_stride, k_cache,
                                     v_cache, slot_mapping, num_tokens, num_kv_heads, head_dim,
                                     tokens_per_block);
    case DType::kBFloat16:
      return store_typed<Src, bf16_t>(key, value, key_row_stride, value_row_stride, k_cache,
                                      v_cache, slot_mapping, num_tokens, num_kv_heads, head_dim,
                                      tokens_per_block);
    case DType::kFloat16:
      return store_typed<Src, fp16_t>(key, value, key_row_stride, value_row_stride, k_cache,
                                      v_cache, slot_mapping, num_tokens, num_kv_heads, head_dim,
                                      tokens_per_block);    case DType::kFloat8E4M3:  // CUDA-only; the entry points reject it before this
      break;
  }
}

}  // namespace

void store_kv(const void* key, const void* value, int64_t key_row_stride, int64_t value_row_stride,
              DType src_dtype, void* k_cache, void* v_cache, DType cache_dtype,
              const int32_t* slot_mapping, int32_t num_tokens, int32_t num_kv_heads,
              int32_t head_dim, int32_t tokens_per_block) {
  cpu::check_dtype(src_dtype, "src_dtype");
  cpu::check_dtype(cache_dtype, "cache_dtype");
  if (num_tokens < 0) throw std::invalid_argument("num_tokens: must be >= 0");
  if (num_kv_heads <= 0) throw std::invalid_argument("num_kv_heads: must be > 0");
  if (head_dim <= 0) throw std::invalid_argument("head_dim: must be > 0");
  if (tokens_per_block <= 0) throw std::invalid_argument("tokens_per_block: must be > 0");
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

  switch (src_dtype) {
    case DType::kFloat32:
      return store_dispatch_dst<float>(cache_dtype, key, value, key_row_stride, value_row_stride,
                                       k_cache, v_cache, slot_mapping, num_tokens, num_kv_heads,
                                       head_dim, tokens_per_block);
    case DType::kBFloat16:
      return store_dispatch_dst<bf16_t>(cache_dtype, key, value, key_row_stride,
                                        value_row_stride, k_cache, v_cache, slot_mapping,
                                        num_tokens, num_kv_heads, head_dim, tokens_per_block);
    case DType::kFloat16:
      return store_dispatch_dst<fp16_t>(cache_dtype, key, value, key_row_stride,
                                        value_row_stride, k_cache, v_cache, slot_mapping,
                                        num_tokens, num_kv_heads, head_dim, tokens_per_block);
    case DType::kFloat8E4M3:  // CUDA-only; the entry points reject it before this
      break;
  }
}

}  // namespace pyengine::kernels
