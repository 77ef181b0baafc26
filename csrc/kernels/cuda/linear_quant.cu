// cuda::linear_quant: see pyengine/cuda_quant.h. The block layouts are read byte by byte as
// pyengine/cpu_quant.h describes them (the CPU reference dequantizers in quantize.cpp compute
// the same values).
#include <cuda_fp16.h>

#include <algorithm>
#include <string>

#include "common.cuh"
#include "device_guard.cuh"
#include "pyengine/cuda_quant.h"

namespace pyengine::kernels::cuda {

namespace {

using namespace detail;

constexpr int kWarps = 4;  // weight rows per thread block
constexpr int kMB = 8;     // rows of x per pass

__device__ __forceinline__ float half_at(const uint8_t* p) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(p[0] | (p[1] << 8))));
}

// Q4_K's 6-bit scale and min of sub-block j (0..7) from its 12 packed bytes.
__device__ __forceinline__ void q4k_scale_min(int j, const uint8_t* s, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// The 32 weights of unit u of a row (units of 32 weights; a 256-weight super-block has 8).
template <QuantType T>
__device__ __forceinline__ void dequant32(const uint8_t* row, int u, float* w) {
  if constexpr (T == QuantType::kQ8_0) {
    const uint8_t* b = row + u * 34;
    const float d = half_at(b);
#pragma unroll
    for (int i = 0; i < 32; ++i) w[i] = d * static_cast<float>(static_cast<int8_t>(b[2 + i]));
  } else if constexpr (T == QuantType::kQ4_0 || T == QuantType::kQ4_Z) {
    const int bytes = T == QuantType::kQ4_0 ? 18 : 20;
    const uint8_t* b = row + u * bytes;
    const float d = half_at(b);
    const int z = T == QuantType::kQ4_0 ? 8 : b[2];
    const uint8_t* qs = b + bytes - 16;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      w[i] = d * static_cast<float>((qs[i] & 0x0f) - z);
      w[i + 16] = d * static_cast<float>((qs[i] >> 4) - z);
    }
  } else if constexpr (T == QuantType::kQ5_0) {
    const uint8_t* b = row + u * 22;
    const float d = half_at(b);
    const uint32_t qh = b[2] | (b[3] << 8) | (b[4] << 16) | (static_cast<uint32_t>(b[5]) << 24);
    const uint8_t* qs = b + 6;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      w[i] = d * static_cast<float>(((qs[i] & 0x0f) | (((qh >> i) & 1) << 4)) - 16);
      w[i + 16] = d * static_cast<float>(((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) - 16);
    }
  } else if constexpr (T == QuantType::kQ4_K) {
    const uint8_t* b = row + (u / 8) * 144;  // d, dmin, scales[12], qs[128]
    const int j = u % 8;
    int sc, m;
    q4k_scale_min(j, b + 4, sc, m);
    const float d = half_at(b) * static_cast<float>(sc), mn = half_at(b + 2) * static_cast<float>(m);
    const uint8_t* qs = b + 16 + 32 * (j / 2);
    const int shift = (j % 2) * 4;
#pragma unroll
    for (int i = 0; i < 32; ++i) w[i] = d * static_cast<float>((qs[i] >> shift) & 0x0f) - mn;
  } else {  // Q6_K: ql[128], qh[64], scales[16], d
    const uint8_t* b = row + (u / 8) * 210;
    const int c = u % 8, h = c / 4, k = c % 4;
    const float d = half_at(b + 208);
    const uint8_t* ql = b + 64 * h + (k & 1) * 32;
    const uint8_t* qh = b + 128 + 32 * h;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const int q = (((k < 2 ? ql[i] : ql[i] >> 4) & 0x0f) | (((qh[i] >> (2 * k)) & 3) << 4)) - 32;
      w[i] = d * static_cast<float>(sc[(32 * c + i) / 16]) * static_cast<float>(q);
    }
  }
}

template <QuantType T, class E>
__global__ void __launch_bounds__(kWarps * 32)
    quant_linear_kernel(E* __restrict__ y, int64_t ldy, const E* __restrict__ x, int64_t ldx, int M,
                        const uint8_t* __restrict__ weight, int64_t row_bytes, int N, int K,
                        const E* __restrict__ bias) {
  const int lane = threadIdx.x % 32;
  const int n = blockIdx.x * kWarps + threadIdx.x / 32;
  const int m0 = blockIdx.y * kMB;
  if (n >= N) return;
  const int mb = min(kMB, M - m0);
  const uint8_t* row = weight + n * row_bytes;
  float acc[kMB];
#pragma unroll
  for (int m = 0; m < kMB; ++m) acc[m] = 0.0f;
  float w[32];
  for (int u = lane; u < K / 32; u += 32) {
    dequant32<T>(row, u, w);
#pragma unroll
    for (int m = 0; m < kMB; ++m) {
      if (m < mb) {
        const E* xr = x + (m0 + m) * ldx + u * 32;
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < 32; ++i) s = fmaf(w[i], to_float(xr[i]), s);
        acc[m] += s;
      }
    }
  }
