// CUDA kernels of the attention path: the paged KV store and paged attention on the GPU.
//
// Same layouts and argument meanings as the CPU kernels (pyengine/kernels.h); every pointer
// here is a *device* pointer and every launch goes on `stream` (a cudaStream_t passed as void*,
// so this header needs no CUDA include) of CUDA device `device`, the device of the pointers:
// the call makes that device current for itself and restores the previous one. Nothing here
// synchronizes, allocates or reads device memory on the host, so each call can be captured in
// a CUDA graph. The kernels need a GPU of compute capability 8.0 or newer; on an older one a
// call throws std::runtime_error naming the device and its capability.
//
// Supported:
//   query/out/key/value dtype   float32, bfloat16, float16
//   cache dtype                 the activation dtype, or kFloat8E4M3 (e4m3 storage with a
//                               per-tensor scale: stored = value / scale, read = stored * scale)
//                               for bfloat16/float16 activations
//   head_dim                    64, 128, 256 (prefill tensor-core path: 64, 128)
// Errors: invalid arguments throw std::invalid_argument naming the argument; a failed launch
// throws std::runtime_error with CUDA's message. In a build without CUDA every launch throws
// std::runtime_error saying so (cuda_kernels_built() tells which build this is); the workspace
// arithmetic answers in every build.
#pragma once

#include <cstddef>
#include <cstdint>

#include "pyengine/kernels.h"

namespace pyengine::kernels::cuda {

// True when this library was built with the CUDA kernels.
bool cuda_kernels_built();

// The CUDA architectures the kernels were compiled for, e.g. "80;90a" ("" without CUDA).
const char* cuda_architectures();

// Writes this step's K/V rows into their cache slots (slot_mapping < 0 skips a row),
// converting to the cache dtype; fp8 divides by k_scale / v_scale first.
void store_kv(const void* key, const void* value, int64_t key_row_stride, int64_t value_row_stride,
              DType src_dtype, void* k_cache, void* v_cache, DType cache_dtype, float k_scale,
              float v_scale, const int32_t* slot_mapping, int32_t num_tokens, int32_t num_kv_heads,
              int32_t head_dim, int32_t tokens_per_block, int32_t device, void* stream);

// paged_attention serves a batch with one of two kernels: the tensor-core prefill kernel
// (bfloat16/float16, head_dim 64/128, a query longer than one token, query rows 16-byte aligned
// with a row stride a multiple of 8 elements) or the split-K flash-decoding kernel (everything
// else: decode batches, float32, head_dim 256, misaligned queries). Only the latter uses the
// workspace, for its split-K partial results.

// Bytes of workspace enough for *every* batch of at most `num_tokens` query rows whose KV
// lengths are at most `max_context_len` (at most about 1024 rows' worth of partial results,
// however large num_tokens is).
size_t paged_attention_workspace_bytes(int32_t num_tokens, int32_t num_heads, int32_t head_dim,
                                       int32_t max_context_len);

// Bytes of workspace one batch needs: 0 when it goes to the tensor-core kernel (or needs a
// single split). `query_vector_aligned`: the query is 16-byte aligned with a row stride a
// multiple of 8 elements.
size_t paged_attention_batch_workspace_bytes(DType q_dtype, int32_t num_tokens, int32_t num_heads,
                                             int32_t head_dim, int32_t max_query_len,
                                             int32_t max_context_len, bool query_vector_aligned);

// The most query rows a batch that reaches the split-K kernel can have, when batches hold at
// most `max_seqs` sequences and `max_tokens` tokens and queries are vector-aligned: max_seqs
// (decode batches) where prefill goes to the tensor-core kernel, else max(max_seqs,
// max_tokens). An engine sizes its workspace with paged_attention_workspace_bytes(this, ...).
int32_t paged_attention_split_k_rows(DType q_dtype, int32_t head_dim, int32_t max_seqs,
                                     int32_t max_tokens);

// Causal paged attention, as pyengine::kernels::paged_attention (sliding_window and the logit
// soft-cap `softcap` included: > 0 caps every score s = scale * q.k to softcap * tanh(s / softcap)
// before the mask and softmax, in both kernels; 0 turns it off).
//   num_tokens       query rows in the batch (query_start_loc[num_seqs]; passed so the launch
//                    needs no device read).
//   max_query_len    the longest query of the batch: 1 selects the flash-decoding kernel, more
//                    the prefill kernel (which also handles decode rows mixed in).
//   max_context_len  an upper bound of seq_lens (sizes the split-K grid; a CUDA graph passes
//                    the engine's max_seq_len so the captured grid serves every replay).
//   workspace        device scratch of at least paged_attention_batch_workspace_bytes(...)
//                    bytes (a buffer of paged_attention_workspace_bytes(n, ...) serves every
//                    batch of at most n rows); unused by tensor-core batches.
//   device           the CUDA device of every pointer and of `stream`.
void paged_attention(void* out, int64_t out_row_stride, const void* query, int64_t query_row_stride,
                     DType q_dtype, const void* k_cache, const void* v_cache, DType cache_dtype,
                     float k_scale, float v_scale, const int32_t* query_start_loc,
                     const int32_t* seq_lens, const int32_t* block_tables, int32_t num_seqs,
                     int32_t num_tokens, int32_t max_blocks_per_seq, int32_t num_heads,
                     int32_t num_kv_heads, int32_t head_dim, int32_t tokens_per_block, float scale,
                     int32_t sliding_window, float softcap, int32_t max_query_len,
                     int32_t max_context_len, void* workspace, size_t workspace_bytes,
                     int32_t device, void* stream);

}  // namespace pyengine::kernels::cuda
