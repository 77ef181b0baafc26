#include "kv_cache/kv_cache_manager.h"
#include "test_harness.h"

using namespace pyengine;

TEST(blocks_come_from_the_head_of_the_free_queue) {
  KvCacheManager kv(8, 4);
  CHECK_EQ(kv.num_free_blocks(), 8);
  kv.add_sequence(1);
  kv.add_tokens(1, 9);  // 9 tokens -> 3 blocks
  CHECK_EQ(kv.block_table(1), (std::vector<BlockId>{0, 1, 2}));
  kv.add_tokens(1, 11);  // still fits in 3 blocks
  CHECK_EQ(kv.block_table(1).size(), size_t{3});
  kv.add_sequence(2);
  kv.add_tokens(2, 5);
  CHECK_EQ(kv.block_table(2), (std::vector<BlockId>{3, 4}));
  CHECK_EQ(kv.num_free_blocks(), 3);
  CHECK_EQ(kv.num_used_blocks(), 5);
  kv.remove_sequence(1);  // 0, 1, 2 go to the tail of the free queue, tail block first
  CHECK_EQ(kv.num_free_blocks(), 6);
  kv.add_sequence(3);
  kv.add_tokens(3, 16);
  CHECK_EQ(kv.block_table(3), (std::vector<BlockId>{5, 6, 7, 2}));
  kv.check_invariants();
  kv.remove_sequence(2);
  kv.remove_sequence(3);
  CHECK_EQ(kv.num_free_blocks(), 8);
  kv.check_invariants();
}

TEST(blocks_needed_counts_only_missing_blocks) {
  KvCacheManager kv(8, 4);
  CHECK_EQ(kv.blocks_needed(7, 9), 3);  // no table yet
  kv.add_sequence(7);
  kv.add_tokens(7, 4);
  CHECK_EQ(kv.blocks_needed(7, 4), 0);
  CHECK_EQ(kv.blocks_needed(7, 5), 1);
  CHECK_EQ(kv.blocks_for_tokens(0), 0);
  CHECK_EQ(kv.blocks_for_tokens(4), 1);
  CHECK_EQ(kv.blocks_for_tokens(5), 2);
  kv.remove_sequence(7);
}

TEST(running_out_of_blocks_changes_nothing) {
  KvCacheManager kv(2, 4);
  kv.add_sequence(1);
  kv.add_tokens(1, 4);
  CHECK_THROWS(kv.add_tokens(1, 12), OutOfKvBlocksError, "needs 2 more KV blocks, 1 free");
  CHECK_EQ(kv.block_table(1).size(), size_t{1});
  CHECK_EQ(kv.num_free_blocks(), 1);
  kv.check_invariants();
}

TEST(bad_arguments_are_named) {
  CHECK_THROWS(KvCacheManager(0, 4), std::invalid_argument, "num_blocks");
  CHECK_THROWS(KvCacheManager(4, 0), std::invalid_argument, "tokens_per_block");
  KvCacheManager kv(2, 4);
  kv.add_sequence(1);
  CHECK_THROWS(kv.add_sequence(1), std::logic_error, "already has a block table");
  CHECK_THROWS(kv.remove_sequence(2), std::logic_error, "request 2 has no block table");
  CHECK_THROWS(kv.add_tokens(2, 1), std::logic_error, "request 2 has no block table");
}

TEST(truncate_returns_tail_blocks_to_the_head_of_the_free_queue) {
  KvCacheManager kv(8, 4);
  kv.add_sequence(1);
  kv.add_tokens(1, 5);  // blocks 0, 1
  kv.begin();
  kv.add_tokens(1, 13);  // + 2, 3 (draft tokens, say)
  CHECK_EQ(kv.block_table(1), (std::vector<BlockId>{0, 1, 2, 3}));
  kv.truncate(1, 6);  // 6 tokens: blocks 0, 1; 3 then 2 go to the head
  CHECK_EQ(kv.block_table(1), (std::vector<BlockId>{0, 1}));
  CHECK_EQ(kv.num_free_blocks(), 6);
  kv.check_invariants();
  kv.rollback();  // undone exactly: the table as at begin(), the queue's order too
  CHECK_EQ(kv.block_table(1), (std::vector<BlockId>{0, 1}));
  kv.check_invariants();
  kv.add_sequence(2);
  kv.add_tokens(2, 9);  // the head of the queue: the same blocks as if nothing had happened
  CHECK_EQ(kv.block_table(2), (std::vector<BlockId>{2, 3, 4}));
  kv.add_tokens(1, 13);
  CHECK_EQ(kv.block_table(1), (std::vector<BlockId>{0, 1, 5, 6}));
  kv.truncate(1, 6);
  kv.add_tokens(2, 13);  // takes 5: truncate put 5, 6 back at the head in allocation order
  CHECK_EQ(kv.block_table(2), (std::vector<BlockId>{2, 3, 4, 5}));
  kv.truncate(2, 0);
  CHECK_EQ(kv.block_table(2).size(), size_t{0});
  CHECK_EQ(kv.num_free_blocks(), 6);
  kv.check_invariants();
  CHECK_THROWS(kv.truncate(9, 1), std::logic_error, "request 9 has no block table");
}

TEST_MAIN()
