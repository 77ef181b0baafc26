#include "batch_manager/scheduler.h"

#include <algorithm>
#include <string>
#include <unordered_set>

namespace pyengine {

MicroBatchScheduler::MicroBatchScheduler(int32_t max_batch_size, int32_t max_num_tokens,
                                         bool enable_chunked_context, int32_t chunk_unit)
    : max_batch_size_(max_batch_size),
      max_num_tokens_(max_num_tokens),
      enable_chunked_context_(enable_chunked_context),
      chunk_unit_(chunk_unit) {
  if (max_batch_size <= 0)
    throw std::invalid_argument("max_batch_size must be positive, got " + std::to_string(max_batch_size));
  if (max_num_tokens <= 0)
    throw std::invalid_argument("max_num_tokens must be positive, got " + std::to_string(max_num_tokens));
  if (chunk_unit <= 0)
    throw std::invalid_argument("chunk_unit must be positive, got " + std::to_string(chunk_unit));
  if (enable_chunked_context && max_num_tokens < chunk_unit)
    throw std::invalid_argument("max_num_tokens (" + std::to_string(max_num_tokens) +
                                ") must be at least the chunk unit (" + std::to_string(chunk_unit) +
                                ") with chunked context");
}

std::vector<Request*> MicroBatchScheduler::schedule(const std::vector<Request*>& fitting,
                                                   const KvCacheManager& kv) const {
  std::vector<Request*> batch;
  int32_t budget = max_num_tokens_;
  for (Request* r : fitting) {
    r->chunk_size = 0;
    if (!r->in_generation()) continue;
    if (static_cast<int32_t>(batch.size()) >= max_batch_size_ || budget < 1) break;
    r->chunk_size = 1;
    budget -= 1;
    batch.push_back(r);
  }
  const int32_t tpb = kv.tokens_per_block();
  std::unordered_set<uint64_t> in_flight;  // keys of blocks this batch's context chunks complete
  for (Request* r : fitting) {
    if (r->in_generation()) continue;
    if (static_cast<int32_t>(batch.size()) >= max_batch_size_) break;
    int32_t start = r->context_pos;
    r->planned_reuse_blocks = 0;
    if (kv.reuse_enabled() && r->reuse_prefix && !kv.has_sequence(r->id)) {
      const int32_t reusable = probe_reuse(*r, kv).blocks;
      const size_t next = static_cast<size_t>(reusable);
      if (static_cast<int32_t>(next) < r->max_reusable_blocks(tpb) && next < r->block_keys.size() &&
          in_flight.count(r->block_keys[next]))
        continue;  // another request computes that block now: reuse it next step
      r->planned_reuse_blocks = reusable;
      start = reusable * tpb;
    }
    const int32_t rest = r->context_len - start;
    int32_t chunk;
    if (rest <= budget) {
      chunk = rest;
    } else if (enable_chunked_context_) {
      chunk = budget / chunk_unit_ * chunk_unit_;  // all chunks but the last are whole units
      if (chunk == 0) break;
    } else {
      continue;  // does not fit this step's budget; a shorter one behind it may
    }
    r->chunk_size = chunk;
    budget -= chunk;
    batch.push_back(r);
    for (int32_t b = start / tpb; b < (start + chunk) / tpb && b < static_cast<int32_t>(r->block_keys.size()); ++b)
      in_flight.insert(r->block_keys[b]);
  }
  return batch;
}

}  // namespace pyengine
