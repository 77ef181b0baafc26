// Prefix reuse with exact block ids: the KV manager alone, and driven by the batch manager.
#include <numeric>

#include "kv_cache/kv_cache_manager.h"
#include "pyengine/batch_manager.h"
#include "test_harness.h"

using namespace pyengine;

namespace {

std::vector<TokenId> iota_tokens(int n, TokenId first = 1) {
  std::vector<TokenId> t(n);
  std::iota(t.begin(), t.end(), first);
  return t;
}

std::vector<uint64_t> keys_of(const std::vector<TokenId>& tokens, int tpb, uint64_t root) {
  std::vector<uint64_t> keys;
  for (size_t b = 0; (b + 1) * tpb <= tokens.size(); ++b)
    keys.push_back(KvCacheManager::block_key(keys.empty() ? root : keys.back(), tokens.data() + b * tpb, tpb));
  return keys;
}

BatchManagerConfig reuse_config() {
  BatchManagerConfig c;
  c.max_batch_size = 2;
  c.max_num_tokens = 64;
  c.max_seq_len = 32;
  c.tokens_per_block = 4;
  c.num_blocks = 8;
  c.enable_block_reuse = true;
  return c;
}

// Runs one request to completion; returns the positions of its first step's rows.
std::vector<int32_t> run_alone(BatchManager& bm, RequestId id, const std::vector<TokenId>& prompt, int max_new,
                               std::vector<BlockId>* table = nullptr, uint64_t salt = 0) {
  bm.add_request(id, prompt.data(), static_cast<int32_t>(prompt.size()), max_new, -1, {}, 0, 0.0, 0.5f, salt);
  std::vector<int32_t> first_positions;
  for (int step = 0; bm.has_unfinished(); ++step) {
    const ForwardMetadata& m = bm.schedule(step);
    if (step == 0) first_positions.assign(m.positions.begin(), m.positions.begin() + m.num_tokens);
    if (table) *table = bm.block_table(id);
    std::vector<TokenId> t(m.num_logits, 99);
    bm.update(t.data(), m.num_logits, step);
    bm.free_finished();
    bm.check_invariants();
  }
  return first_positions;
}

}  // namespace

TEST(same_prompt_reuses_its_full_blocks_and_recomputes_the_last_token) {
  BatchManager bm(reuse_config());
  const std::vector<TokenId> prompt = iota_tokens(9);
  std::vector<BlockId> table;
  run_alone(bm, 1, prompt, 2, &table);
  CHECK_EQ(table, (std::vector<BlockId>{0, 1, 2}));
  CHECK_EQ(bm.num_free_blocks(), 8);
  CHECK_EQ(bm.num_reusable_blocks(), 2);  // blocks 0 and 1 are full; 2 is not

  std::vector<int32_t> positions = run_alone(bm, 2, prompt, 2, &table);
  CHECK_EQ(table, (std::vector<BlockId>{0, 1, 3}));  // a new block from the head of the queue
  CHECK_EQ(positions, std::vector<int32_t>{8});       // starts at context position 8
  CHECK_EQ(bm.total_reused_tokens(), int64_t{8});
  CHECK_EQ(bm.num_free_blocks(), 8);

  positions = run_alone(bm, 3, iota_tokens(5), 1, &table);  // a 5-token prefix
  CHECK_EQ(table[0], 0);
  CHECK(table.size() == 2 && table[1] != 1);           // only block 0 is reused
  CHECK_EQ(positions, (std::vector<int32_t>{4}));
  CHECK_EQ(bm.num_free_blocks(), 8);
  CHECK_EQ(bm.num_reuse_hits(), int64_t{2});
}

TEST(an_exact_multiple_of_the_block_size_still_recomputes_its_last_block) {
  BatchManager bm(reuse_config());
  run_alone(bm, 1, iota_tokens(8), 1);
  std::vector<BlockId> table;
  std::vector<int32_t> positions = run_alone(bm, 2, iota_tokens(8), 1, &table);
  CHECK_EQ(positions, (std::vector<int32_t>{4, 5, 6, 7}));  // block 1 holds the last token
  CHECK_EQ(table[0], 0);
}

