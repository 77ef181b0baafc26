// paged_attention front end: argument validation, work planning (query tiles x KV heads, split-K
// for long contexts with few work items), scratch allocation and run-time ISA dispatch.
#include "parallel.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "../attention_checks.h"
#include "attention_common.h"
#include "isa_target.h"
#include "dtype_check.h"
#include "pyengine/kernels.h"

namespace pyengine::kernels {


namespace {

using cpu::AttnParams;
using cpu::CombineItem;
using cpu::WorkItem;

// Query rows (tokens x query heads of one KV head) per work item (Q tile + accumulator stay
// within L1/L2).
inline int32_t target_rows(int32_t head_dim) { return head_dim <= 64 ? 64 : 32; }
// Smallest split-K piece, in KV tokens.
constexpr int32_t kMinSplitTokens = 256;

void fail(const std::string& msg) { throw std::invalid_argument(msg); }

struct Scratch {
  std::vector<WorkItem> items;
  std::vector<CombineItem> combines;
  std::vector<float> thread;
  std::vector<float> partials;
};

// Reused across calls by the calling thread: no allocation per layer once warmed up.
Scratch& scratch() {
  static thread_local Scratch s;
  return s;
}

}  // namespace

void check_attention_indices(const int32_t* query_start_loc, const int32_t* seq_lens,
                             const int32_t* block_tables, int32_t num_seqs, int32_t num_tokens,
                             int32_t max_blocks_per_seq, int32_t tokens_per_block, int32_t num_blocks,
                             int32_t sliding_window) {
  if (tokens_per_block <= 0) fail("tokens_per_block: must be > 0");
  if (num_seqs <= 0) return;
  if (query_start_loc[0] < 0) fail("query_start_loc: must start at >= 0");
  if (query_start_loc[num_seqs] > num_tokens)
    fail("query_start_loc: ends at " + std::to_string(query_start_loc[num_seqs]) + ", beyond the " +
         std::to_string(num_tokens) + " query rows");
  for (int32_t s = 0; s < num_seqs; ++s) {
    const int32_t q_len = query_start_loc[s + 1] - query_start_loc[s];
    if (q_len < 0) fail("query_start_loc: must be non-decreasing");
    const int32_t len = seq_lens[s];
    if (len < q_len)
      fail("seq_lens: seq_lens[" + std::to_string(s) + "] = " + std::to_string(len) +
           " is smaller than its query length " + std::to_string(q_len));
    if (q_len == 0) continue;
    const int64_t nblocks = (static_cast<int64_t>(len) + tokens_per_block - 1) / tokens_per_block;
    if (nblocks > max_blocks_per_seq)
      fail("seq_lens: seq_lens[" + std::to_string(s) + "] = " + std::to_string(len) +
           " needs more than max_blocks_per_seq blocks");
    const int32_t* bt = block_tables + static_cast<int64_t>(s) * max_blocks_per_seq;
    const int64_t first = sliding_window > 0
                              ? std::max<int64_t>(0, len - q_len - sliding_window + 1) /
                                    tokens_per_block
                              : 0;
    for (int64_t b = first; b < nblocks; ++b)
      if (bt[b] < 0 || bt[b] >= num_blocks)
        fail("block_tables: block id " + std::to_string(bt[b]) + " for sequence " + std::to_string(s) +
             ", block " + std::to_string(b) + " is outside the cache's " + std::to_string(num_blocks) +
             " blocks");
  }
}

void paged_attention(void* out, int64_t out_row_stride, const void* query, int64_t query_row_stride,
                     DType q_dtype, const void* k_cache, const void* v_cache, DType cache_dtype,
                     const int32_t* query_start_loc, const int32_t* seq_lens,
                     const int32_t* block_tables, int32_t num_seqs, int32_t num_tokens,
                     int32_t max_blocks_per_seq, int32_t num_heads, int32_t num_kv_heads,
                     int32_t head_dim, int32_t tokens_per_block, int32_t num_blocks, float scale,
                     int32_t sliding_window, float softcap, int32_t num_threads) {
  // ---- validation ----
  cpu::check_dtype(q_dtype, "q_dtype");
  cpu::check_dtype(cache_dtype, "cache_dtype");
  check_attention_heads(num_seqs, max_blocks_per_seq, num_heads, num_kv_heads);
  if (head_dim <= 0) fail("head_dim: must be > 0");
  if (tokens_per_block <= 0) fail("tokens_per_block: must be > 0");
  if (num_tokens < 0) fail("num_tokens: must be >= 0");
  if (num_blocks < 0) fail("num_blocks: must be >= 0");
  if (sliding_window < 0) fail("sliding_window: must be >= 0 (0 disables it)");
  if (!(scale == scale)) fail("scale: must not be NaN");
  check_attention_softcap(softcap);
  if (num_seqs == 0) return;
  check_attention_buffers(out, out_row_stride, query, query_row_stride, k_cache, v_cache,
                          query_start_loc, seq_lens, block_tables, num_heads, head_dim);

  check_attention_indices(query_start_loc, seq_lens, block_tables, num_seqs, num_tokens,
                          max_blocks_per_seq, tokens_per_block, num_blocks, sliding_window);

  // ---- plan ----
  const int32_t group = num_heads / num_kv_heads;
  const int32_t tile_tokens = std::max<int32_t>(1, target_rows(head_dim) / group);
  const int32_t max_rows = tile_tokens * group;
  int32_t nt = cpu::resolve_threads(num_threads);
  if (nt < 1) nt = 1;

  Scratch& sc = scratch();
  auto& items = sc.items;
  auto& combines = sc.combines;
  items.clear();
  combines.clear();
  // One-row tiles (decode) take several KV heads per item where the level's decode kernel runs
  // them (see WorkItem): as many as keep at least one item per thread, within the rows an item holds.
  int32_t one_row_tiles = 0, other_tiles = 0;
  for (int32_t s = 0; s < num_seqs; ++s) {
    const int32_t q_len = query_start_loc[s + 1] - query_start_loc[s];
    one_row_tiles += q_len > 0 && (q_len - 1) % tile_tokens == 0;  // the last tile has one row
    other_tiles += (q_len + tile_tokens - 1) / tile_tokens - (q_len > 0 && (q_len - 1) % tile_tokens == 0);
  }
  int32_t group_heads = 1;
  if (cpu::decode_kernel_groups_heads(cpu_isa(), head_dim)) {
    group_heads = std::max(1, std::min(num_kv_heads, max_rows / group));
    const auto items_with = [&](int32_t g) {
      return static_cast<int64_t>(one_row_tiles) * ((num_kv_heads + g - 1) / g) +
             static_cast<int64_t>(other_tiles) * num_kv_heads;
    };
    while (group_heads > 1 && items_with(group_heads) < nt) group_heads = (group_heads + 1) / 2;
  }
  int64_t total_span = 0;
  for (int32_t s = 0; s < num_seqs; ++s) {
    const int32_t q_len = query_start_loc[s + 1] - query_start_loc[s];
    const int32_t base = seq_lens[s] - q_len;
    for (int32_t q0 = 0; q0 < q_len; q0 += tile_tokens) {
      const int32_t q1 = std::min(q_len, q0 + tile_tokens);
      const int32_t hi = base + q1;  // last row's position + 1
      const int32_t lo = sliding_window > 0 ? std::max(0, base + q0 - sliding_window + 1) : 0;
      const int32_t step = q1 - q0 == 1 ? group_heads : 1;
      for (int32_t h = 0; h < num_kv_heads; h += step)
        items.push_back({s, h, q0, q1, lo, hi, -1, std::min(step, num_kv_heads - h)});
      total_span += static_cast<int64_t>(hi - lo) * num_kv_heads;
    }
  }
  const int32_t num_base = static_cast<int32_t>(items.size());
  if (num_base == 0) return;

  // Split-K when there are too few items to keep the threads busy.
  int32_t num_partials = 0;
  if (nt > 1 && num_base < 4 * nt) {
    // about 4 pieces per thread of equal work (KV tokens x heads)
    const int64_t piece_work = (total_span + 4 * nt - 1) / (4 * nt);
    std::vector<WorkItem> split;
    split.reserve(items.size() * 4);
    for (const WorkItem& it : items) {
      int64_t chunk = std::max<int64_t>(kMinSplitTokens, (piece_work + it.heads - 1) / it.heads);
      chunk = (chunk + tokens_per_block - 1) / tokens_per_block * tokens_per_block;
      const int64_t span = it.kv_hi - it.kv_lo;
      if (span <= chunk + chunk / 2) {
        split.push_back(it);
        continue;
      }
      // block-aligned pieces
      const int32_t first = num_partials;
      int32_t start = it.kv_lo;
      while (start < it.kv_hi) {
        int64_t end = (static_cast<int64_t>(start) / tokens_per_block) * tokens_per_block + chunk;
        if (end >= it.kv_hi || it.kv_hi - end < chunk / 2) end = it.kv_hi;
        WorkItem piece = it;
        piece.kv_lo = start;
        piece.kv_hi = static_cast<int32_t>(end);
        piece.partial = num_partials++;
        split.push_back(piece);
        start = static_cast<int32_t>(end);
      }
      combines.push_back({it.seq, it.kv_head, it.q0, it.q1, first, num_partials - first, it.heads});
    }
    items.swap(split);
  }
  // Longest items first, so dynamic scheduling balances the tail.
  if (items.size() > 1)
    std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) {
      return (int64_t{a.kv_hi} - a.kv_lo) * (a.q1 - a.q0) > (int64_t{b.kv_hi} - b.kv_lo) * (b.q1 - b.q0);
    });
  nt = std::min<int32_t>(nt, static_cast<int32_t>(items.size()));

  const int64_t per_thread = cpu::attention_scratch_floats(max_rows, head_dim, tokens_per_block);
  const int64_t per_partial = static_cast<int64_t>(max_rows) * (head_dim + 2);
  if (static_cast<int64_t>(sc.thread.size()) < per_thread * nt + 16)
    sc.thread.resize(per_thread * nt + 16);
  if (static_cast<int64_t>(sc.partials.size()) < per_partial * num_partials)
    sc.partials.resize(per_partial * num_partials);

  AttnParams p{};
  p.out = out;
  p.out_row_stride = out_row_stride;
  p.query = query;
  p.query_row_stride = query_row_stride;
  p.q_dtype = q_dtype;
  p.k_cache = k_cache;
  p.v_cache = v_cache;
  p.cache_dtype = cache_dtype;
  p.query_start_loc = query_start_loc;
  p.seq_lens = seq_lens;
  p.block_tables = block_tables;
  p.max_blocks_per_seq = max_blocks_per_seq;
  p.num_kv_heads = num_kv_heads;
  p.group = group;
  p.head_dim = head_dim;
  p.tokens_per_block = tokens_per_block;
  p.scale = scale;
  p.sliding_window = sliding_window;
  p.softcap = softcap;
  p.items = items.data();
  p.num_items = static_cast<int32_t>(items.size());
  p.combines = combines.data();
  p.num_combines = static_cast<int32_t>(combines.size());
  p.max_rows = max_rows;
  // 64-byte align the first thread's slice
  float* tbase = sc.thread.data();
  while (reinterpret_cast<uintptr_t>(tbase) % 64 != 0) ++tbase;
  p.thread_scratch = tbase;
  p.thread_scratch_floats = per_thread;
  p.partials = sc.partials.data();
  p.partial_floats = per_partial;
  p.num_threads = nt;

  PYENGINE_ISA_CALL(attention_run, p);
}

}  // namespace pyengine::kernels
