#include "batch_manager/resource_manager.h"

#include <algorithm>

namespace pyengine {

void SeqSlotResourceManager::prepare(std::vector<Request*>& batch) {
  for (Request* r : batch)
    if (r->seq_slot < 0) r->seq_slot = slots_.acquire(r->id);
}

void SeqSlotResourceManager::free(Request& r) {
  if (slots_.has_slot(r.id)) slots_.release(r.id);
  r.seq_slot = -1;
}

void KvCacheResourceManager::prepare(std::vector<Request*>& batch) {
  // New tables before any allocation, so no block they plan to reuse is evicted first.
  for (Request* r : batch) {
    if (kv_.has_sequence(r->id)) continue;
    const int32_t reused = kv_.add_sequence_with_reuse(r->id, r->block_keys, r->tokens, r->cache_root,
                                                       r->planned_reuse_blocks);
    if (reused > 0) {
      r->context_pos = reused * kv_.tokens_per_block();
      r->num_reused_tokens += r->context_pos;
      total_reused_tokens_ += r->context_pos;
      ++num_reuse_hits_;
    }
    if (r->context_pos + r->chunk_size > r->context_len) r->chunk_size = r->context_len - r->context_pos;
    if (r->context_pos + r->chunk_size < r->context_len) r->chunk_size = r->chunk_size / chunk_unit_ * chunk_unit_;
    r->planned_reuse_blocks = 0;
  }
  // Generation rows next: the capacity scheduler guaranteed their block.
  for (Request* r : batch) {
    if (!r->in_generation()) continue;
    if (!kv_.has_sequence(r->id)) kv_.add_sequence(r->id);
    kv_.add_tokens(r->id, r->context_pos + 1);  // its drafts come last
  }
  // Context chunks: each may take what is free minus the minimal progress (one chunk unit)
  // of the context requests after it, so an early chunk never starves a later one.
  std::vector<int32_t> min_need_after(batch.size() + 1, 0);
  for (size_t i = batch.size(); i-- > 0;) {
    const Request* r = batch[i];
    int32_t need = 0;
    if (!r->in_generation()) {
      const int32_t min_chunk = std::min(r->chunk_size, chunk_unit_);
      need = kv_.blocks_needed(r->id, r->context_pos + min_chunk);
    }
    min_need_after[i] = min_need_after[i + 1] + need;
  }
  for (size_t i = 0; i < batch.size(); ++i) {
    Request* r = batch[i];
    if (r->in_generation()) continue;
    if (!kv_.has_sequence(r->id)) kv_.add_sequence(r->id);
    const int32_t available = kv_.num_free_blocks() - min_need_after[i + 1];
    const int32_t fit = (kv_.num_blocks_of(r->id) + std::max(available, 0)) * kv_.tokens_per_block() -
                        r->context_pos;
    if (r->chunk_size > fit) r->chunk_size = fit / chunk_unit_ * chunk_unit_;  // shrink, whole units
    if (r->chunk_size > 0) kv_.add_tokens(r->id, r->context_pos + r->chunk_size);
  }
  // Draft tokens last: what is still free, so they never take a block a context chunk
  // needed (under the no-evict policy a request's drafts lie within its reservation).
  for (Request* r : batch) {
    if (!r->in_generation() || r->chunk_size <= 1) continue;
    const int32_t fit = (kv_.num_blocks_of(r->id) + kv_.num_free_blocks()) * kv_.tokens_per_block() - r->context_pos;
    r->chunk_size = std::max(1, std::min(r->chunk_size, fit));
    kv_.add_tokens(r->id, r->context_pos + r->chunk_size);
  }
  batch.erase(std::remove_if(batch.begin(), batch.end(), [](const Request* r) { return r->chunk_size == 0; }),
              batch.end());
}

void KvCacheResourceManager::free(Request& r) {
  if (kv_.has_sequence(r.id)) kv_.remove_sequence(r.id);
}

void ResourceManager::prepare(std::vector<Request*>& batch) {
  for (auto& m : managers_) m->prepare(batch);
}

void ResourceManager::free(Request& request) {
  for (auto it = managers_.rbegin(); it != managers_.rend(); ++it) (*it)->free(request);
}

}  // namespace pyengine