TEST(eviction_is_least_recently_freed_first_and_tail_first) {
  const int tpb = 4;
  KvCacheManager kv(8, tpb, /*enable_reuse=*/true);
  const std::vector<TokenId> x = iota_tokens(8, 100), y = iota_tokens(8, 200);
  const auto kx = keys_of(x, tpb, 0), ky = keys_of(y, tpb, 0);
  kv.add_sequence(1);
  kv.add_tokens(1, 8);  // blocks 0, 1
  kv.cache_blocks(1, kx, x, 0, 2);
  kv.remove_sequence(1);  // queue: 2..7, 1, 0
  kv.add_sequence(2);
  kv.add_tokens(2, 8);  // blocks 2, 3
  kv.cache_blocks(2, ky, y, 0, 2);
  kv.remove_sequence(2);  // queue: 4..7, 1, 0, 3, 2
  CHECK_EQ(kv.num_reusable_blocks(), 4);
  CHECK_EQ(kv.probe_reuse(kx, x, 0, 2).blocks, 2);
  kv.add_sequence(3);
  kv.add_tokens(3, 20);  // 4, 5, 6, 7, then 1: x's tail goes first
  CHECK_EQ(kv.block_table(3), (std::vector<BlockId>{4, 5, 6, 7, 1}));
  CHECK_EQ(kv.probe_reuse(kx, x, 0, 2).blocks, 1);
  CHECK_EQ(kv.probe_reuse(ky, y, 0, 2).blocks, 2);
  kv.add_tokens(3, 28);  // 0, 3
  CHECK_EQ(kv.probe_reuse(kx, x, 0, 2).blocks, 0);
  CHECK_EQ(kv.probe_reuse(ky, y, 0, 2).blocks, 1);
  kv.check_invariants();
  kv.remove_sequence(3);
  CHECK_EQ(kv.num_free_blocks(), 8);
  kv.check_invariants();
}

TEST(shared_blocks_are_reference_counted) {
  const int tpb = 4;
  KvCacheManager kv(8, tpb, true);
  const std::vector<TokenId> x = iota_tokens(12, 1);
  const auto kx = keys_of(x, tpb, 0);
  kv.add_sequence(1);
  kv.add_tokens(1, 12);
  kv.cache_blocks(1, kx, x, 0, 3);
  CHECK_EQ(kv.add_sequence_with_reuse(2, kx, x, 0, 2), 2);
  CHECK_EQ(kv.ref_count(0), 2);
  CHECK_EQ(kv.ref_count(2), 1);
  CHECK_EQ(kv.num_free_blocks(), 5);
  kv.remove_sequence(1);
  CHECK_EQ(kv.ref_count(0), 1);
  CHECK_EQ(kv.num_free_blocks(), 6);  // block 2 is free (and reusable), 0 and 1 still held
  CHECK_EQ(kv.num_reusable_blocks(), 1);
  kv.check_invariants();
  kv.remove_sequence(2);
  CHECK_EQ(kv.num_free_blocks(), 8);
  CHECK_EQ(kv.num_reusable_blocks(), 3);
}

TEST(a_salted_request_never_reuses_an_unsalted_block) {
  BatchManager bm(reuse_config());
  const std::vector<TokenId> prompt = iota_tokens(9);
  run_alone(bm, 1, prompt, 1);
  std::vector<int32_t> positions = run_alone(bm, 2, prompt, 1, nullptr, /*salt=*/77);
  CHECK_EQ(positions.size(), size_t{9});  // computed from scratch
  positions = run_alone(bm, 3, prompt, 1, nullptr, 77);
  CHECK_EQ(positions, std::vector<int32_t>{8});  // the same salt shares
  positions = run_alone(bm, 4, prompt, 1, nullptr, 78);
  CHECK_EQ(positions.size(), size_t{9});
}

TEST(a_hash_collision_is_never_trusted) {
  const int tpb = 4;
  KvCacheManager kv(4, tpb, true);
  const std::vector<TokenId> x = iota_tokens(4, 1), forged = iota_tokens(4, 50);
  const auto kx = keys_of(x, tpb, 0);
  kv.add_sequence(1);
  kv.add_tokens(1, 4);
  kv.cache_blocks(1, kx, x, 0, 1);
  // Other tokens presented under x's key (as a colliding hash would): not a match.
  CHECK_EQ(kv.probe_reuse(kx, forged, 0, 1).blocks, 0);
  CHECK_EQ(kv.add_sequence_with_reuse(2, kx, forged, 0, 1), 0);
  CHECK_EQ(kv.probe_reuse(kx, x, 0, 1).blocks, 1);
  kv.remove_sequence(1);
  kv.remove_sequence(2);
}

TEST_MAIN()
