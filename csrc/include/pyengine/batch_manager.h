// The batch manager: owns the requests, the waiting queue, the schedulers and the resource
// managers (sequence slots, KV cache blocks), and turns each step's decisions into the
// forward's metadata buffers. This is the C++ core's public face: an embedding application
// includes this header (and pyengine/types.h, which it includes); the classes behind it are
// private to the library.
//
// One step, driven by the caller (docs/architecture.md, "One step"):
//   schedule(now)      drop aborted requests, admit/pause (capacity), pick the batch
//                      (micro-batch), prepare resources (sequence slots, then KV), fill the
//                      metadata.
//   ... the caller runs the forward and samples one token per logits row ...
//   update(tokens, now) append tokens, apply stop conditions, record this step's outputs.
//   free_finished()    retire finished requests: KV, then sequence slot (reverse order). The
//                      caller releases its own per-slot state (sampler) before calling it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "pyengine/step_cost.h"
#include "pyengine/types.h"

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
  // Speculative decoding (docs/speculative_decoding.md): a generating request carries up to
  // num_speculative_tokens draft tokens a step (0: off), verified by the same forward. With
  // ngram_drafts, schedule() proposes them by prompt lookup (the tokens that followed the
  // last prompt_lookup_max .. prompt_lookup_min tokens' most recent earlier occurrence);
  // with model_drafts, schedule() gives every generating request its draft limit of placeholder
  // drafts, which a draft model run between schedule() and the forward replaces
  // (set_scheduled_draft_tokens); otherwise the caller sets them (set_draft_tokens).
  int32_t num_speculative_tokens = 0;
  bool ngram_drafts = false;
  bool model_drafts = false;
  int32_t prompt_lookup_min = 2;
  int32_t prompt_lookup_max = 4;
  // Adaptive draft length: schedule() gives a generating request the draft count k, up to its
  // limit, that maximizes the tokens a step yields per unit of its cost,
  // (1 + a + ... + a^k) / (1 + k c): a is the request's acceptance rate so far (decayed
  // counts of its verifications, from a prior of 0.6), c the cost of a draft token relative
  // to the request's share of a plain decode step with B generating requests,
  // c = rho B / (1 + (B - 1) rho) + delta, rho = draft_row_cost (one more query row relative
  // to a one-row decode step), delta = draft_propose_cost (proposing one draft: a draft
  // model's forward, same unit). When k = 0 is best the request proposes nothing for 8 steps,
  // then probes with one draft. Drafts set by the caller are used as given.
  bool adaptive_draft_length = false;
  double draft_row_cost = 0.0;
  double draft_propose_cost = 0.0;
};

// The forward's inputs for one step, in preallocated buffers (sequences: generation rows
// first, then context chunks). Sizes: token arrays max_num_tokens, sequence arrays
// max_batch_size (+1 for query_start_loc), block_tables max_batch_size x max_blocks_per_seq,
// logits arrays max(max_num_tokens, max_batch_size).
// A generation sequence computes its last sampled token and then its draft tokens, if any
// (speculative decoding); every one of those rows is a logits row, logits_offsets 0, 1, ...
// A context chunk that ends its context has one logits row (its last token, offset 0).
struct ForwardMetadata {
  int32_t num_tokens = 0;
  int32_t num_seqs = 0;
  int32_t num_generation_seqs = 0;
  int32_t num_logits = 0;            // rows that produce a token this step
  int32_t num_draft_tokens = 0;      // draft tokens among the generation rows (speculative decoding)
  int32_t max_blocks_per_seq = 0;
  std::vector<int32_t> input_ids, positions, slot_mapping;   // per token
  std::vector<int32_t> query_start_loc, seq_lens, seq_slots; // per sequence
  std::vector<int64_t> request_ids;                          // per sequence
  std::vector<int32_t> block_tables;                         // per sequence, padded rows
  std::vector<int32_t> logits_indices, logits_slots;         // per logits row
  std::vector<int64_t> logits_request_ids;                   // per logits row
  std::vector<int32_t> logits_offsets;  // per logits row: its index among its sequence's rows
};

