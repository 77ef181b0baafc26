// The paged KV cache's bookkeeping: a pool of fixed-size blocks and one block table per
// sequence. It owns block ids only; the K/V memory itself is a tensor the model holds.
#pragma once

#include <deque>
#include <unordered_map>
#include <vector>

#include "pyengine/types.h"

namespace pyengine {

class KvCacheManager {
 public:
  // Throws std::invalid_argument for non-positive sizes.
  KvCacheManager(int32_t num_blocks, int32_t tokens_per_block);

  int32_t num_blocks() const { return num_blocks_; }
  int32_t tokens_per_block() const { return tokens_per_block_; }
  int32_t num_free_blocks() const { return static_cast<int32_t>(free_blocks_.size()); }
  int32_t num_used_blocks() const { return num_blocks_ - num_free_blocks(); }
  int32_t num_sequences() const { return static_cast<int32_t>(tables_.size()); }

  // Blocks that hold `num_tokens` tokens.
  int32_t blocks_for_tokens(int32_t num_tokens) const {
    return (num_tokens + tokens_per_block_ - 1) / tokens_per_block_;
  }

  // Starts an empty block table. Throws std::logic_error if the sequence already has one.
  void add_sequence(RequestId id);
  bool has_sequence(RequestId id) const { return tables_.count(id) != 0; }
  // Blocks the sequence holds (0 when it has no table).
  int32_t num_blocks_of(RequestId id) const;
  // Additional blocks the sequence needs to hold `num_tokens` tokens (0 if it holds enough).
  int32_t blocks_needed(RequestId id, int32_t num_tokens) const;
  // Grows the table to hold `num_tokens` tokens, taking blocks from the head of the free
  // list. Throws OutOfKvBlocksError (and changes nothing) if too few are free.
  void add_tokens(RequestId id, int32_t num_tokens);
  // Returns the sequence's blocks to the tail of the free list, in table order.
  // Throws std::logic_error for an unknown sequence.
  void remove_sequence(RequestId id);

  const std::vector<BlockId>& block_table(RequestId id) const;

  // Every block is either free or in exactly one table; throws std::logic_error if not.
  void check_invariants() const;

 private:
  int32_t num_blocks_;
  int32_t tokens_per_block_;
  std::deque<BlockId> free_blocks_;  // FIFO
  std::unordered_map<RequestId, std::vector<BlockId>> tables_;
};

}  // namespace pyengine
