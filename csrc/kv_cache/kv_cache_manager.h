// The paged KV cache's bookkeeping: a pool of fixed-size blocks and one block table per
// sequence. It owns block ids only; the K/V memory itself is a tensor the model holds.
//
// Prefix reuse (enable_reuse): a full block of computed KV is registered under a chained
// key — a hash of its tokens and the key of the block before it (the first block's parent
// is the request's salt). A later sequence whose prompt starts with the same blocks takes
// them (reference counted) instead of recomputing them. A block whose count drops to zero
// keeps its key and sits in the free queue, still reusable, until it is allocated for
// something else (least recently freed first; a sequence's blocks are queued tail first,
// so its tail is evicted before its head). A key match is confirmed by comparing the
// tokens and the parent key: a hash collision is never trusted.
#pragma once

#include <unordered_map>
#include <vector>

#include "pyengine/types.h"

namespace pyengine {

class KvCacheManager {
 public:
  // Throws std::invalid_argument for non-positive sizes.
  KvCacheManager(int32_t num_blocks, int32_t tokens_per_block, bool enable_reuse = false);

  int32_t num_blocks() const { return num_blocks_; }
  int32_t tokens_per_block() const { return tokens_per_block_; }
  bool reuse_enabled() const { return enable_reuse_; }
  // Blocks no sequence holds (some of them still reusable).
  int32_t num_free_blocks() const { return free_size_; }
  int32_t num_used_blocks() const { return num_blocks_ - free_size_; }
  // Free blocks that still hold a reusable key.
  int32_t num_reusable_blocks() const { return num_reusable_free_; }
  int32_t num_sequences() const { return static_cast<int32_t>(tables_.size()); }

  int32_t blocks_for_tokens(int32_t num_tokens) const {
    return (num_tokens + tokens_per_block_ - 1) / tokens_per_block_;
  }

  // The chained key of a full block.
  static uint64_t block_key(uint64_t parent_key, const TokenId* tokens, int32_t num_tokens);
  // The root parent key of a chain for a salt (0: no salt).
  static uint64_t root_key(uint64_t salt);

  // Starts an empty block table. Throws std::logic_error if the sequence already has one.
  void add_sequence(RequestId id);
  // Starts a table with the longest chain of cached blocks matching `keys` (at most
  // `max_blocks`; `tokens` confirm each match). Returns the number of blocks taken.
  int32_t add_sequence_with_reuse(RequestId id, const std::vector<uint64_t>& keys,
                                  const std::vector<TokenId>& tokens, uint64_t root, int32_t max_blocks);
  // How many leading blocks add_sequence_with_reuse would take now, and how many of those
  // are held by other sequences (the rest come out of the free count).
  struct ReuseProbe {
    int32_t blocks = 0;
    int32_t in_use = 0;
  };
  ReuseProbe probe_reuse(const std::vector<uint64_t>& keys, const std::vector<TokenId>& tokens, uint64_t root,
                         int32_t max_blocks) const;
  // The blocks of that chain, in order (what add_sequence_with_reuse would take now).
  std::vector<BlockId> reuse_chain(const std::vector<uint64_t>& keys, const std::vector<TokenId>& tokens,
                                   uint64_t root, int32_t max_blocks) const;
  // Registers the sequence's full blocks [0, num_full_blocks) under `keys` (those not yet
  // registered; a key already cached for another block is left as it is).
  void cache_blocks(RequestId id, const std::vector<uint64_t>& keys, const std::vector<TokenId>& tokens,
                    uint64_t root, int32_t num_full_blocks);
  bool is_cached(uint64_t key) const { return cached_.count(key) != 0; }

  // Persistence. export_cached(): the free blocks that hold a reusable key, most recently
  // freed first (the free queue read from its tail); blocks a sequence holds are left out.
  std::vector<CachedBlockRecord> export_cached() const;
  // import_cached(): puts records (most recent first) into free blocks that hold no
  // reusable content, as reusable cached blocks; it never evicts cached content. Returns the
  // block each record got, -1 for a record skipped: its key is cached already, no such free
  // block is left, or its parent is another record's key that was not placed (a chain is
  // never loaded without its head). The placed blocks go to the free queue's tail, the first
  // record last (it is the most recently used). Throws std::invalid_argument, changing
  // nothing, if reuse is disabled, a record has the wrong number of tokens, a key is not
  // block_key(parent, tokens), or two records share a key; std::logic_error inside a
  // transaction. `block` of the input records is ignored.
  std::vector<BlockId> import_cached(const std::vector<CachedBlockRecord>& records);