// What a step changed, for the caller's outputs.
struct StepEvents {
  std::vector<RequestId> aborted;        // dropped by schedule() (their resources are free)
  std::vector<SlotId> aborted_slots;     // the sequence slots they held (-1 if none)
  std::vector<RequestId> paused;         // paused by schedule(), to be recomputed
  std::vector<SlotId> paused_slots;      // the sequence slots they held
  std::vector<RequestId> assigned;       // given a sequence slot by this schedule()
  std::vector<SlotId> assigned_slots;    // the sequence slots they were given
  // update(): one entry per token produced, with the logits row it came from, in batch order
  // (a request that verified draft tokens produces its accepted ones and the token after
  // them, in order, `finished` set on its last; rows of requests the caller ended after
  // scheduling them produce no entry).
  std::vector<RequestId> output_request_ids;
  std::vector<int32_t> logits_rows;
  std::vector<TokenId> tokens;
  std::vector<uint8_t> finished;
  std::vector<int32_t> finish_reasons;   // FinishReason values
};

// A read-only snapshot of one request, copied out by BatchManager::request_info().
// Times are the `now` the caller passed to the call that set them; -1 means not yet.
struct RequestInfo {
  RequestId id = 0;
  RequestState state = RequestState::kWaiting;
  SlotId seq_slot = -1;               // its sequence slot, -1 while it holds none
  int32_t prompt_len = 0;
  int32_t num_generated = 0;          // tokens generated so far (kept across pauses)
  // Tokens its current context phase computes: the prompt, or after a pause the prompt and
  // the tokens generated before it (a paused request is recomputed).
  int32_t context_len = 0;
  int32_t num_computed_tokens = 0;    // tokens of the context whose KV is in the cache
  int32_t num_blocks = 0;             // KV blocks in its block table (0 while it holds none)
  int32_t num_pauses = 0;             // times it was paused to be recomputed
  int32_t num_reused_tokens = 0;      // context tokens taken from the prefix cache, over all starts
  double arrival_time = 0.0;          // add_request()
  double first_scheduled_time = -1.0; // the first schedule() that put it in a batch
  double first_token_time = -1.0;     // the update() that gave its first token
  double finish_time = -1.0;
  FinishReason finish_reason = FinishReason::kNone;
  TokenId stop_token = -1;            // the token that stopped it (kEndId, kStopToken), else -1
  int64_t num_draft_tokens = 0;       // speculative decoding: draft tokens verified so far
  int64_t num_accepted_draft_tokens = 0;  // ... and accepted
};

// Not thread-safe: one thread drives a BatchManager. A function whose comment names no
// exception throws none (beyond std::bad_alloc).
class BatchManager {
 public:
  // Allocates the pools and the metadata buffers. Throws std::invalid_argument for a
  // non-positive max_batch_size, max_num_tokens, max_seq_len, tokens_per_block or
  // num_blocks, or (with chunked context) max_num_tokens below tokens_per_block.
  explicit BatchManager(const BatchManagerConfig& config);
  ~BatchManager();
  BatchManager(const BatchManager&) = delete;
  BatchManager& operator=(const BatchManager&) = delete;
  // Moves the whole state (no buffer moves: references to metadata() stay valid). A
  // moved-from BatchManager may only be destroyed or assigned to.
  BatchManager(BatchManager&&) noexcept;
  BatchManager& operator=(BatchManager&&) noexcept;

