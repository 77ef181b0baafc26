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

// The 4 weights 4j..4j+3 (j = 0..7) of unit u of a row (units of 32 weights; a 256-weight
// super-block has 8). Consecutive lanes take consecutive quads, so a warp's byte loads fall in
// one stretch of the row and its loads of x are coalesced.
template <QuantType T>
__device__ __forceinline__ void dequant4(const uint8_t* __restrict__ row, int u, int j, float* w) {
  if constexpr (T == QuantType::kQ8_0) {
    const uint8_t* b = row + u * 34;
    const float d = half_at(b);
    const int8_t* q = reinterpret_cast<const int8_t*>(b + 2 + 4 * j);
#pragma unroll
    for (int t = 0; t < 4; ++t) w[t] = d * static_cast<float>(q[t]);
  } else if constexpr (T == QuantType::kQ4_0 || T == QuantType::kQ4_Z) {
    // weights 0..15: the low nibbles of qs[0..15], 16..31 the high ones
    constexpr int kBytes = T == QuantType::kQ4_0 ? 18 : 20;
    const uint8_t* b = row + u * kBytes;
    const float d = half_at(b);
    const int z = T == QuantType::kQ4_0 ? 8 : b[2];
    const uint8_t* qs = b + kBytes - 16 + 4 * (j & 3);
    const int shift = j < 4 ? 0 : 4;
#pragma unroll
    for (int t = 0; t < 4; ++t) w[t] = d * static_cast<float>(((qs[t] >> shift) & 0x0f) - z);
  } else if constexpr (T == QuantType::kQ5_0 || T == QuantType::kQ5_1) {
    // as Q4_0, with weight p's fifth bit at bit p of the little-endian uint32 qh; Q5_0: d, qh,
    // qs (levels less 16); Q5_1: d, m, qh, qs (levels plus m)
    constexpr bool kMin = T == QuantType::kQ5_1;
    constexpr int kQh = kMin ? 4 : 2;
    const uint8_t* b = row + u * (kQh + 20);
    const float d = half_at(b), mn = kMin ? half_at(b + 2) : 0.0f;
    const uint32_t qh = b[kQh] | (b[kQh + 1] << 8) | (b[kQh + 2] << 16) | (static_cast<uint32_t>(b[kQh + 3]) << 24);
    const uint8_t* qs = b + kQh + 4 + 4 * (j & 3);
    const int shift = j < 4 ? 0 : 4;
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      // (int: qh is unsigned, and an unsigned code minus 16 would wrap)
      const int level = ((qs[t] >> shift) & 0x0f) | (static_cast<int>((qh >> (4 * j + t)) & 1u) << 4);
      if constexpr (kMin)
        w[t] = d * static_cast<float>(level) + mn;
      else
        w[t] = d * static_cast<float>(level - 16);
    }
  } else if constexpr (T == QuantType::kQ5_K) {
    const uint8_t* b = row + (u / 8) * 176;  // d, dmin, scales[12], qh[32], qs[128]
    const int sub = u % 8;
    int sc, m;
    q4k_scale_min(sub, b + 4, sc, m);
    const float d = half_at(b) * static_cast<float>(sc), mn = half_at(b + 2) * static_cast<float>(m);
    const uint8_t* qs = b + 48 + 32 * (sub / 2) + 4 * j;
    const uint8_t* qh = b + 16 + 4 * j;
    const int shift = (sub % 2) * 4;
#pragma unroll
    for (int t = 0; t < 4; ++t)
      w[t] = d * static_cast<float>(((qs[t] >> shift) & 0x0f) | (((qh[t] >> sub) & 1) << 4)) - mn;
  } else if constexpr (T == QuantType::kQ4_K) {
    const uint8_t* b = row + (u / 8) * 144;  // d, dmin, scales[12], qs[128]
    const int sub = u % 8;
    int sc, m;
    q4k_scale_min(sub, b + 4, sc, m);
    const float d = half_at(b) * static_cast<float>(sc), mn = half_at(b + 2) * static_cast<float>(m);
    const uint8_t* qs = b + 16 + 32 * (sub / 2) + 4 * j;
    const int shift = (sub % 2) * 4;
#pragma unroll
    for (int t = 0; t < 4; ++t) w[t] = d * static_cast<float>((qs[t] >> shift) & 0x0f) - mn;
  } else {  // Q6_K: ql[128], qh[64], scales[16], d
    const uint8_t* b = row + (u / 8) * 210;
    const int c = u % 8, h = c / 4, k = c % 4;
    const float d = half_at(b + 208);
    const uint8_t* ql = b + 64 * h + (k & 1) * 32 + 4 * j;
    const uint8_t* qh = b + 128 + 32 * h + 4 * j;
    // weights 4j..4j+3 of the unit share one 16-weight scale: (32 c + 4 j + t) / 16 = 2 c + j / 4
    const float ds = d * static_cast<float>(reinterpret_cast<const int8_t*>(b + 192)[2 * c + j / 4]);
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      const int q = (((k < 2 ? ql[t] : ql[t] >> 4) & 0x0f) | (((qh[t] >> (2 * k)) & 3) << 4)) - 32;
      w[t] = ds * static_cast<float>(q);
    }
  }
}

