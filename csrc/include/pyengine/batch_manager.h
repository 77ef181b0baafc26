// The batch manager: owns the requests, the waiting queue, the schedulers and the resource
// managers, and turns each step's decisions into the forward's metadata buffers.
//
// One step, driven by the caller (see DESIGN.md "One step"):
//   schedule(now)      drop aborted requests, admit/pause (capacity), pick the batch
//                      (micro-batch), prepare resources (slots, then KV), fill metadata.
//   ... the caller runs the forward and samples one token per logits row ...
//   update(tokens, now) append tokens, apply stop conditions, record this step's outputs.
//   free_finished()    retire finished requests: KV, then slot (reverse order). The caller
//                      releases its own per-slot state (sampler) before calling it.
#pragma once

#include <deque>
#include <memory>
#include <unordered_map>
#include <vector>

#include "pyengine/kv_cache_manager.h"
#include "pyengine/request.h"
#include "pyengine/resource_manager.h"
#include "pyengine/scheduler.h"
#include "pyengine/seq_slot_manager.h"
#include "pyengine/waiting_queue.h"

namespace pyengine {

struct BatchManagerConfig {
  int32_t max_batch_size = 8;          // sequences in one forward
  int32_t max_num_tokens = 2048;       // tokens in one forward
  int32_t max_seq_len = 2048;          // prompt + generated tokens of one request
  int32_t tokens_per_block = 16;
  int32_t num_blocks = 0;              // KV pool size
  int32_t num_seq_slots = 0;           // 0: max_batch_size
  bool enable_chunked_context = true;
  CapacitySchedulerPolicy policy = CapacitySchedulerPolicy::kGuaranteedNoEvict;
  int32_t vocab_size = 0;              // > 0: prompt token ids are range-checked
  bool enable_block_reuse = false;     // prefix reuse of full KV blocks
  QueuePolicy queue_policy = QueuePolicy::kFcfs;
};

// The forward's inputs for one step, in preallocated buffers (sequences: generation rows
// first, then context chunks). Sizes: token arrays max_num_tokens, sequence arrays
// max_batch_size (+1 for query_start_loc), block_tables max_batch_size x max_blocks_per_seq.
struct ForwardMetadata {
  int32_t num_tokens = 0;
  int32_t num_seqs = 0;
  int32_t num_generation_seqs = 0;
  int32_t num_logits = 0;            // rows that produce a token this step
  int32_t max_blocks_per_seq = 0;
  std::vector<int32_t> input_ids, positions, slot_mapping;   // per token
  std::vector<int32_t> query_start_loc, seq_lens, seq_slots; // per sequence
  std::vector<int64_t> request_ids;                          // per sequence
  std::vector<int32_t> block_tables;                         // per sequence, padded rows
  std::vector<int32_t> logits_indices, logits_slots;         // per logits row
  std::vector<int64_t> logits_request_ids;                   // per logits row
};

// What a step changed, for the caller's outputs.
struct StepEvents {
  std::vector<RequestId> aborted;        // dropped by schedule() (their resources are free)
  std::vector<SlotId> aborted_slots;     // the slots they held (-1 if none)
  std::vector<RequestId> paused;         // paused by schedule(), to be recomputed
  std::vector<SlotId> paused_slots;
  std::vector<RequestId> new_seated;     // got a slot in this schedule()
  std::vector<SlotId> new_seated_slots;
  // update(): one entry per request that produced a token, with the logits row it came from
  // (rows of requests the caller ended after scheduling them produce no entry).
  std::vector<RequestId> output_request_ids;
  std::vector<int32_t> logits_rows;
  std::vector<TokenId> tokens;
  std::vector<uint8_t> finished;
  std::vector<int32_t> finish_reasons;   // FinishReason values
};

class BatchManager {
 public:
  explicit BatchManager(const BatchManagerConfig& config);

  // Queues a request. Throws std::invalid_argument (and changes nothing) for a duplicate id,
  // an empty prompt, a token id outside the vocabulary, max_new_tokens < 1,
  // min_new_tokens outside [0, max_new_tokens], prompt + max_new_tokens above max_seq_len,
  // or a request that could never fit the KV pool or the token budget.
  // `priority`: higher first under the PRIORITY queue policy. `cache_salt`: isolates the
  // request's prefix-cache chain (0: shared).
  void add_request(RequestId id, const TokenId* prompt, int32_t prompt_len, int32_t max_new_tokens,
                   TokenId end_id, const std::vector<TokenId>& stop_token_ids, int32_t min_new_tokens,
                   double now, float priority = 0.5f, uint64_t cache_salt = 0);
  // Marks a request to be dropped at the next schedule(). Returns false if the id is
  // unknown (never added, or already finished and retired).
  bool abort_request(RequestId id);
  // Removes a request that is still queued and holds nothing (undoing an add_request at
  // once, without an output). Returns false if it is unknown or has started.
  bool remove_waiting(RequestId id);

