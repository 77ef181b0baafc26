// A request's state inside the batch manager. Private to the library: callers read a
// RequestInfo snapshot (pyengine/batch_manager.h).
#pragma once

#include <vector>

#include "batch_manager/draft_length.h"
#include "pyengine/types.h"

namespace pyengine {

struct Request {
  Request(RequestId id, std::vector<TokenId> prompt, int32_t max_new_tokens, TokenId end_id,
          std::vector<TokenId> stop_token_ids, int32_t min_new_tokens, double arrival_time);

  RequestId id;
  std::vector<TokenId> tokens;  // the prompt followed by every generated token
  int32_t prompt_len;
  int32_t max_new_tokens;
  int32_t min_new_tokens;       // stop tokens are ignored before this many tokens
  TokenId end_id;               // < 0: none
  std::vector<TokenId> stop_token_ids;

  RequestState state = RequestState::kWaiting;
  // Tokens to compute in the current context phase: the prompt, or after a pause the prompt
  // with the generated tokens appended (the request is recomputed).
  int32_t context_len;
  int32_t context_pos = 0;      // tokens whose KV is in the cache
  int32_t chunk_size = 0;       // tokens this request computes in the current step
  SlotId seq_slot = -1;
  int32_t num_pauses = 0;
  int64_t start_order = -1;     // admission counter value; larger = started more recently
  bool abort_requested = false;
  float priority = 0.5f;        // higher runs first under the PRIORITY queue policy

  // Prefix reuse: the chained key of every full block of `tokens` (kept up to date as
  // tokens are appended), the chain's root (from the cache salt), how many of the
  // request's blocks are registered in the cache, and how many it took from the cache.
  uint64_t cache_root = 0;
  bool reuse_prefix = true;          // false: never takes blocks from the cache
  std::vector<uint64_t> block_keys;
  int32_t num_cached_blocks = 0;
  int32_t planned_reuse_blocks = 0;  // set by the micro-batch scheduler for a new table
  int32_t num_reused_tokens = 0;

  // Speculative decoding: the draft tokens this step verifies after the last sampled token
  // (never part of `tokens`: their KV is rewound unless the forward accepts them), whether
  // the caller set them (set_draft_tokens) rather than the n-gram proposer, the most a step
  // may carry (0: the request does not speculate), and the counts over its life.
  std::vector<TokenId> draft_tokens;
  bool drafts_from_caller = false;
  int32_t max_draft_tokens = 0;
  int64_t num_draft_tokens = 0;
  int64_t num_accepted_draft_tokens = 0;
  // Prompt lookup backs off from a request whose drafts keep failing: after 2 verifications
  // in a row that accepted nothing it proposes nothing for 1, then 2, 4, ... 64 steps, until
  // a verification accepts a draft again.
  int32_t draft_misses = 0;
  int32_t draft_pause = 0;
  // Adaptive draft length (BatchManagerConfig::adaptive_draft_length): the acceptance rate
  // estimated from the request's verifications, and whether its next proposal is a probe (at
  // least one draft) after a pause the estimate decided.
  DraftAcceptance draft_acceptance;
  bool draft_probe = false;

  double arrival_time;
  double first_scheduled_time = -1.0;
  double first_token_time = -1.0;
  double finish_time = -1.0;
  FinishReason finish_reason = FinishReason::kNone;
  TokenId stop_token = -1;      // the token that stopped it, for kEndId / kStopToken

  int32_t num_generated() const { return static_cast<int32_t>(tokens.size()) - prompt_len; }
  int32_t num_tokens() const { return static_cast<int32_t>(tokens.size()); }
  bool is_finished() const { return state == RequestState::kFinished; }
  bool in_context() const { return state == RequestState::kContextInProgress; }
  bool in_generation() const { return state == RequestState::kGenerationInProgress; }
  int32_t context_remaining() const { return context_len - context_pos; }
  // Tokens whose KV the request holds when it completes (TensorRT-LLM's reservation).
  int32_t tokens_at_completion() const { return prompt_len + max_new_tokens; }
  // Blocks of its current context it may take from the cache: never the block holding the
  // last context token, which is recomputed so the request gets its logits.
  int32_t max_reusable_blocks(int32_t tokens_per_block) const { return (context_len - 1) / tokens_per_block; }
  // Extends block_keys to every full block of `tokens`.
  void update_block_keys(int32_t tokens_per_block);

  // Puts a started request back to kWaiting to be recomputed from scratch with its
  // generated tokens appended to the prompt. Resources must have been freed already.
  void reset_for_recompute();
  void clear_drafts() {
    draft_tokens.clear();
    drafts_from_caller = false;
  }
  // Appends a sampled token and applies the stop conditions; returns true if it finished.
  bool append_token(TokenId token, double now);
  void finish(FinishReason reason, double now);
};

}  // namespace pyengine
