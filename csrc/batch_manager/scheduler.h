// Two-level scheduling, as in TensorRT-LLM: the capacity scheduler decides which requests
// may hold resources (admission, pausing); the micro-batch scheduler decides what runs in
// this step's forward and how long each context chunk is.
#pragma once

#include <deque>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "batch_manager/request.h"
#include "batch_manager/waiting_queue.h"
#include "kv_cache/kv_cache_manager.h"
#include "pyengine/step_cost.h"

namespace pyengine {

struct CapacitySchedule {
  std::vector<Request*> fitting;    // may hold resources this step, in start order
  std::vector<Request*> admitted;   // the subset of `fitting` that comes from the queue
  std::vector<Request*> paused;     // to pause: free their resources, requeue at the front
};

class CapacityScheduler {
 public:
  CapacityScheduler(CapacitySchedulerPolicy policy, int32_t max_num_sequences,
                    bool enable_chunked_context, QueuePolicy queue_policy = QueuePolicy::kFcfs);

  // `active`: requests holding resources, in start order. `waiting`: the queue (front first).
  // Under the PRIORITY queue policy, max-utilization pauses the lowest-priority request
  // (the latest started among equals) first.
  CapacitySchedule schedule(const std::vector<Request*>& active, const std::deque<Request*>& waiting,
                            const KvCacheManager& kv) const;

  // Blocks `request` must be able to take from the free pool for its next step to make
  // progress: one more token in generation; the next chunk unit (or, without chunking, the
  // whole rest) in context, after what it can reuse from the cache.
  int32_t step_blocks_needed(const Request& request, const KvCacheManager& kv) const;
  // Blocks still to be taken from the free pool before the request completes (no-evict).
  int32_t completion_blocks_needed(const Request& request, const KvCacheManager& kv) const;

  CapacitySchedulerPolicy policy() const { return policy_; }

 private:
  CapacitySchedule schedule_no_evict(const std::vector<Request*>& active,
                                     const std::deque<Request*>& waiting, const KvCacheManager& kv,
                                     bool admit) const;
  CapacitySchedule schedule_max_utilization(const std::vector<Request*>& active,
                                            const std::deque<Request*>& waiting,
                                            const KvCacheManager& kv) const;
  // Max-utilization's bookkeeping within one pass: the references the pauses decided so far
  // will drop, and the cached blocks held by others that the requests kept so far will
  // share. A block is counted once: as free (its last holder is paused and nobody kept
  // relies on it) or as shared (not taken from the free pool).
  struct Ledger {
    std::unordered_map<BlockId, int32_t> released;
    std::unordered_set<BlockId> relied;
  };
  // step_blocks_needed under the ledger; `keep` records the shared blocks it relies on.
  int32_t step_blocks_needed(const Request& request, const KvCacheManager& kv, Ledger& ledger, bool keep) const;
  // Blocks that pausing `victim` returns to the free pool, given the ledger (which it updates).
  static int32_t blocks_freed_by_pausing(const Request& victim, const KvCacheManager& kv, Ledger& ledger);

  CapacitySchedulerPolicy policy_;
  int32_t max_num_sequences_;
  bool enable_chunked_context_;
  QueuePolicy queue_policy_;
};

// What a request without a block table could take from the prefix cache now.
KvCacheManager::ReuseProbe probe_reuse(const Request& request, const KvCacheManager& kv);

class MicroBatchScheduler {
 public:
  // chunk_unit: every context chunk but a request's last is a multiple of it.
  MicroBatchScheduler(int32_t max_batch_size, int32_t max_num_tokens, bool enable_chunked_context,
                      int32_t chunk_unit);

  // Picks this step's batch from the fitting requests and sets each one's chunk_size:
  // generation requests first (one token each), then context requests in order, chunked to
  // the remaining token budget. A context request that has not started is planned from
  // the end of its reusable prefix (planned_reuse_blocks), and waits a step if its next
  // block is being computed in this batch by a request ahead of it (prefix-aware
  // admission: it reuses the block next step instead of computing it twice).
  // A generation request with draft tokens (speculative decoding) also gets as many of
  // them as fit the token budget (and the time budget) left after every generation row's
  // own token, before any context chunk: chunk_size = 1 + drafts.
  // Returns the batch, generation requests first.
  // With a `budget` (nullptr: none), context chunks are also cut so that the batch's
  // predicted time (budget->model) stays within budget->budget_ms: generation rows keep
  // priority (all of them are scheduled whatever they cost), context chunks fill what time
  // remains, in whole chunk units except a request's last chunk. If the batch would
  // otherwise be empty, the first context request gets one chunk unit (or its whole rest
  // when chunking is off), so every step makes progress.
  std::vector<Request*> schedule(const std::vector<Request*>& fitting, const KvCacheManager& kv,
                                 const StepBudget* budget = nullptr) const;

 private:
  int32_t max_batch_size_;
  int32_t max_num_tokens_;
  bool enable_chunked_context_;
  int32_t chunk_unit_;
};

}  // namespace pyengine
