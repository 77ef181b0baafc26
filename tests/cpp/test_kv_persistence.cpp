// KV cache persistence, the bookkeeping half: exporting the reusable prefix-cache blocks and
// importing them into another pool, with exact block ids.
#include <numeric>

#include "kv_cache/kv_cache_manager.h"
#include "pyengine/batch_manager.h"
#include "test_harness.h"

using namespace pyengine;

namespace {

const int kTpb = 4;

std::vector<TokenId> iota_tokens(int n, TokenId first = 1) {
  std::vector<TokenId> t(n);
  std::iota(t.begin(), t.end(), first);
  return t;
}

std::vector<uint64_t> keys_of(const std::vector<TokenId>& tokens, uint64_t root = 0) {
  std::vector<uint64_t> keys;
  for (size_t b = 0; (b + 1) * kTpb <= tokens.size(); ++b)
    keys.push_back(KvCacheManager::block_key(keys.empty() ? root : keys.back(), tokens.data() + b * kTpb, kTpb));
  return keys;
}

// Runs a sequence over `tokens` in `kv`, caches its full blocks and frees it.
std::vector<BlockId> cache_sequence(KvCacheManager& kv, RequestId id, const std::vector<TokenId>& tokens) {
  kv.add_sequence(id);
  kv.add_tokens(id, static_cast<int32_t>(tokens.size()));
  const std::vector<BlockId> table = kv.block_table(id);
  const std::vector<uint64_t> keys = keys_of(tokens);
  kv.cache_blocks(id, keys, tokens, 0, static_cast<int32_t>(keys.size()));
  kv.remove_sequence(id);
  return table;
}

std::vector<BlockId> blocks_of(const std::vector<CachedBlockRecord>& records) {
  std::vector<BlockId> out;
  for (const auto& r : records) out.push_back(r.block);
  return out;
}

std::vector<uint64_t> keys_in(const std::vector<CachedBlockRecord>& records) {
  std::vector<uint64_t> out;
  for (const auto& r : records) out.push_back(r.key);
  return out;
}

// The records of a 12-token sequence cached in a fresh 8-block pool: blocks 0, 1, 2.
std::vector<CachedBlockRecord> three_records() {
  KvCacheManager kv(8, kTpb, true);
  cache_sequence(kv, 1, iota_tokens(12));
  return kv.export_cached();
}

}  // namespace

TEST(export_lists_free_cached_blocks_most_recent_first_with_chain_and_tokens) {
  KvCacheManager kv(8, kTpb, true);
  CHECK_EQ(cache_sequence(kv, 1, iota_tokens(12)), (std::vector<BlockId>{0, 1, 2}));
  const std::vector<CachedBlockRecord> r = kv.export_cached();
  // the sequence's blocks were queued tail first, so its head is the most recently freed
  CHECK_EQ(blocks_of(r), (std::vector<BlockId>{0, 1, 2}));
  const std::vector<uint64_t> keys = keys_of(iota_tokens(12));
  CHECK_EQ(keys_in(r), keys);
  CHECK_EQ(r[0].parent, uint64_t{0});
  CHECK_EQ(r[1].parent, keys[0]);
  CHECK_EQ(r[2].parent, keys[1]);
  CHECK_EQ(r[1].tokens, (std::vector<TokenId>{5, 6, 7, 8}));

  // a block a sequence holds is left out
  kv.add_sequence_with_reuse(2, keys, iota_tokens(12), 0, 1);
  CHECK_EQ(blocks_of(kv.export_cached()), (std::vector<BlockId>{1, 2}));
  kv.remove_sequence(2);
  CHECK_EQ(blocks_of(kv.export_cached()), (std::vector<BlockId>{0, 1, 2}));
}

TEST(import_into_an_empty_pool_restores_the_chain_and_the_recency_order) {
  KvCacheManager kv(8, kTpb, true);
  CHECK_EQ(kv.import_cached(three_records()), (std::vector<BlockId>{0, 1, 2}));
  kv.check_invariants();
  CHECK_EQ(kv.num_reusable_blocks(), 3);
  CHECK_EQ(kv.num_free_blocks(), 8);
  CHECK_EQ(blocks_of(kv.export_cached()), (std::vector<BlockId>{0, 1, 2}));
  const std::vector<TokenId> t = iota_tokens(12);
  CHECK_EQ(kv.reuse_chain(keys_of(t), t, 0, 3), (std::vector<BlockId>{0, 1, 2}));
  // the imported blocks are at the queue's tail: a new sequence takes block 3 first
  kv.add_sequence(7);
  kv.add_tokens(7, 4);
  CHECK_EQ(kv.block_table(7), (std::vector<BlockId>{3}));
}