// y[m0 .. m0 + mb) x [n] for one weight row n per warp: each lane takes quads lane, lane + 32, ...
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
  const E* x0 = x + static_cast<int64_t>(m0) * ldx;
  float acc[kMB];
#pragma unroll
  for (int m = 0; m < kMB; ++m) acc[m] = 0.0f;
  const int quads = K / 4;
#pragma unroll 4
  for (int q = lane; q < quads; q += 32) {
    float w[4];
    dequant4<T>(row, q >> 3, q & 7, w);
#pragma unroll
    for (int m = 0; m < kMB; ++m) {
      if (m < mb) {
        const E* xr = x0 + m * ldx + 4 * q;
#pragma unroll
        for (int t = 0; t < 4; ++t) acc[m] = fmaf(w[t], to_float(xr[t]), acc[m]);
      }
    }
  }
#pragma unroll
  for (int m = 0; m < kMB; ++m) {
    if (m < mb) {  // (mb is the same for the whole warp)
      const float s = warp_sum(acc[m]);
      if (lane == 0) {
        const float b = bias != nullptr ? to_float(bias[n]) : 0.0f;
        y[(m0 + m) * ldy + n] = static_cast<E>(s + b);
      }
    }
  }
}

// out[r, :] = weight row (ids ? ids[r] - base : base + r), one quad per thread; rows whose
// source is not in [0, N) are left as they are.
template <QuantType T, class O>
__global__ void dequant_rows_kernel(O* __restrict__ out, int64_t ldo, const uint8_t* __restrict__ weight,
                                    int64_t row_bytes, int N, int K, const int64_t* __restrict__ ids,
                                    int64_t base, int rows) {
  const int64_t quads = K / 4;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= quads * rows) return;
  const int64_t r = i / quads, q = i % quads;
  const int64_t src = ids != nullptr ? ids[r] - base : base + r;
  if (src < 0 || src >= N) return;
  float w[4];
  dequant4<T>(weight + src * row_bytes, static_cast<int>(q >> 3), static_cast<int>(q & 7), w);
  O* o = out + r * ldo + 4 * q;
#pragma unroll
  for (int t = 0; t < 4; ++t) o[t] = static_cast<O>(w[t]);
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
    case QuantType::kQ8_0: case QuantType::kQ5_0: case QuantType::kQ5_1: case QuantType::kQ4_0:
    case QuantType::kQ4_Z: case QuantType::kQ4_K: case QuantType::kQ5_K: case QuantType::kQ6_K:
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
    case QuantType::kQ5_1: return launch<QuantType::kQ5_1, E>(y, ldy, x, ldx, M, weight, row_bytes, N, K, bias, stream);
    case QuantType::kQ5_K: return launch<QuantType::kQ5_K, E>(y, ldy, x, ldx, M, weight, row_bytes, N, K, bias, stream);
    case QuantType::kQ4_0: return launch<QuantType::kQ4_0, E>(y, ldy, x, ldx, M, weight, row_bytes, N, K, bias, stream);
    case QuantType::kQ4_Z: return launch<QuantType::kQ4_Z, E>(y, ldy, x, ldx, M, weight, row_bytes, N, K, bias, stream);
    case QuantType::kQ4_K: return launch<QuantType::kQ4_K, E>(y, ldy, x, ldx, M, weight, row_bytes, N, K, bias, stream);
    case QuantType::kQ6_K: return launch<QuantType::kQ6_K, E>(y, ldy, x, ldx, M, weight, row_bytes, N, K, bias, stream);
    default:
      fail("type: not a plain layout");  // linear_quant checked plain_layout before
  }
}

template <QuantType T, class O>
void launch_dequant(void* out, int64_t ldo, const void* weight, int64_t row_bytes, int32_t N, int32_t K,
                    const int64_t* ids, int64_t base, int32_t rows, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int64_t threads = static_cast<int64_t>(K / 4) * rows;
  const int64_t blocks = (threads + kThreads - 1) / kThreads;
  dequant_rows_kernel<T, O><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<O*>(out), ldo, static_cast<const uint8_t*>(weight), row_bytes, N, K, ids, base, rows);
}

