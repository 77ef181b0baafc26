// Shared pieces of the CUDA kernels: element types, vector loads with conversion to fp32,
// cp.async helpers, the query-row -> sequence lookup, and host-side error helpers.
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <stdexcept>
#include <string>

#include <cute/tensor.hpp>

#include "pyengine/kernels.h"
#include "smem_opt_in.h"

namespace pyengine::kernels::cuda::detail {

using bf16 = cute::bfloat16_t;
using fp16 = cute::half_t;
using fp8 = cute::float_e4m3_t;

// ---- device helpers ----

template <class T>
__device__ __forceinline__ float to_float(T x) {
  return static_cast<float>(x);
}

// Loads N consecutive elements of type T (N * sizeof(T) a multiple of 8 bytes, `src` aligned to
// that size or 16 bytes) with vector loads and converts them to fp32.
template <class T, int N>
__device__ __forceinline__ void load_float(const T* src, float* dst) {
  constexpr int kBytes = N * static_cast<int>(sizeof(T));
  if constexpr (kBytes % 16 == 0) {
    constexpr int kPer = 16 / sizeof(T);
#pragma unroll
    for (int w = 0; w < kBytes / 16; ++w) {
      const uint4 u = reinterpret_cast<const uint4*>(src)[w];
      const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
      for (int i = 0; i < kPer; ++i) dst[w * kPer + i] = to_float(e[i]);
    }
  } else {
    static_assert(kBytes == 8, "load_float: 8 or a multiple of 16 bytes");
    const uint2 u = *reinterpret_cast<const uint2*>(src);
    const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = to_float(e[i]);
  }
}

// 16-byte global -> shared copy that bypasses L1; `valid == false` writes 16 zero bytes and
// reads nothing (src must still be a mapped address).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Finds the sequence that owns query row `row`: the largest s with query_start_loc[s] <= row.
// False when the row belongs to no sequence (before query_start_loc[0] or past the last).
__device__ __forceinline__ bool find_row(const int32_t* __restrict__ qsl, int num_seqs, int row,
                                         int& seq, int& j) {
  if (row < qsl[0] || row >= qsl[num_seqs]) return false;
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (qsl[mid] <= row) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  seq = lo;
  j = row - qsl[lo];
  return true;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Address (in elements) of token `pos` of KV head `kvh` in a [num_blocks, num_kv_heads,
// tokens_per_block, head_dim] cache, through the sequence's block table row `bt`.
__device__ __forceinline__ int64_t kv_offset(const int32_t* __restrict__ bt, int pos, int kvh,
                                             int num_kv_heads, int tpb_shift, int head_dim) {
  const int64_t blk = bt[pos >> tpb_shift];
  const int64_t off = pos & ((1 << tpb_shift) - 1);
  return (((blk * num_kv_heads + kvh) << tpb_shift) + off) * head_dim;
}

// ---- host helpers ----

[[noreturn]] inline void fail(const std::string& msg) { throw std::invalid_argument(msg); }

// Throws std::runtime_error with CUDA's message if the last launch failed.
inline void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("pyengine CUDA kernel ") + what + " failed to launch: " +
                             cudaGetErrorString(err));
  }
}

inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("pyengine CUDA: ") + what + ": " +
                             cudaGetErrorString(err));
  }
}

// log2 of a power of two in [1, 1024]; -1 otherwise.
inline int tokens_per_block_shift(int32_t tokens_per_block) {
  for (int s = 0; s <= 10; ++s)
    if (tokens_per_block == (1 << s)) return s;
  return -1;
}

// The process's record of kernel shared-memory opt-ins (one for every translation unit).
inline SmemOptInRegistry& smem_opt_ins() {
  static SmemOptInRegistry registry;
  return registry;
}

// Opts `kernel` into `bytes` of dynamic shared memory on the current device, once per
// (kernel, device) and size; nothing for sizes within the default 48 KiB.
template <class Kernel>
void allow_smem(Kernel kernel, int bytes) {
  if (bytes <= kDefaultDynamicSmemBytes) return;
  int dev = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  smem_opt_ins().ensure(reinterpret_cast<const void*>(kernel), dev, bytes, [&] {
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
               "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  });
}

}  // namespace pyengine::kernels::cuda::detail
