#include "batch_manager/scheduler.h"

#include <algorithm>
#include <string>

namespace pyengine {

KvCacheManager::ReuseProbe probe_reuse(const Request& r, const KvCacheManager& kv) {
  if (!kv.reuse_enabled() || !r.reuse_prefix || kv.has_sequence(r.id) || r.in_generation()) return {};
  return kv.probe_reuse(r.block_keys, r.tokens, r.cache_root, r.max_reusable_blocks(kv.tokens_per_block()));
}

CapacityScheduler::CapacityScheduler(CapacitySchedulerPolicy policy, int32_t max_num_sequences,
                                     bool enable_chunked_context, QueuePolicy queue_policy)
    : policy_(policy),
      max_num_sequences_(max_num_sequences),
      enable_chunked_context_(enable_chunked_context),
      queue_policy_(queue_policy) {
  if (max_num_sequences <= 0)
    throw std::invalid_argument("max_num_sequences must be positive, got " +
                                std::to_string(max_num_sequences));
}

int32_t CapacityScheduler::step_blocks_needed(const Request& r, const KvCacheManager& kv) const {
  if (r.in_generation()) return kv.blocks_needed(r.id, r.context_pos + 1);
  const KvCacheManager::ReuseProbe reuse = probe_reuse(r, kv);
  const int32_t start = std::max(r.context_pos, reuse.blocks * kv.tokens_per_block());
  const int32_t rest = r.context_len - start;
  const int32_t target = start + (enable_chunked_context_ ? std::min(rest, kv.tokens_per_block()) : rest);
  return kv.blocks_needed(r.id, target) - reuse.in_use;
}

int32_t CapacityScheduler::step_blocks_needed(const Request& r, const KvCacheManager& kv, Ledger& ledger,
                                              bool keep) const {
  if (r.in_generation()) return kv.blocks_needed(r.id, r.context_pos + 1);
  std::vector<BlockId> chain;
  if (kv.reuse_enabled() && r.reuse_prefix && !kv.has_sequence(r.id))
    chain = kv.reuse_chain(r.block_keys, r.tokens, r.cache_root, r.max_reusable_blocks(kv.tokens_per_block()));
  // Shared: held by a request that is not being paused (the rest come out of the free pool).
  std::vector<BlockId> shared;
  for (BlockId b : chain) {
    auto it = ledger.released.find(b);
    if (kv.ref_count(b) - (it == ledger.released.end() ? 0 : it->second) > 0) shared.push_back(b);
  }
  const int32_t start = std::max(r.context_pos, static_cast<int32_t>(chain.size()) * kv.tokens_per_block());
  const int32_t rest = r.context_len - start;
  const int32_t target = start + (enable_chunked_context_ ? std::min(rest, kv.tokens_per_block()) : rest);
  if (keep) ledger.relied.insert(shared.begin(), shared.end());
  return kv.blocks_needed(r.id, target) - static_cast<int32_t>(shared.size());
}

int32_t CapacityScheduler::blocks_freed_by_pausing(const Request& victim, const KvCacheManager& kv,
                                                   Ledger& ledger) {
  if (!kv.has_sequence(victim.id)) return 0;
  int32_t freed = 0;
  for (BlockId b : kv.block_table(victim.id))
    if (++ledger.released[b] == kv.ref_count(b) && !ledger.relied.count(b)) ++freed;
  return freed;
}

int32_t CapacityScheduler::completion_blocks_needed(const Request& r, const KvCacheManager& kv) const {
  return kv.blocks_needed(r.id, r.tokens_at_completion()) - probe_reuse(r, kv).in_use;
}

CapacitySchedule CapacityScheduler::schedule(const std::vector<Request*>& active,
                                             const std::deque<Request*>& waiting,
                                             const KvCacheManager& kv) const {
  switch (policy_) {
    case CapacitySchedulerPolicy::kGuaranteedNoEvict:
      return schedule_no_evict(active, waiting, kv, /*admit=*/true);
    case CapacitySchedulerPolicy::kStaticBatch:
      return schedule_no_evict(active, waiting, kv, /*admit=*/active.empty());
    case CapacitySchedulerPolicy::kMaxUtilization:
      return schedule_max_utilization(active, waiting, kv);
  }
  throw std::logic_error("unknown capacity scheduler policy");
}

CapacitySchedule CapacityScheduler::schedule_no_evict(const std::vector<Request*>& active,
                                                      const std::deque<Request*>& waiting,
                                                      const KvCacheManager& kv, bool admit) const {
  CapacitySchedule out;
  out.fitting = active;
  // Blocks already promised to running requests are not available to newcomers.
  int64_t available = kv.num_free_blocks();
  for (const Request* r : active) available -= completion_blocks_needed(*r, kv);
  if (!admit) return out;
  for (Request* r : waiting) {
    if (static_cast<int32_t>(out.fitting.size()) >= max_num_sequences_) break;
    const int32_t need = completion_blocks_needed(*r, kv);
    if (need > available) break;  // FCFS: nobody overtakes the head of the queue
    available -= need;
    out.fitting.push_back(r);
    out.admitted.push_back(r);
  }
  return out;
}

CapacitySchedule CapacityScheduler::schedule_max_utilization(const std::vector<Request*>& active,
                                                             const std::deque<Request*>& waiting,
                                                             const KvCacheManager& kv) const {
  CapacitySchedule out;
  std::vector<Request*> kept = active;
  if (queue_policy_ == QueuePolicy::kPriority)  // the back of `kept` is paused first
    std::stable_sort(kept.begin(), kept.end(), [](const Request* a, const Request* b) { return a->priority > b->priority; });
  int64_t available = kv.num_free_blocks();
  // A cached block shared by a kept request and a paused one must not count twice (as
  // shared, and as freed by the pause): prepare() would run out of blocks for generation.
  Ledger ledger;
  size_t i = 0;
  while (i < kept.size()) {
    int32_t need = step_blocks_needed(*kept[i], kv, ledger, /*keep=*/false);
    // Pause the most recently started requests until this one can make progress.
    while (need > available && kept.size() - 1 > i) {
      Request* victim = kept.back();
      kept.pop_back();
      available += blocks_freed_by_pausing(*victim, kv, ledger);
      out.paused.push_back(victim);
      need = step_blocks_needed(*kept[i], kv, ledger, false);  // it may have shared the victim's blocks
    }
    if (need > available) {  // it is the most recent one left: pause it
      available += blocks_freed_by_pausing(*kept[i], kv, ledger);
      out.paused.push_back(kept[i]);
      kept.erase(kept.begin() + static_cast<std::ptrdiff_t>(i));
      continue;
    }
    step_blocks_needed(*kept[i], kv, ledger, /*keep=*/true);
    available -= need;
    ++i;
  }
  out.fitting = kept;
  // Admit only when nobody was paused this step, so a paused request is not re-admitted
  // (and paused again) in the same step.
  if (out.paused.empty()) {
    for (Request* r : waiting) {
      if (static_cast<int32_t>(out.fitting.size()) >= max_num_sequences_) break;
      const int32_t need = step_blocks_needed(*r, kv, ledger, false);
      if (need > available) break;
      step_blocks_needed(*r, kv, ledger, true);
      available -= need;
      out.fitting.push_back(r);
      out.admitted.push_back(r);
    }
  }
  return out;
}

}  // namespace pyengine
