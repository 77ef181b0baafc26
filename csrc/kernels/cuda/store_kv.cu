// store_kv: scatters this step's K/V rows into their paged-cache slots.
//
// Tiling. Grid (token); up to 256 threads, each copying 8-element chunks of the token's
// num_kv_heads x head_dim K and V rows (16-byte loads of bf16/fp16, 2 x 16 of fp32; stores of
// 8 x sizeof(cache) bytes). fp8 e4m3 caches store value / scale, saturated to +-448 (NaN stays
// NaN). Rows whose slot is negative are skipped. Misaligned rows (a pointer not 16-byte aligned,
// a row stride or head_dim not a multiple of 8) take the same kernel one element at a time.
#include "common.cuh"
#include "device_guard.cuh"
#include "pyengine/cuda_kernels.h"

namespace pyengine::kernels::cuda {
namespace detail {
namespace {

template <class D>
__device__ __forceinline__ D from_float(float x, float scale) {
  if constexpr (std::is_same_v<D, fp8>) {
    const __nv_fp8_storage_t b = __nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE, __NV_E4M3);
    return fp8::bitcast(b);
  } else {
    return static_cast<D>(x);
  }
}

template <class S, class D, int kVec>
__global__ void __launch_bounds__(256)
    store_kv_kernel(const S* __restrict__ key, const S* __restrict__ value, int64_t k_stride,
                    int64_t v_stride, D* __restrict__ k_cache, D* __restrict__ v_cache,
                    float k_scale, float v_scale, const int32_t* __restrict__ slot_mapping,
                    int num_kv_heads, int head_dim, int tokens_per_block) {
  const int t = blockIdx.x;
  const int slot = slot_mapping[t];
  if (slot < 0) return;
  const int64_t block = slot / tokens_per_block;
  const int64_t off = slot % tokens_per_block;
  const int row = num_kv_heads * head_dim;
  const S* ks = key + t * k_stride;
  const S* vs = value + t * v_stride;
  for (int i = threadIdx.x * kVec; i < row; i += blockDim.x * kVec) {
    const int h = i / head_dim;
    const int d = i % head_dim;
    const int64_t dst = ((block * num_kv_heads + h) * tokens_per_block + off) * head_dim + d;
    if constexpr (kVec == 1) {
      k_cache[dst] = from_float<D>(to_float(ks[i]), k_scale);
      v_cache[dst] = from_float<D>(to_float(vs[i]), v_scale);
    } else {
      float kf[kVec], vf[kVec];
      load_float<S, kVec>(ks + i, kf);
      load_float<S, kVec>(vs + i, vf);
      alignas(16) D ko[kVec], vo[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        ko[e] = from_float<D>(kf[e], k_scale);
        vo[e] = from_float<D>(vf[e], v_scale);
      }
      constexpr int kWords = kVec * sizeof(D) / 8;  // 8-byte words
#pragma unroll
      for (int w = 0; w < kWords; ++w) {
        reinterpret_cast<uint2*>(k_cache + dst)[w] = reinterpret_cast<const uint2*>(ko)[w];
        reinterpret_cast<uint2*>(v_cache + dst)[w] = reinterpret_cast<const uint2*>(vo)[w];
      }
    }
  }
}

template <class S, class D>
void launch(const void* key, const void* value, int64_t k_stride, int64_t v_stride,
            void* k_cache, void* v_cache, float k_scale, float v_scale,
            const int32_t* slot_mapping, int32_t num_tokens, int32_t num_kv_heads,
            int32_t head_dim, int32_t tokens_per_block, bool vec, cudaStream_t stream) {
  const int row = num_kv_heads * head_dim;
  const int chunks = vec ? row / 8 : row;
  const int threads = chunks >= 256 ? 256 : ((chunks + 31) / 32) * 32;
  auto run = [&](auto kernel) {
    kernel<<<num_tokens, threads, 0, stream>>>(
        static_cast<const S*>(key), static_cast<const S*>(value), k_stride, v_stride,
        static_cast<D*>(k_cache), static_cast<D*>(v_cache), k_scale, v_scale, slot_mapping,
        num_kv_heads, head_dim, tokens_per_block);
  };
  if (vec) {
    run(store_kv_kernel<S, D, 8>);
  } else {
    run(store_kv_kernel<S, D, 1>);
  }
  check_launch("store_kv");
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

bool is_float_dtype(DType d) {
  return d == DType::kFloat32 || d == DType::kBFloat16 || d == DType::kFloat16;
}

}  // namespace
}  // namespace detail

void store_kv(const void* key, const void* value, int64_t key_row_stride, int64_t value_row_stride,
              DType src_dtype, void* k_cache, void* v_cache, DType cache_dtype, float k_scale,
              float v_scale, const int32_t* slot_mapping, int32_t num_tokens, int32_t num_kv_heads,
              int32_t head_dim, int32_t tokens_per_block, int32_t device, void* stream) {
  using namespace detail;
  // ---- validation (host values only) ----
  if (!is_float_dtype(src_dtype))
    fail("src_dtype: unsupported DType value " + std::to_string(static_cast<int>(src_dtype)) +
         " (float32, bfloat16 or float16)");
  const bool is_fp8 = cache_dtype == DType::kFloat8E4M3;
  if (!(cache_dtype == src_dtype ||
        (is_fp8 && (src_dtype == DType::kBFloat16 || src_dtype == DType::kFloat16))))
    fail("cache_dtype: DType value " + std::to_string(static_cast<int>(cache_dtype)) +
         " with src_dtype " + std::to_string(static_cast<int>(src_dtype)) +
         " is not supported (the cache takes the source dtype, or float8_e4m3 from "
         "bfloat16/float16)");
  if (num_tokens < 0) fail("num_tokens: must be >= 0");
  if (num_kv_heads <= 0) fail("num_kv_heads: must be > 0");
  if (head_dim <= 0) fail("head_dim: must be > 0");
  if (tokens_per_block <= 0) fail("tokens_per_block: must be > 0");
  if (static_cast<int64_t>(num_kv_heads) * head_dim > (int64_t{1} << 30))
    fail("num_kv_heads: num_kv_heads * head_dim is too large");
  const int64_t row = static_cast<int64_t>(num_kv_heads) * head_dim;
  if (key_row_stride < row) fail("key_row_stride: must be >= num_kv_heads * head_dim");
  if (value_row_stride < row) fail("value_row_stride: must be >= num_kv_heads * head_dim");
  if (is_fp8) {
    if (!(k_scale > 0.f) || k_scale == INFINITY) fail("k_scale: must be finite and > 0");
    if (!(v_scale > 0.f) || v_scale == INFINITY) fail("v_scale: must be finite and > 0");
  }
  if (num_tokens == 0) return;
  if (key == nullptr) fail("key: null pointer");
  if (value == nullptr) fail("value: null pointer");
  if (k_cache == nullptr) fail("k_cache: null pointer");
  if (v_cache == nullptr) fail("v_cache: null pointer");
  if (slot_mapping == nullptr) fail("slot_mapping: null pointer");

  const bool vec = head_dim % 8 == 0 && key_row_stride % 8 == 0 && value_row_stride % 8 == 0 &&
                   aligned16(key) && aligned16(value) && aligned16(k_cache) &&
                   aligned16(v_cache);
  const DeviceGuard on_device(device);  // the first CUDA call
  auto s = static_cast<cudaStream_t>(stream);
  const auto go = [&](auto src_tag, auto dst_tag) {
    using S = decltype(src_tag);
    using D = decltype(dst_tag);
    launch<S, D>(key, value, key_row_stride, value_row_stride, k_cache, v_cache, k_scale,
                 v_scale, slot_mapping, num_tokens, num_kv_heads, head_dim, tokens_per_block, vec,
                 s);
  };
  switch (src_dtype) {
    case DType::kFloat32:
      return go(float{}, float{});
    case DType::kBFloat16:
      return is_fp8 ? go(bf16{}, fp8{}) : go(bf16{}, bf16{});
    default:
      return is_fp8 ? go(fp16{}, fp8{}) : go(fp16{}, fp16{});
  }
}

}  // namespace pyengine::kernels::cuda
