// rms_norm, rotary_embedding, silu_mul: see pyengine/cpu_elementwise.h. The front end: argument
// checks, then the build of the active instruction-set level (elementwise_impl.h).
#include <cstdint>
#include <stdexcept>
#include <string>

#include "elementwise_common.h"
#include "isa_target.h"
#include "pyengine/cpu_elementwise.h"

namespace pyengine::kernels {

namespace {

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument(what);
}

void check_dtype(DType dtype) {
  require(dtype == DType::kFloat32 || dtype == DType::kBFloat16 || dtype == DType::kFloat16,
          "dtype: the fused elementwise kernels take float32, bfloat16 or float16, got DType " +
              std::to_string(static_cast<int32_t>(dtype)));
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
  const cpu::RmsNormArgs a{out,    out_stride, x,        x_stride, residual,   residual_stride,
                           weight, dtype,      num_rows, hidden,   eps,        num_threads};
  PYENGINE_ISA_CALL(rms_norm, a);
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
  const cpu::RotaryArgs a{x,   x_stride, num_tokens, num_heads, head_dim,
                          cos, sin,      positions,  dtype,     num_threads};
  PYENGINE_ISA_CALL(rotary_embedding, a);
}

void silu_mul(void* out, const void* gate_up, DType dtype, int32_t num_rows, int32_t inter,
              int32_t num_threads) {
  check_dtype(dtype);
  require(num_rows >= 0, "num_rows: must be >= 0, got " + std::to_string(num_rows));
  require(inter > 0, "inter: must be positive, got " + std::to_string(inter));
  require(out != nullptr && gate_up != nullptr, "out/gate_up: null pointer");
  const cpu::SiluMulArgs a{out, gate_up, dtype, num_rows, inter, num_threads};
  PYENGINE_ISA_CALL(silu_mul, a);
}

}  // namespace pyengine::kernels
