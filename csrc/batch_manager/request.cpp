#include "batch_manager/request.h"

#include <algorithm>

#include "kv_cache/kv_cache_manager.h"

namespace pyengine {

Request::Request(RequestId id_, std::vector<TokenId> prompt, int32_t max_new_tokens_, TokenId end_id_,
                 std::vector<TokenId> stop_token_ids_, int32_t min_new_tokens_, double arrival_time_)
    : id(id_),
      tokens(std::move(prompt)),
      prompt_len(static_cast<int32_t>(tokens.size())),
      max_new_tokens(max_new_tokens_),
      min_new_tokens(min_new_tokens_),
      end_id(end_id_),
      stop_token_ids(std::move(stop_token_ids_)),
      context_len(static_cast<int32_t>(tokens.size())),
      arrival_time(arrival_time_) {}

void Request::update_block_keys(int32_t tokens_per_block) {
  const size_t full = tokens.size() / static_cast<size_t>(tokens_per_block);
  while (block_keys.size() < full) {
    const uint64_t parent = block_keys.empty() ? cache_root : block_keys.back();
    block_keys.push_back(KvCacheManager::block_key(
        parent, tokens.data() + block_keys.size() * static_cast<size_t>(tokens_per_block), tokens_per_block));
  }
}

void Request::reset_for_recompute() {
  state = RequestState::kWaiting;
  context_len = num_tokens();
  context_pos = 0;
  chunk_size = 0;
  seq_slot = -1;
  start_order = -1;
  num_cached_blocks = 0;
  planned_reuse_blocks = 0;
  clear_drafts();
  ++num_pauses;
}

bool Request::append_token(TokenId token, double now) {
  tokens.push_back(token);
  if (first_token_time < 0) first_token_time = now;
  const bool may_stop = num_generated() >= min_new_tokens;
  if (may_stop && end_id >= 0 && token == end_id) {
    stop_token = token;
    finish(FinishReason::kEndId, now);
  } else if (may_stop && std::find(stop_token_ids.begin(), stop_token_ids.end(), token) !=
                             stop_token_ids.end()) {
    stop_token = token;
    finish(FinishReason::kStopToken, now);
  } else if (num_generated() >= max_new_tokens) {
    finish(FinishReason::kLength, now);
  }
  return is_finished();
}

void Request::finish(FinishReason reason, double now) {
  state = RequestState::kFinished;
  finish_reason = reason;
  finish_time = now;
}

}  // namespace pyengine
