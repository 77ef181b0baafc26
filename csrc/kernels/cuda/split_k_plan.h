// The CUDA paged attention's choice of kernel for a batch and the split-K (flash-decoding)
// workspace arithmetic. Plain C++ (no CUDA): paged_attention.cu dispatches with it, the public
// workspace functions (attention_workspace.cpp) answer with it in every build, and
// tests/cpp/test_cuda_split_k_plan.cpp checks it on the host.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "pyengine/kernels.h"

namespace pyengine::kernels::cuda::detail {

// Smallest piece of context one split of flash-decoding handles, in tokens.
constexpr int kMinSplitTokens = 256;
// Most splits of one query row.
constexpr int kMaxSplits = 32;
// Split-K is only used while num_tokens * splits stays within this many rows, which bounds the
// workspace to about kSplitRowBudget * num_heads * (head_dim + 2) * 4 bytes whatever the batch.
constexpr int kSplitRowBudget = 1024;

enum class AttentionKernel {
  kTensorCorePrefill,  // FlashAttention-2 on tensor cores: no workspace
  kSplitKDecode,       // SIMT flash-decoding: a workspace when a row has more than one split
};

// The tensor-core kernel takes batches with a query longer than one token in bfloat16/float16,
// head_dim 64 or 128, whose query rows it can load 16 bytes at a time (`query_vector_aligned`:
// 16-byte aligned, row stride a multiple of 8 elements). Everything else -- decode batches,
// float32, head_dim 256, misaligned queries -- goes to the split-K kernel.
inline AttentionKernel choose_kernel(DType q_dtype, int32_t head_dim, int32_t max_query_len,
                                     bool query_vector_aligned) {
  const bool tensor_core = max_query_len > 1 && q_dtype != DType::kFloat32 &&
                           (head_dim == 64 || head_dim == 128) && query_vector_aligned;
  return tensor_core ? AttentionKernel::kTensorCorePrefill : AttentionKernel::kSplitKDecode;
}

// Most splits a batch of `num_tokens` rows may use on the split-K kernel.
inline int max_splits(int32_t num_tokens, int32_t max_context_len) {
  const int64_t by_len =
      (static_cast<int64_t>(std::max<int32_t>(0, max_context_len)) + kMinSplitTokens - 1) /
      kMinSplitTokens;
  const int64_t by_rows = kSplitRowBudget / std::max<int32_t>(1, num_tokens);
  const int64_t n = std::min<int64_t>({kMaxSplits, by_len, by_rows});
  return static_cast<int>(std::max<int64_t>(1, n));
}

// Workspace one batch of `num_tokens` rows needs on the split-K kernel: for each row, head and
// split a normalized partial output (head_dim floats) and its (max, sum); none with one split.
inline size_t split_k_batch_workspace_bytes(int32_t num_tokens, int32_t num_heads,
                                            int32_t head_dim, int32_t max_context_len) {
  if (num_tokens <= 0) return 0;
  const int splits = max_splits(num_tokens, max_context_len);
  if (splits <= 1) return 0;
  return static_cast<size_t>(num_tokens) * static_cast<size_t>(num_heads) *
         static_cast<size_t>(splits) * (static_cast<size_t>(head_dim) + 2) * sizeof(float);
}

// Workspace for *every* batch of at most `max_tokens` rows. Not the need at max_tokens alone:
// rows * max_splits(rows) is not monotone (512 rows may take 2 splits, 513 only 1), so a
// workspace sized for 513 rows would be too small for 512.
inline size_t split_k_workspace_bytes(int32_t max_tokens, int32_t num_heads, int32_t head_dim,
                                      int32_t max_context_len) {
  size_t most = 0;
  // past kSplitRowBudget / 2 rows a batch has a single split and needs nothing
  const int32_t last = std::min<int32_t>(max_tokens, kSplitRowBudget / 2);
  for (int32_t n = 1; n <= last; ++n)
    most = std::max(most, split_k_batch_workspace_bytes(n, num_heads, head_dim, max_context_len));
  return most;
}

// The most query rows a batch reaching the split-K kernel can have, for batches of at most
// `max_seqs` sequences and `max_tokens` tokens whose queries are vector-aligned (as the model's
// are). Where prefill goes to the tensor-core kernel only batches of one query token per
// sequence (max_query_len 1) reach split-K: at most max_seqs rows. Where it cannot (float32,
// head_dim 256) every batch does, prefill included: up to max_tokens rows -- sized for
// max_seqs, those engines' prefill batches (the KV-capacity estimate's max_tokens dummy batch
// first) would be refused. Sizing every engine for max_tokens instead would cost bf16/fp16
// engines memory they never use (the workspace is bounded by kSplitRowBudget rows anyway).
inline int32_t split_k_max_rows(DType q_dtype, int32_t head_dim, int32_t max_seqs,
                                int32_t max_tokens) {
  const bool prefill_on_tensor_cores =
      choose_kernel(q_dtype, head_dim, /*max_query_len=*/2, /*query_vector_aligned=*/true) ==
      AttentionKernel::kTensorCorePrefill;
  return prefill_on_tensor_cores ? max_seqs : std::max(max_seqs, max_tokens);
}

}  // namespace pyengine::kernels::cuda::detail