template <class O>
void launch_dequant_type(QuantType type, void* out, int64_t ldo, const void* weight, int64_t row_bytes, int32_t N,
                         int32_t K, const int64_t* ids, int64_t base, int32_t rows, cudaStream_t stream) {
  switch (type) {
    case QuantType::kQ8_0: return launch_dequant<QuantType::kQ8_0, O>(out, ldo, weight, row_bytes, N, K, ids, base, rows, stream);
    case QuantType::kQ5_0: return launch_dequant<QuantType::kQ5_0, O>(out, ldo, weight, row_bytes, N, K, ids, base, rows, stream);
    case QuantType::kQ5_1: return launch_dequant<QuantType::kQ5_1, O>(out, ldo, weight, row_bytes, N, K, ids, base, rows, stream);
    case QuantType::kQ5_K: return launch_dequant<QuantType::kQ5_K, O>(out, ldo, weight, row_bytes, N, K, ids, base, rows, stream);
    case QuantType::kQ4_0: return launch_dequant<QuantType::kQ4_0, O>(out, ldo, weight, row_bytes, N, K, ids, base, rows, stream);
    case QuantType::kQ4_Z: return launch_dequant<QuantType::kQ4_Z, O>(out, ldo, weight, row_bytes, N, K, ids, base, rows, stream);
    case QuantType::kQ4_K: return launch_dequant<QuantType::kQ4_K, O>(out, ldo, weight, row_bytes, N, K, ids, base, rows, stream);
    case QuantType::kQ6_K: return launch_dequant<QuantType::kQ6_K, O>(out, ldo, weight, row_bytes, N, K, ids, base, rows, stream);
    default:
      fail("type: not a plain layout");
  }
}

// The checks both entry points make; returns the weight's row bytes.
int64_t check_weight(const void* weight, QuantType type, int32_t N, int32_t K, DType dtype) {
  if (weight == nullptr) fail("weight: must not be null");
  if (N < 1) fail("N: must be > 0, got " + std::to_string(N));
  const int64_t row_bytes = quant_row_bytes(type, K);  // checks the type and K
  if (dtype != DType::kFloat32 && dtype != DType::kBFloat16 && dtype != DType::kFloat16)
    fail("dtype: must be float32, bfloat16 or float16");
  if (!plain_layout(type))
    fail(std::string("type: ") + quant_format(type).name +
         " is an interleaved (CPU) layout; the GPU reads the plain one (QuantizedWeight.plain())");
  return row_bytes;
}

}  // namespace

void dequantize_rows(void* out, int64_t ldo, DType dtype, const void* weight, QuantType type, int32_t N, int32_t K,
                     const int64_t* ids, int64_t base, int32_t rows, int32_t device, void* stream) {
  const int64_t row_bytes = check_weight(weight, type, N, K, dtype);
  if (out == nullptr) fail("out: must not be null");
  if (rows < 0) fail("rows: must be >= 0, got " + std::to_string(rows));
  if (ldo < K) fail("ldo: must be >= K = " + std::to_string(K) + ", got " + std::to_string(ldo));
  if (rows == 0) return;
  const DeviceGuard on_device(device);  // the first CUDA call
  auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case DType::kFloat32: launch_dequant_type<float>(type, out, ldo, weight, row_bytes, N, K, ids, base, rows, s); break;
    case DType::kBFloat16: launch_dequant_type<bf16>(type, out, ldo, weight, row_bytes, N, K, ids, base, rows, s); break;
    default: launch_dequant_type<fp16>(type, out, ldo, weight, row_bytes, N, K, ids, base, rows, s); break;
  }
  check_launch("dequantize_rows");
}

void linear_quant(void* y, int64_t ldy, const void* x, int64_t ldx, DType dtype, int32_t M, const void* weight,
                  QuantType type, int32_t N, int32_t K, const void* bias, int32_t device, void* stream) {
  if (y == nullptr || x == nullptr || weight == nullptr) fail("y/x/weight: must not be null");
  if (M < 1) fail("M: must be > 0, got " + std::to_string(M));
  const int64_t row_bytes = check_weight(weight, type, N, K, dtype);
  if (ldx < K) fail("ldx: must be >= K = " + std::to_string(K) + ", got " + std::to_string(ldx));
  if (ldy < N) fail("ldy: must be >= N = " + std::to_string(N) + ", got " + std::to_string(ldy));
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
