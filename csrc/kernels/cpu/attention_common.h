// Internal interface between the paged-attention front end (validation, work planning, ISA
// dispatch: paged_attention.cpp) and the compute back ends (attention_impl.h, compiled once per
// instruction-set level).
#pragma once

#include <cstdint>

#include "pyengine/cpu_isa.h"
#include "pyengine/kernels.h"

namespace pyengine::kernels::cpu {

// One unit of parallel work: the query rows [q0, q1) (relative to the sequence's first query
// row) of sequence `seq`, for every query head of KV head `kv_head`, over the KV token range
// [kv_lo, kv_hi) (already narrowed to what those rows can see). partial < 0: the item covers all
// visible KV and writes `out` directly; otherwise it is one split-K piece and writes its
// un-normalised accumulator, running max and running sum to partial slot `partial`.
//
// A decode item (one query row, q1 = q0 + 1) may cover `heads` consecutive KV heads from kv_head:
// its rows are then those heads' query heads in order, and the decode kernel reads the heads'
// K/V slices of each block one after another -- a contiguous run of the block -- instead of one
// head's 4 KB slice per block, which keeps the hardware prefetcher streaming. Every row is
// computed as a one-head item would compute it.
struct WorkItem {
  int32_t seq;
  int32_t kv_head;
  int32_t q0, q1;
  int32_t kv_lo, kv_hi;
  int32_t partial;
  int32_t heads = 1;
};

// Merges the split-K pieces [first_partial, first_partial + num_partials) of one (seq, kv_head,
// query tile) into `out`.
struct CombineItem {
  int32_t seq;
  int32_t kv_head;
  int32_t q0, q1;
  int32_t first_partial;
  int32_t num_partials;
  int32_t heads = 1;  // KV heads from kv_head (as the pieces' WorkItem)
};

// Whether the level's back end runs one-row items with several KV heads (its decode kernel:
// the AVX2 and AVX-512 builds, head_dim a multiple of 16). The planner groups heads only then.
inline bool decode_kernel_groups_heads(CpuIsa isa, int32_t head_dim) {
  return (isa == CpuIsa::kAvx2 || isa == CpuIsa::kAvx512) && head_dim % 16 == 0;
}

struct AttnParams {
  void* out;
  int64_t out_row_stride;
  const void* query;
  int64_t query_row_stride;
  DType q_dtype;
  const void* k_cache;
  const void* v_cache;
  DType cache_dtype;
  const int32_t* query_start_loc;
  const int32_t* seq_lens;
  const int32_t* block_tables;
  int32_t max_blocks_per_seq;
  int32_t num_kv_heads;
  int32_t group;  // query heads per KV head
  int32_t head_dim;
  int32_t tokens_per_block;
  float scale;
  int32_t sliding_window;
  float softcap;  // > 0: scores become softcap * tanh(score / softcap); 0: off

  // plan
  const WorkItem* items;
  int32_t num_items;
  const CombineItem* combines;
  int32_t num_combines;
  int32_t max_rows;              // max query rows (tokens x group) of one item
  float* thread_scratch;         // num_threads x thread_scratch_floats
  int64_t thread_scratch_floats;
  float* partials;               // num partial slots x partial_floats
  int64_t partial_floats;        // max_rows * (head_dim + 2)
  int32_t num_threads;
};

// Row stride (floats) of the per-thread score buffer: room for 16-wide stores starting anywhere
// inside a block.
inline int64_t attention_score_stride(int32_t tokens_per_block) {
  return (static_cast<int64_t>(tokens_per_block) + 15) / 16 * 16 + 16;
}

// Floats of per-thread scratch the back ends need for a given shape.
inline int64_t attention_scratch_floats(int32_t max_rows, int32_t head_dim,
                                        int32_t tokens_per_block) {
  const int64_t f = 2 * static_cast<int64_t>(max_rows) * head_dim  // Q, accumulator
                    + 2 * static_cast<int64_t>(max_rows)           // running max / sum
                    + max_rows * attention_score_stride(tokens_per_block)  // scores
                    + 2 * static_cast<int64_t>(tokens_per_block) * head_dim  // K, V block fp32
                    + (head_dim > 64 ? 16 * static_cast<int64_t>(head_dim) : 1024);  // SIMD staging (decode: 4 x 16 x 16)
  return (f + 15) / 16 * 16 + 16;  // keep each thread's slice 64-byte aligned, plus a gap
}

// The back end of each instruction-set level (attention_<level>.cpp).
namespace isa_generic { void attention_run(const AttnParams& p); }
namespace isa_avx2 { void attention_run(const AttnParams& p); }
namespace isa_avx512 { void attention_run(const AttnParams& p); }
namespace isa_neon { void attention_run(const AttnParams& p); }

}  // namespace pyengine::kernels::cpu
