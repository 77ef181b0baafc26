// rms_norm, rotary_embedding, silu_mul: see pyengine/cpu_elementwise.h. Plain loops over rows
// that gcc vectorizes; the rows of a decode step are a few KB, so the win is one call instead
// of a dozen torch operations, not the arithmetic. Compiled with -ffp-contract=off: a fused
// multiply-add would round differently from torch's separate multiply and add (fp32 RoPE is
// bit-exact with torch only without it).
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "dtype_convert.h"
#include "pyengine/cpu_elementwise.h"

namespace pyengine::kernels {

namespace {

using cpu::bf16_t;
using cpu::fp16_t;
using cpu::store_f32;
using cpu::to_f32;

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument(what);
}

void check_dtype(DType dtype) {
  require(dtype == DType::kFloat32 || dtype == DType::kBFloat16 || dtype == DType::kFloat16,
          "dtype: the fused elementwise kernels take float32, bfloat16 or float16, got DType " +
              std::to_string(static_cast<int32_t>(dtype)));
}

// Calls f with a null pointer of the storage type of `dtype` (checked).
template <typename F>
void dispatch(DType dtype, F&& f) {
  check_dtype(dtype);
  if (dtype == DType::kFloat32)
    f(static_cast<float*>(nullptr));
  else if (dtype == DType::kBFloat16)
    f(static_cast<bf16_t*>(nullptr));
  else
    f(static_cast<fp16_t*>(nullptr));
}

template <typename T>
inline float round_to(float v) {  // the value `v` takes once stored as T
  T t;
  store_f32(&t, v);
  return to_f32(t);
}

int threads_for(int32_t rows, int32_t num_threads) {
  if (rows < 4) return 1;
  return num_threads > 0 ? num_threads : omp_get_max_threads();
}

template <typename T>
void rms_norm_impl(T* out, int64_t out_stride, const T* x, int64_t x_stride, T* residual,
                   int64_t residual_stride, const T* weight, int32_t rows, int32_t hidden,
                   float eps, int32_t num_threads) {
#pragma omp parallel for num_threads(threads_for(rows, num_threads)) schedule(static)
  for (int32_t r = 0; r < rows; ++r) {
    const T* xr = x + r * x_stride;
    const T* src = xr;
    if (residual != nullptr) {
      T* res = residual + r * residual_stride;
      for (int32_t i = 0; i < hidden; ++i) store_f32(res + i, to_f32(res[i]) + to_f32(xr[i]));
      src = res;
    }
    float lanes[16] = {};  // 16 partial sums: vectorizable without reassociating one long chain
    int32_t i = 0;
    for (; i + 16 <= hidden; i += 16)
      for (int32_t j = 0; j < 16; ++j) {
        const float v = to_f32(src[i + j]);
        lanes[j] += v * v;
      }
    for (int32_t j = 0; i < hidden; ++i, ++j) {
      const float v = to_f32(src[i]);
      lanes[j] += v * v;
    }
    float sum = 0.f;
    for (float l : lanes) sum += l;
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
    T* o = out + r * out_stride;
    for (i = 0; i < hidden; ++i)
      store_f32(o + i, to_f32(weight[i]) * round_to<T>(to_f32(src[i]) * inv));
  }
}

template <typename T>
void rotary_impl(T* x, int64_t x_stride, int32_t tokens, int32_t heads, int32_t head_dim,
                 const T* cos, const T* sin, const int32_t* positions, int32_t num_threads) {
  const int32_t half = head_dim / 2;
#pragma omp parallel for num_threads(threads_for(tokens, num_threads)) schedule(static)
  for (int32_t t = 0; t < tokens; ++t) {
    const T* c = cos + static_cast<int64_t>(positions[t]) * head_dim;
    const T* s = sin + static_cast<int64_t>(positions[t]) * head_dim;
    for (int32_t h = 0; h < heads; ++h) {
      T* v = x + t * x_stride + static_cast<int64_t>(h) * head_dim;
      for (int32_t i = 0; i < half; ++i) {
        const float a = to_f32(v[i]), b = to_f32(v[i + half]);
        const float lo = round_to<T>(a * to_f32(c[i])) + round_to<T>(-b * to_f32(s[i]));
        const float hi = round_to<T>(b * to_f32(c[i + half])) + round_to<T>(a * to_f32(s[i + half]));
        store_f32(v + i, lo);
        store_f32(v + i + half, hi);
      }
    }
  }
}

template <typename T>
void silu_mul_impl(T* out, const T* gate_up, int32_t rows, int32_t inter, int32_t num_threads) {
#pragma omp parallel for num_threads(threads_for(rows, num_threads)) schedule(static)
  for (int32_t r = 0; r < rows; ++r) {
    const T* g = gate_up + static_cast<int64_t>(r) * 2 * inter;
    const T* u = g + inter;
    T* o = out + static_cast<int64_t>(r) * inter;
    for (int32_t i = 0; i < inter; ++i) {
      const float gv = to_f32(g[i]);
      store_f32(o + i, round_to<T>(gv / (1.f + std::exp(-gv))) * to_f32(u[i]));
    }
  }
}

}  // namespace