  // Queues a request. Throws std::invalid_argument (and changes nothing) for a duplicate id,
  // an empty prompt, a token id outside the vocabulary, max_new_tokens < 1,
  // min_new_tokens outside [0, max_new_tokens], prompt + max_new_tokens above max_seq_len,
  // or a request that could never fit the KV pool or the token budget.
  // `priority`: higher first under the PRIORITY queue policy. `cache_salt`: isolates the
  // request's prefix-cache chain (0: shared). `reuse_prefix` false: the request never takes
  // blocks from the prefix cache (every prompt position is computed, e.g. for prompt
  // logprobs); its own full blocks are still cached for others.
  void add_request(RequestId id, const TokenId* prompt, int32_t prompt_len, int32_t max_new_tokens,
                   TokenId end_id, const std::vector<TokenId>& stop_token_ids, int32_t min_new_tokens,
                   double now, float priority = 0.5f, uint64_t cache_salt = 0, bool reuse_prefix = true);
  // Speculative decoding: the most draft tokens a step of this request may carry (0: it
  // never speculates; add_request sets config().num_speculative_tokens). Throws
  // std::invalid_argument for n < 0 or above num_speculative_tokens; returns false if the id
  // is unknown.
  bool set_max_draft_tokens(RequestId id, int32_t n);
  // Draft tokens for the request's next step, instead of the n-gram proposer's (a draft
  // model's, a test's). Kept until a schedule() puts the request in a batch; at most
  // max_draft_tokens of them are used, and never more than the request may still generate
  // less one. Throws std::invalid_argument (changing nothing) for a token id outside the
  // vocabulary; returns false if the request is unknown or not generating.
  bool set_draft_tokens(RequestId id, const TokenId* tokens, int32_t n);
  // The drafts of the batch schedule() just returned, replacing its placeholders
  // (config().model_drafts): `n` == metadata().num_draft_tokens tokens, each generation
  // sequence's in batch order. Writes them into the metadata's input_ids too; call it before
  // the forward reads them, and before update(), which accepts drafts against them. Throws
  // std::invalid_argument (changing nothing) for another count or a token id outside the
  // vocabulary.
  void set_scheduled_draft_tokens(const TokenId* tokens, int32_t n);
  // Marks a request to be dropped at the next schedule(). Returns false if the id is
  // unknown (never added, or already finished and retired).
  bool abort_request(RequestId id);
  // Removes a request that is still queued and holds nothing (undoing an add_request at
  // once, without an output). Returns false if it is unknown or has started.
  bool remove_waiting(RequestId id);

  // Runs the scheduling half of a step; returns the filled metadata (the same object as
  // metadata()). Throws std::logic_error (changing nothing) if a finished request has not been
  // retired by free_finished() (e.g. one ended by finish_request() while the batch holding it
  // was rolled back), and otherwise only on a broken internal invariant or a failed
  // allocation. Strong guarantee: if it throws, the step is undone as by rollback() -- the
  // aborts it dropped and the pauses it decided stand, and events() lists them (nothing in
  // `assigned`) -- so the caller releases what they held and reports the aborts.
  const ForwardMetadata& schedule(double now);
  // As schedule(now), with a time budget for this step: context chunks are cut so that the
  // batch's time predicted by step_cost_model() stays within `budget_ms` (generation rows
  // keep priority; every step makes progress: see MicroBatchScheduler). Throws
  // std::invalid_argument (changing nothing) for a budget that is not a positive finite
  // number of milliseconds.
  const ForwardMetadata& schedule(double now, double budget_ms);
  // The model that predicts a batch's time for schedule(now, budget_ms). Throws
  // std::invalid_argument (changing nothing) for a coefficient that is negative or not finite.
  void set_step_cost_model(const StepCostModel& model);
  const StepCostModel& step_cost_model() const;
  // `tokens`: one per logits row of the last schedule(). Throws std::invalid_argument if
  // `num_tokens` differs from the batch's logits rows. A request with draft tokens accepts
  // them while each equals the token sampled at the row before it, and gets the token
  // sampled after its last accepted one (stop conditions apply token by token: an end inside
  // the accepted drafts cuts there); the KV of the rejected drafts is rewound (its blocks
  // freed when they empty) and only verified tokens are ever keyed for prefix reuse. The token of a request the caller
  // ended after scheduling it (finish_request, with the overlap loop) is discarded: that row
  // has no output entry, so per-row data (logprobs) goes by events().logits_rows.
  void update(const TokenId* tokens, int32_t num_tokens, double now);
  // Ends a request that is generating, for a reason found by the caller (a stop string):
  // it is retired by the next free_finished() — with the overlap loop, after the batch in
  // flight that holds it is updated. With the overlap loop the schedule may have paused it
  // since its last token: it leaves the waiting queue then. Returns false (changing
  // nothing) if the request is unknown, or neither generating nor paused after generating
  // (an already finished one included).
  bool finish_request(RequestId id, FinishReason reason, double now);
  // Retires the requests finished by the last update(): KV blocks, then sequence slot.
  void free_finished();
  // Undoes the last schedule() (but not the aborts it dropped, which stay dropped, nor the
  // pauses it decided: the failed forward may have written into the blocks they freed, so
  // those requests stay paused and are recomputed): the caller's forward or sampling
  // failed, and the engine must be as before the step -- the other requests in the same
  // states, no other sequence slot or block changed hands. Valid between schedule() and
  // update(); returns false (doing nothing) otherwise.
  bool rollback();
  // Test hook: the next time schedule() reaches `point`, it throws std::runtime_error
  // ("injected fault at <point>"), once. Points, in order: "schedule.aborted" (after dropping
  // the aborted requests), "schedule.capacity" (after the capacity decision), "schedule.paused"
  // (after the pauses), "schedule.admitted", "schedule.prepared" (slots and blocks taken),
  // "schedule.filled" (metadata written). "" disarms. Throws std::invalid_argument for an
  // unknown point.
  void inject_fault(const std::string& point);