#pragma unroll
  for (int m = 0; m < kMB; ++m) {
    const float s = warp_sum(acc[m]);
    if (lane == 0 && m < mb) {
      const float b = bias != nullptr ? to_float(bias[n]) : 0.0f;
      y[(m0 + m) * ldy + n] = static_cast<E>(s + b);
    }
  }
}

template <QuantType T, class E>
void launch(void* y, int64_t ldy, const void* x, int64_t ldx, int32_t M, const void* weight, int64_t row_bytes,
            int32_t N, int32_t K, const void* bias, cudaStream_t stream) {
  const dim3 grid((N + kWarps - 1) / kWarps, (M + kMB - 1) / kMB);
  quant_linear_kernel<T, E><<<grid, kWarps * 32, 0, stream>>>(
      static_cast<E*>(y), ldy, static_cast<const E*>(x), ldx, M, static_cast<const uint8_t*>(weight), row_bytes,
      N, K, static_cast<const E*>(bias));
}

// The layouts the GPU reads: the plain (llama.cpp row) ones.
bool plain_layout(QuantType type) {
  switch (type) {
    case QuantType::kQ8_0: case QuantType::kQ5_0: case QuantType::kQ4_0:
    case QuantType::kQ4_Z: case QuantType::kQ4_K: case QuantType::kQ6_K:
      return true;
    default:
      return false;
  }
}

template <class E>
void launch_type(QuantType type, void* y, int64_t ldy, const void* x, int64_t ldx, int32_t M, const void* weight,
                 int64_t row_bytes, int32_t N, int32_t K, const void* bias, cudaStream_t stream) {
  switch (type) {
    case QuantType::kQ8_0: return launch<QuantType::kQ8_0, E>(y, ldy, x, ldx, M, weight, row_bytes, N, K, bias, stream);
    case QuantType::kQ5_0: return launch<QuantType::kQ5_0, E>(y, ldy, x, ldx, M, weight, row_bytes, N, K, bias, stream);
    case QuantType::kQ4_0: return launch<QuantType::kQ4_0, E>(y, ldy, x, ldx, M, weight, row_bytes, N, K, bias, stream);
    case QuantType::kQ4_Z: return launch<QuantType::kQ4_Z, E>(y, ldy, x, ldx, M, weight, row_bytes, N, K, bias, stream);
    case QuantType::kQ4_K: return launch<QuantType::kQ4_K, E>(y, ldy, x, ldx, M, weight, row_bytes, N, K, bias, stream);
    case QuantType::kQ6_K: return launch<QuantType::kQ6_K, E>(y, ldy, x, ldx, M, weight, row_bytes, N, K, bias, stream);
    default:
      fail("type: not a plain layout");  // linear_quant checked plain_layout before
  }
}

}  // namespace

void linear_quant(void* y, int64_t ldy, const void* x, int64_t ldx, DType dtype, int32_t M, const void* weight,
                  QuantType type, int32_t N, int32_t K, const void* bias, int32_t device, void* stream) {
  if (y == nullptr || x == nullptr || weight == nullptr) fail("y/x/weight: must not be null");
  if (M < 1) fail("M: must be > 0, got " + std::to_string(M));
  if (N < 1) fail("N: must be > 0, got " + std::to_string(N));
  const int64_t row_bytes = quant_row_bytes(type, K);  // checks the type and K
  if (ldx < K) fail("ldx: must be >= K = " + std::to_string(K) + ", got " + std::to_string(ldx));
  if (ldy < N) fail("ldy: must be >= N = " + std::to_string(N) + ", got " + std::to_string(ldy));
  if (dtype != DType::kFloat32 && dtype != DType::kBFloat16 && dtype != DType::kFloat16)
    fail("dtype: must be float32, bfloat16 or float16");
  if (!plain_layout(type))
    fail(std::string("type: ") + quant_format(type).name +
         " is an interleaved (CPU) layout; the GPU reads the plain one (QuantizedWeight.plain())");
  const DeviceGuard on_device(device);  // the first CUDA call
  auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case DType::kFloat32: launch_type<float>(type, y, ldy, x, ldx, M, weight, row_bytes, N, K, bias, s); break;
    case DType::kBFloat16: launch_type<bf16>(type, y, ldy, x, ldx, M, weight, row_bytes, N, K, bias, s); break;
    case DType::kFloat16: launch_type<fp16>(type, y, ldy, x, ldx, M, weight, row_bytes, N, K, bias, s); break;
    default: fail("dtype: must be float32, bfloat16 or float16");
  }
  check_launch("linear_quant");
}

}  // namespace pyengine::kernels::cuda