void rms_norm(void* out, int64_t out_stride, const void* x, int64_t x_stride, void* residual,
              int64_t residual_stride, const void* weight, DType dtype, int32_t num_rows,
              int32_t hidden, float eps, int32_t num_threads) {
  check_dtype(dtype);
  require(num_rows >= 0, "num_rows: must be >= 0, got " + std::to_string(num_rows));
  require(hidden > 0, "hidden: must be positive, got " + std::to_string(hidden));
  require(out != nullptr && x != nullptr && weight != nullptr, "out/x/weight: null pointer");
  require(out_stride >= hidden && x_stride >= hidden, "out_stride/x_stride: smaller than hidden");
  require(residual == nullptr || residual_stride >= hidden, "residual_stride: smaller than hidden");
  dispatch(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rms_norm_impl(static_cast<T*>(out), out_stride, static_cast<const T*>(x), x_stride,
                  static_cast<T*>(residual), residual_stride, static_cast<const T*>(weight), num_rows,
                  hidden, eps, num_threads);
  });
}

void rotary_embedding(void* x, int64_t x_stride, int32_t num_tokens, int32_t num_heads,
                      int32_t head_dim, const void* cos, const void* sin, int32_t max_position,
                      const int32_t* positions, DType dtype, int32_t num_threads) {
  check_dtype(dtype);
  require(num_tokens >= 0, "num_tokens: must be >= 0, got " + std::to_string(num_tokens));
  require(num_heads > 0, "num_heads: must be positive, got " + std::to_string(num_heads));
  require(head_dim > 0 && head_dim % 2 == 0,
          "head_dim: must be positive and even, got " + std::to_string(head_dim));
  require(x_stride >= static_cast<int64_t>(num_heads) * head_dim,
          "x_stride: smaller than num_heads * head_dim");
  require(x != nullptr && cos != nullptr && sin != nullptr && positions != nullptr,
          "x/cos/sin/positions: null pointer");
  for (int32_t t = 0; t < num_tokens; ++t)
    require(positions[t] >= 0 && positions[t] < max_position,
            "positions: entry " + std::to_string(t) + " is " + std::to_string(positions[t]) +
                ", outside [0, " + std::to_string(max_position) + ")");
  dispatch(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rotary_impl(static_cast<T*>(x), x_stride, num_tokens, num_heads, head_dim,
                static_cast<const T*>(cos), static_cast<const T*>(sin), positions, num_threads);
  });
}

void silu_mul(void* out, const void* gate_up, DType dtype, int32_t num_rows, int32_t inter,
              int32_t num_threads) {
  check_dtype(dtype);
  require(num_rows >= 0, "num_rows: must be >= 0, got " + std::to_string(num_rows));
  require(inter > 0, "inter: must be positive, got " + std::to_string(inter));
  require(out != nullptr && gate_up != nullptr, "out/gate_up: null pointer");
  dispatch(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    silu_mul_impl(static_cast<T*>(out), static_cast<const T*>(gate_up), num_rows, inter, num_threads);
  });
}

}  // namespace pyengine::kernels
