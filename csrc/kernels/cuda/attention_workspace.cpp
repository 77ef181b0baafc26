// The public split-K workspace arithmetic of the CUDA paged attention (pyengine/cuda_kernels.h).
// Plain C++, compiled in every build -- with or without the CUDA kernels -- so an engine's
// sizing can be computed (and tested) anywhere.
#include <stdexcept>
#include <string>

#include "kernels/cuda/split_k_plan.h"
#include "pyengine/cuda_kernels.h"

namespace pyengine::kernels::cuda {
namespace {

[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument(msg); }

void check_sizes(int32_t num_tokens, int32_t num_heads, int32_t head_dim,
                 int32_t max_context_len) {
  if (num_tokens < 0) fail("num_tokens: must be >= 0");
  if (num_heads <= 0) fail("num_heads: must be > 0");
  if (head_dim <= 0) fail("head_dim: must be > 0");
  if (max_context_len < 0) fail("max_context_len: must be >= 0");
}

}  // namespace

size_t paged_attention_workspace_bytes(int32_t num_tokens, int32_t num_heads, int32_t head_dim,
                                       int32_t max_context_len) {
  check_sizes(num_tokens, num_heads, head_dim, max_context_len);
  return detail::split_k_workspace_bytes(num_tokens, num_heads, head_dim, max_context_len);
}

size_t paged_attention_batch_workspace_bytes(DType q_dtype, int32_t num_tokens, int32_t num_heads,
                                             int32_t head_dim, int32_t max_query_len,
                                             int32_t max_context_len, bool query_vector_aligned) {
  check_sizes(num_tokens, num_heads, head_dim, max_context_len);
  if (max_query_len < 0) fail("max_query_len: must be >= 0");
  if (detail::choose_kernel(q_dtype, head_dim, max_query_len, query_vector_aligned) ==
      detail::AttentionKernel::kTensorCorePrefill)
    return 0;
  return detail::split_k_batch_workspace_bytes(num_tokens, num_heads, head_dim, max_context_len);
}

int32_t paged_attention_split_k_rows(DType q_dtype, int32_t head_dim, int32_t max_seqs,
                                     int32_t max_tokens) {
  if (head_dim <= 0) fail("head_dim: must be > 0");
  if (max_seqs < 0) fail("max_seqs: must be >= 0");
  if (max_tokens < 0) fail("max_tokens: must be >= 0");
  return detail::split_k_max_rows(q_dtype, head_dim, max_seqs, max_tokens);
}

}  // namespace pyengine::kernels::cuda
