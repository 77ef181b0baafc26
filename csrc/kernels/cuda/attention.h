// Internal interface between the paged-attention front end (paged_attention.cu) and its
// kernels (decode_attention.cu, split_merge.cu, prefill_attention.cu). Host code only includes
// this; the struct is also the kernels' parameter block (passed by value).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "pyengine/kernels.h"
#include "split_k_plan.h"  // kMinSplitTokens, max_splits, choose_kernel, ...

namespace pyengine::kernels::cuda::detail {

// Query heads of one KV head handled together by one decode CTA (a larger GQA group is cut
// into chunks of this many heads; each chunk reads the KV head's cache once).
constexpr int kDecodeMaxGroup = 8;

struct AttnArgs {
  void* out;
  int64_t out_stride;
  const void* q;
  int64_t q_stride;
  const void* k_cache;
  const void* v_cache;
  const int32_t* qsl;
  const int32_t* seq_lens;
  const int32_t* block_tables;
  int32_t num_seqs;
  int32_t num_tokens;
  int32_t max_blocks_per_seq;
  int32_t num_heads;
  int32_t num_kv_heads;
  int32_t group;        // num_heads / num_kv_heads
  int32_t tpb_shift;    // log2(tokens_per_block)
  int32_t sliding_window;
  float scale_log2;     // scale * k_scale * log2(e): scores in the exp2 domain
  // logit soft-capping (softcap > 0; the kernels take it as a template flag, see score_log2)
  float qk_scale;       // scale * k_scale
  float softcap;
  float softcap_log2;   // softcap * log2(e)
  float v_scale;
  // flash-decoding split-K (decode kernel only)
  int32_t head_chunks;  // ceil(group / kDecodeMaxGroup)
  int32_t num_splits;
  int32_t split_len;    // context tokens per split (a multiple of every KV tile)
  float* ws_o;          // [num_tokens, num_heads, num_splits, head_dim] normalized partial out
  float* ws_ml;         // [num_tokens, num_heads, num_splits, 2] (max in log2 units, sum)
};

#ifdef __CUDACC__
// A score in the exp2 domain from the raw dot product q.k (k as stored): scale * k_scale * q.k,
// or with kSoftcap softcap * tanh(scale * k_scale * q.k / softcap) (Gemma 2's logit soft-cap,
// its division and all; tanhf, not tanh.approx, whose 2^-11 error scaled by a cap of 30-50
// would move the logits by hundredths), times log2(e).
template <bool kSoftcap>
__device__ __forceinline__ float score_log2(float dot, const AttnArgs& a) {
  if constexpr (kSoftcap) {
    return a.softcap_log2 * tanhf(dot * a.qk_scale / a.softcap);
  } else {
    return dot * a.scale_log2;
  }
}
#endif

// M blocks (64 packed query rows) of the longest query in the prefill kernel's grid.
inline int64_t prefill_m_blocks(int32_t max_query_len, int32_t group) {
  return (static_cast<int64_t>(max_query_len) * group + 63) / 64;
}

// The SIMT flash-decoding kernel: one CTA per (query row, KV head chunk, split). Serves decode
// batches, fp32 activations and head_dim 256 prefill (one row per CTA, causal per row).
void launch_decode(const AttnArgs& a, DType q_dtype, DType cache_dtype, int head_dim,
                   cudaStream_t stream);
// Combines the splits of launch_decode into `out` (only when num_splits > 1).
void launch_merge(const AttnArgs& a, DType q_dtype, int head_dim, cudaStream_t stream);
// The tensor-core FlashAttention-2 kernel for bf16/fp16, head_dim 64/128; needs `q`, `out`
// 16-byte aligned with row strides a multiple of 8 elements (the front end checks).
void launch_prefill(const AttnArgs& a, int32_t max_query_len, DType q_dtype, DType cache_dtype,
                    int head_dim, cudaStream_t stream);

}  // namespace pyengine::kernels::cuda::detail