  bool has_sequence(RequestId id) const { return tables_.count(id) != 0; }
  int32_t num_blocks_of(RequestId id) const;
  // Blocks only this sequence holds: what removing it returns to the free queue.
  int32_t num_exclusive_blocks_of(RequestId id) const;
  // Additional blocks the sequence needs to hold `num_tokens` tokens (0 if it holds enough).
  int32_t blocks_needed(RequestId id, int32_t num_tokens) const;
  // Grows the table to hold `num_tokens` tokens with blocks from the head of the free
  // queue (evicting their keys). Throws OutOfKvBlocksError (changing nothing) if too few.
  void add_tokens(RequestId id, int32_t num_tokens);
  // Shrinks the table to the blocks that hold `num_tokens` tokens (speculative decoding:
  // the KV of rejected draft tokens is rewound). A dropped block whose count reaches zero
  // goes back to the head of the free queue, where allocation takes it first: its content
  // is garbage and it never carries a key (blocks are only keyed up to the verified
  // tokens). Throws std::logic_error for an unknown sequence.
  void truncate(RequestId id, int32_t num_tokens);
  // Drops the sequence's table; blocks whose count reaches zero join the free queue's
  // tail, tail block first. Throws std::logic_error for an unknown sequence.
  void remove_sequence(RequestId id);

  const std::vector<BlockId>& block_table(RequestId id) const;
  int32_t ref_count(BlockId block) const { return blocks_.at(block).ref; }

  // Every block is free (ref 0, in the queue once) or owned (ref = number of tables
  // holding it); cached keys point at blocks that carry them. Throws std::logic_error.
  void check_invariants() const;

  // Transactions: between begin() and commit()/rollback() every change is journaled;
  // rollback() restores ownership, reference counts, tables and the free queue's order
  // exactly. A block evicted from the cache stays evicted (its memory may have been
  // written since), so rollback never resurrects stale KV. begin() commits any open one.
  void begin();
  void commit();
  void rollback();

 private:
  struct Block {
    int32_t ref = 0;
    bool in_free = false;
    BlockId prev = -1, next = -1;   // free queue links
    bool cached = false;
    uint64_t key = 0, parent = 0;
    std::vector<TokenId> tokens;    // the block's tokens, to confirm a key match
  };
  void push_free_back(BlockId b);
  void push_free_front(BlockId b);
  void unlink_free(BlockId b);
  BlockId pop_free_front();
  BlockId lookup(uint64_t key, uint64_t parent, const TokenId* tokens) const;

  enum class Op : int8_t { kUnlinkFree, kPushFreeBack, kPushFreeFront, kRef, kTableCreate, kTablePush, kTablePop,
                          kTableErase };
  struct Undo {
    Op op;
    BlockId block;
    int32_t a, b;  // kUnlinkFree: prev, next; kRef: old count
    RequestId id;
    std::vector<BlockId> table;  // kTableErase
  };
  void log(Undo u) {
    if (journaling_) journal_.push_back(std::move(u));
  }
  void relink_free(BlockId b, BlockId prev, BlockId next);
  void set_ref(BlockId b, int32_t ref);

  bool journaling_ = false;
  std::vector<Undo> journal_;

  int32_t num_blocks_;
  int32_t tokens_per_block_;
  bool enable_reuse_;
  std::vector<Block> blocks_;
  BlockId free_head_ = -1, free_tail_ = -1;
  int32_t free_size_ = 0;
  int32_t num_reusable_free_ = 0;
  std::unordered_map<uint64_t, BlockId> cached_;
  std::unordered_map<RequestId, std::vector<BlockId>> tables_;
};

}  // namespace pyengine