TEST(import_uses_only_blocks_without_cached_content_and_never_evicts) {
  KvCacheManager kv(8, kTpb, true);
  CHECK_EQ(cache_sequence(kv, 1, iota_tokens(8, 100)), (std::vector<BlockId>{0, 1}));
  CHECK_EQ(kv.import_cached(three_records()), (std::vector<BlockId>{2, 3, 4}));
  kv.check_invariants();
  CHECK_EQ(kv.num_reusable_blocks(), 5);
  // the imported blocks are the most recent; the earlier content follows
  CHECK_EQ(blocks_of(kv.export_cached()), (std::vector<BlockId>{2, 3, 4, 0, 1}));
}

TEST(import_into_a_smaller_pool_keeps_the_most_recent_records_that_fit) {
  KvCacheManager kv(2, kTpb, true);
  CHECK_EQ(kv.import_cached(three_records()), (std::vector<BlockId>{0, 1, -1}));
  kv.check_invariants();
  const std::vector<TokenId> t = iota_tokens(12);
  CHECK_EQ(kv.reuse_chain(keys_of(t), t, 0, 3), (std::vector<BlockId>{0, 1}));
}

TEST(a_record_whose_parent_record_was_skipped_is_skipped) {
  std::vector<CachedBlockRecord> r = three_records();
  std::swap(r[0], r[1]);  // the second block before its parent
  KvCacheManager kv(8, kTpb, true);
  // the second is skipped (its parent record comes later), and so is the third (its parent
  // is the skipped second)
  CHECK_EQ(kv.import_cached(r), (std::vector<BlockId>{-1, 0, -1}));
  kv.check_invariants();
  CHECK_EQ(kv.num_reusable_blocks(), 1);
  // its parent already cached in the pool: placed
  CHECK_EQ(kv.import_cached({three_records()[1]}), (std::vector<BlockId>{1}));
  kv.check_invariants();
}

TEST(records_already_cached_are_skipped) {
  KvCacheManager kv(8, kTpb, true);
  cache_sequence(kv, 1, iota_tokens(12));
  CHECK_EQ(kv.import_cached(three_records()), (std::vector<BlockId>{-1, -1, -1}));
  kv.check_invariants();
  CHECK_EQ(kv.num_reusable_blocks(), 3);
}

TEST(a_malformed_record_changes_nothing) {
  KvCacheManager kv(8, kTpb, true);
  cache_sequence(kv, 1, iota_tokens(8, 100));
  const std::vector<CachedBlockRecord> before = kv.export_cached();

  std::vector<CachedBlockRecord> r = three_records();
  r[2].tokens.pop_back();
  CHECK_THROWS(kv.import_cached(r), std::invalid_argument, "import_cached: record 2 has 3 tokens, expected 4");
  r = three_records();
  r[1].tokens[0] = 999;  // the key no longer matches
  CHECK_THROWS(kv.import_cached(r), std::invalid_argument,
               "import_cached: record 1: its key is not the chained key of its parent and tokens");
  r = three_records();
  r.push_back(r[0]);
  CHECK_THROWS(kv.import_cached(r), std::invalid_argument, "import_cached: record 3 repeats an earlier record's key");

  kv.check_invariants();
  CHECK_EQ(blocks_of(kv.export_cached()), blocks_of(before));
  CHECK_EQ(kv.num_reusable_blocks(), 2);

  KvCacheManager off(8, kTpb, false);
  CHECK_THROWS(off.import_cached(three_records()), std::invalid_argument, "prefix reuse is disabled");
}

TEST(batch_manager_round_trip_reuses_the_imported_prefix) {
  BatchManagerConfig c;
  c.max_batch_size = 2;
  c.max_num_tokens = 64;
  c.max_seq_len = 32;
  c.tokens_per_block = kTpb;
  c.num_blocks = 8;
  c.enable_block_reuse = true;
  const std::vector<TokenId> prompt = iota_tokens(9);
  auto run = [&](BatchManager& bm, RequestId id) {
    bm.add_request(id, prompt.data(), 9, 2, -1, {}, 0, 0.0);
    for (int step = 0; bm.has_unfinished(); ++step) {
      const ForwardMetadata& m = bm.schedule(step);
      std::vector<TokenId> t(m.num_logits, 99);
      bm.update(t.data(), m.num_logits, step);
      bm.free_finished();
      bm.check_invariants();
    }
  };
  BatchManager first(c);
  run(first, 1);
  const std::vector<CachedBlockRecord> r = first.export_cached_blocks();
  CHECK_EQ(blocks_of(r), (std::vector<BlockId>{0, 1}));

  BatchManager second(c);
  CHECK_EQ(second.import_cached_blocks(r), (std::vector<BlockId>{0, 1}));
  CHECK_EQ(second.num_reusable_blocks(), 2);
  run(second, 1);
  CHECK_EQ(second.total_reused_tokens(), int64_t{8});

  // only while idle
  second.add_request(2, prompt.data(), 9, 2, -1, {}, 0, 0.0);
  CHECK_THROWS(second.export_cached_blocks(), std::logic_error, "the engine must be idle");
  CHECK_THROWS(second.import_cached_blocks(r), std::logic_error, "the engine must be idle");
}

TEST_MAIN()
