// CPU kernels of the attention path: the paged KV store and paged attention.
//
// Layouts (row-major, all pointers to the first element):
//   key / value rows   [num_tokens, num_kv_heads, head_dim], rows `*_row_stride` elements
//                      apart, heads contiguous (head_dim apart) within a row.
//   k_cache / v_cache  [num_blocks, num_kv_heads, tokens_per_block, head_dim] for one layer.
//   query / out        [num_tokens, num_heads, head_dim], rows `*_row_stride` elements apart.
//   slot_mapping       [num_tokens] int32: block_id * tokens_per_block + offset; < 0 skips the row.
//                      num_blocks: the number of blocks in k_cache / v_cache.
//   query_start_loc    [num_seqs + 1] int32: the query rows of sequence i are
//                      query_start_loc[i] .. query_start_loc[i + 1] - 1.
//   seq_lens           [num_seqs] int32: KV length of sequence i *including* this step's rows;
//                      its query row j sits at position seq_lens[i] - q_len + j (causal).
//   block_tables       [num_seqs, max_blocks_per_seq] int32.
// Errors: invalid arguments throw std::invalid_argument naming the argument -- index contents
// included: before anything is read or written, a cheap pass checks every slot against the pool
// (slot < num_blocks * tokens_per_block), every block id a sequence uses against num_blocks,
// seq_lens against the table width and query_start_loc against num_tokens. (The CUDA kernels,
// pyengine/cuda_kernels.h, cannot read device memory cheaply: they trust their indices.)
#pragma once

#include <cstdint>

namespace pyengine::kernels {

// kFloat8E4M3 is a KV-cache storage type of the CUDA kernels only (cuda_kernels.h); the CPU
// kernels reject it.
enum class DType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kFloat8E4M3 = 3 };

// Size in bytes of one element of `dtype`.
int dtype_size(DType dtype);

// The index checks store_kv and paged_attention make before touching memory, on host arrays
// (also for indices bound for the CUDA kernels, which do not check theirs): every slot below
// num_blocks * tokens_per_block; query_start_loc from >= 0, non-decreasing, within num_tokens;
// each seq_len at least its query length and within the table's width; every block id a query
// can see in [0, num_blocks). Throw std::invalid_argument naming the argument and the value.
void check_kv_slots(const int32_t* slot_mapping, int32_t num_tokens, int32_t tokens_per_block,
                    int32_t num_blocks);
void check_attention_indices(const int32_t* query_start_loc, const int32_t* seq_lens,
                             const int32_t* block_tables, int32_t num_seqs, int32_t num_tokens,
                             int32_t max_blocks_per_seq, int32_t tokens_per_block, int32_t num_blocks,
                             int32_t sliding_window);

// Writes this step's K/V rows into their cache slots.
void store_kv(const void* key, const void* value, int64_t key_row_stride, int64_t value_row_stride,
              DType src_dtype, void* k_cache, void* v_cache, DType cache_dtype,
              const int32_t* slot_mapping, int32_t num_tokens, int32_t num_kv_heads,
              int32_t head_dim, int32_t tokens_per_block, int32_t num_blocks);

// Causal attention of each sequence's query rows over its paged KV (earlier KV plus this
// step's rows, already stored). Works for prefill chunks and decode rows in one batch.
// GQA/MQA: query head h reads KV head h / (num_heads / num_kv_heads).
// sliding_window > 0: a query at position p sees KV positions p - sliding_window + 1 .. p.
// softcap > 0: attention logit soft-capping (Gemma 2): each score s = scale * q.k becomes
// softcap * tanh(s / softcap) before the causal / sliding-window mask and the softmax; 0 turns
// it off, and a negative, infinite or NaN softcap is an error.
// Accumulates in fp32; `num_threads` <= 0 uses OpenMP's default. (A build without OpenMP,
// PYENGINE_OPENMP=OFF, runs every CPU kernel on the calling thread and ignores `num_threads`.)
void paged_attention(void* out, int64_t out_row_stride, const void* query, int64_t query_row_stride,
                     DType q_dtype, const void* k_cache, const void* v_cache, DType cache_dtype,
                     const int32_t* query_start_loc, const int32_t* seq_lens,
                     const int32_t* block_tables, int32_t num_seqs, int32_t num_tokens,
                     int32_t max_blocks_per_seq, int32_t num_heads, int32_t num_kv_heads,
                     int32_t head_dim, int32_t tokens_per_block, int32_t num_blocks, float scale,
                     int32_t sliding_window, float softcap, int32_t num_threads);

}  // namespace pyengine::kernels