  const ForwardMetadata& schedule(double now);
  // `tokens`: one per logits row of the last schedule(). Throws std::invalid_argument if
  // `num_tokens` differs from the batch's logits rows. The token of a request the caller
  // ended after scheduling it (finish_request, with the overlap loop) is discarded.
  void update(const TokenId* tokens, int32_t num_tokens, double now);
  // Ends a request that is generating, for a reason found by the caller (a stop string):
  // it is retired by the next free_finished() — with the overlap loop, after the batch in
  // flight that holds it is updated. Returns false (changing nothing) if the request is
  // unknown or not generating (an already finished one included).
  bool finish_request(RequestId id, FinishReason reason, double now);
  // Retires the requests finished by the last update(): KV blocks, then slot.
  void free_finished();
  // Undoes the last schedule() (but not the aborts it dropped, which stay dropped): the
  // caller's forward or sampling failed, and the engine must be as before the step —
  // same requests in the same states, no seat or block changed hands. Valid between
  // schedule() and update(); returns false (doing nothing) otherwise.
  bool rollback();

  bool has_unfinished() const { return !requests_.empty(); }
  int32_t num_requests() const { return static_cast<int32_t>(requests_.size()); }
  int32_t num_waiting() const { return static_cast<int32_t>(waiting_.size()); }
  // Prefix reuse totals: tokens taken from the cache, and tables that took any.
  int64_t total_reused_tokens() const { return kv_resource_->total_reused_tokens(); }
  int64_t num_reuse_hits() const { return kv_resource_->num_reuse_hits(); }
  int32_t num_active() const { return static_cast<int32_t>(active_.size()); }
  bool contains(RequestId id) const { return requests_.count(id) != 0; }
  std::vector<RequestId> waiting_ids() const;
  std::vector<RequestId> active_ids() const;
  // Throws std::out_of_range for an unknown id.
  const Request& request(RequestId id) const;

  const ForwardMetadata& metadata() const { return meta_; }
  const StepEvents& events() const { return events_; }
  const BatchManagerConfig& config() const { return config_; }
  const KvCacheManager& kv_cache() const { return kv_; }
  const SeqSlotManager& seq_slots() const { return slots_; }

  // Consistency of the pools against the requests; throws std::logic_error if violated.
  void check_invariants() const;

 private:
  void drop_aborted();
  // Journals schedule()'s changes so that rollback() can undo them.
  struct RequestSnapshot {
    Request* r;
    RequestState state;
    int32_t context_len, context_pos, chunk_size, num_pauses, num_cached_blocks, num_reused_tokens;
    SlotId seq_slot;
    int64_t start_order;
    double first_scheduled_time;
  };
  void snapshot(Request* r);
  void begin_transaction();
  void commit_transaction();
  bool in_transaction_ = false;
  std::vector<RequestSnapshot> snapshots_;
  std::vector<Request*> saved_active_;
  std::deque<Request*> saved_waiting_;
  int64_t saved_start_counter_ = 0;
  int64_t saved_reused_tokens_ = 0, saved_reuse_hits_ = 0;
  void fill_metadata(const std::vector<Request*>& batch);
  void remove_active(Request* r);

  BatchManagerConfig config_;
  KvCacheManager kv_;
  SeqSlotManager slots_;
  CapacityScheduler capacity_;
  MicroBatchScheduler micro_batch_;
  ResourceManager resources_;
  KvCacheResourceManager* kv_resource_ = nullptr;  // owned by resources_

  std::unordered_map<RequestId, std::unique_ptr<Request>> requests_;
  WaitingQueue waiting_;
  std::vector<Request*> active_;     // holding resources, in start order
  std::vector<Request*> batch_;      // the last schedule()'s batch
  std::vector<Request*> finished_;   // finished by the last update(), not yet freed
  int64_t start_counter_ = 0;
  bool abort_pending_ = false;

  ForwardMetadata meta_;
  StepEvents events_;
};

}  // namespace pyengine