  // Returns true while any request is queued, running or finished but not yet retired.
  bool has_unfinished() const;
  // Returns the number of requests known (queued, holding resources, or not yet retired).
  int32_t num_requests() const;
  // Returns the number of queued requests (new, or paused to be recomputed).
  int32_t num_waiting() const;
  // Returns the number of requests holding resources (admitted and not retired).
  int32_t num_active() const;
  // Returns true if the id is known (added, and not yet retired, aborted or removed).
  bool contains(RequestId id) const;
  // Returns the queued requests' ids, front of the queue first.
  std::vector<RequestId> waiting_ids() const;
  // Returns the ids of the requests holding resources, in start order.
  std::vector<RequestId> active_ids() const;
  // Returns a snapshot of the request. Throws std::out_of_range for an unknown id.
  RequestInfo request_info(RequestId id) const;
  // Returns a copy of the request's KV block ids, in token order. Throws std::logic_error
  // if it holds no block table (an unknown, queued or retired request).
  std::vector<BlockId> block_table(RequestId id) const;

  // Returns the total of prefix-cache tokens taken by requests, over all steps.
  int64_t total_reused_tokens() const;
  // Returns how many block tables took any blocks from the prefix cache, over all steps.
  int64_t num_reuse_hits() const;
  // Speculative decoding: draft tokens verified, and accepted, over all steps.
  int64_t total_draft_tokens() const;
  int64_t total_accepted_draft_tokens() const;
  // KV cache persistence (docs/kv_persistence.md). Returns the reusable prefix-cache blocks,
  // most recently used first (block id, key, parent key, tokens). Throws std::logic_error
  // while any request is known (queued, running or not retired).
  std::vector<CachedBlockRecord> export_cached_blocks() const;
  // Puts exported records back into free blocks as reusable prefix-cache blocks, most
  // recent first, as many as fit; returns the block each record got (-1: skipped -- already
  // cached, no room, or its parent record was skipped). The caller copies the K/V data into
  // those blocks. Throws std::logic_error while any request is known; std::invalid_argument
  // (changing nothing) for a malformed record (wrong token count, a key that is not the
  // chained key of its parent and tokens, a repeated key) or with prefix reuse disabled.
  std::vector<BlockId> import_cached_blocks(const std::vector<CachedBlockRecord>& records);
  // Returns the size of the KV pool, in blocks (config().num_blocks).
  int32_t num_blocks() const;
  // Returns the number of KV blocks no request holds (some of them still reusable).
  int32_t num_free_blocks() const;
  // Returns the number of free KV blocks that still hold reusable prefix-cache content.
  int32_t num_reusable_blocks() const;
  // Returns the number of token positions in one KV block (config().tokens_per_block).
  int32_t tokens_per_block() const;
  // Returns the number of sequence slots (config().num_seq_slots, or max_batch_size for 0).
  int32_t num_seq_slots() const;
  // Returns the number of sequence slots no request holds.
  int32_t num_free_seq_slots() const;
  // Shutdown check: throws std::logic_error naming the holders if any sequence slot is held.
  void check_all_seq_slots_free() const;

  // Returns the last schedule()'s forward inputs (buffers allocated once, never reallocated).
  const ForwardMetadata& metadata() const;
  // Returns what the last schedule() and update() changed.
  const StepEvents& events() const;
  // Returns the configuration the manager was built with.
  const BatchManagerConfig& config() const;

  // Checks the pools against the requests; throws std::logic_error if they disagree.
  void check_invariants() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace pyengine
