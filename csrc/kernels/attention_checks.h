// Host-side argument checks shared by the CPU and CUDA paged-attention entry points (plain C++:
// compiled by the host compiler and by nvcc alike). Each throws std::invalid_argument naming
// the argument.
#pragma once

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace pyengine::kernels {

// Head counts and the table width: positive, query heads a multiple of KV heads.
inline void check_attention_heads(int32_t num_seqs, int32_t max_blocks_per_seq, int32_t num_heads,
                                  int32_t num_kv_heads) {
  auto fail = [](const char* msg) { throw std::invalid_argument(msg); };
  if (num_seqs < 0) fail("num_seqs: must be >= 0");
  if (max_blocks_per_seq <= 0) fail("max_blocks_per_seq: must be > 0");
  if (num_heads <= 0) fail("num_heads: must be > 0");
  if (num_kv_heads <= 0) fail("num_kv_heads: must be > 0");
  if (num_heads % num_kv_heads != 0) fail("num_heads: must be a multiple of num_kv_heads");
}

// The buffers of a call with work to do: none null, row strides at least one row.
inline void check_attention_buffers(const void* out, int64_t out_row_stride, const void* query,
                                    int64_t query_row_stride, const void* k_cache,
                                    const void* v_cache, const int32_t* query_start_loc,
                                    const int32_t* seq_lens, const int32_t* block_tables,
                                    int32_t num_heads, int32_t head_dim) {
  auto fail = [](const char* msg) { throw std::invalid_argument(msg); };
  if (out == nullptr) fail("out: null pointer");
  if (query == nullptr) fail("query: null pointer");
  if (k_cache == nullptr) fail("k_cache: null pointer");
  if (v_cache == nullptr) fail("v_cache: null pointer");
  if (query_start_loc == nullptr) fail("query_start_loc: null pointer");
  if (seq_lens == nullptr) fail("seq_lens: null pointer");
  if (block_tables == nullptr) fail("block_tables: null pointer");
  const int64_t row = static_cast<int64_t>(num_heads) * head_dim;
  if (query_row_stride < row) fail("query_row_stride: must be >= num_heads * head_dim");
  if (out_row_stride < row) fail("out_row_stride: must be >= num_heads * head_dim");
}

// The logit soft-cap: 0 (off) or a finite positive cap.
inline void check_attention_softcap(float softcap) {
  if (!(softcap >= 0.0f) || std::isinf(softcap))
    throw std::invalid_argument("softcap: must be finite and >= 0 (0 disables it), got " +
                                std::to_string(softcap));
}

}  // namespace pyengine::kernels
