// A seeded random walk of 10,000+ operations (add, step with random tokens, abort) over
// the batch manager, checking the pools' invariants after every step: every block free,
// cached or owned; reference counts equal owning tables; no sequence slot held by a
// finished request; and everything back at the end.
#include <algorithm>
#include <random>
#include <string>

#include "pyengine/batch_manager.h"
#include "test_harness.h"

using namespace pyengine;

namespace {

// Everything rollback() must restore, as one comparable string.
std::string observable_state(const BatchManager& bm) {
  std::string out = "waiting:";
  for (RequestId id : bm.waiting_ids()) out += " " + std::to_string(id);
  out += " | active:";
  for (RequestId id : bm.active_ids()) {
    const RequestInfo r = bm.request_info(id);
    out += " " + std::to_string(id) + "(s" + std::to_string(static_cast<int>(r.state)) + " p" +
           std::to_string(r.num_computed_tokens) + " l" + std::to_string(r.context_len) + " slot" +
           std::to_string(r.seq_slot) + " pauses" + std::to_string(r.num_pauses) + " reused" +
           std::to_string(r.num_reused_tokens) + " t" + std::to_string(r.first_scheduled_time) + " blocks";
    if (r.num_blocks > 0)
      for (BlockId b : bm.block_table(id)) out += "," + std::to_string(b);
    out += ")";
  }
  out += " | free " + std::to_string(bm.num_free_blocks()) + " slots " +
         std::to_string(bm.num_free_seq_slots()) + " reused " + std::to_string(bm.total_reused_tokens());
  return out;
}

void walk(CapacitySchedulerPolicy policy, QueuePolicy queue, bool chunked, uint32_t seed) {
  BatchManagerConfig c;
  c.max_batch_size = 6;
  c.max_num_tokens = 48;
  c.max_seq_len = 64;
  c.tokens_per_block = 4;
  c.num_blocks = 40;
  c.enable_block_reuse = true;
  c.enable_chunked_context = chunked;
  c.policy = policy;
  c.queue_policy = queue;
  c.vocab_size = 50;
  BatchManager bm(c);
  std::mt19937 rng(seed);
  auto uni = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  // A few shared prefixes so that blocks are reused, evicted and shared.
  std::vector<std::vector<TokenId>> prefixes(4);
  for (auto& p : prefixes)
    for (int i = 0; i < 24; ++i) p.push_back(uni(0, 49));
  std::vector<RequestId> live;
  RequestId next_id = 0;
  int ops = 0, steps = 0;
  bool abort_pending = false;
  while (ops < 10000) {
    const int op = uni(0, 9);
    if (op < 3) {  // add
      std::vector<TokenId> prompt;
      const auto& base = prefixes[uni(0, 3)];
      prompt.assign(base.begin(), base.begin() + uni(1, 24));
      for (int i = uni(0, 12); i > 0; --i) prompt.push_back(uni(0, 49));
      const int max_new = uni(1, 64 - static_cast<int>(prompt.size()) > 24 ? 24 : 64 - static_cast<int>(prompt.size()));
      try {
        bm.add_request(next_id, prompt.data(), static_cast<int32_t>(prompt.size()), max_new, /*end_id=*/3,
                       {}, 0, ops, static_cast<float>(uni(0, 3)) / 3.0f, uni(0, 5) == 0 ? 11 : 0);
        live.push_back(next_id);
      } catch (const std::invalid_argument&) {  // too long for this configuration: rejected whole
        CHECK(!bm.contains(next_id));
      }
      ++next_id;
    } else if (op < 4 && !live.empty()) {  // abort
      abort_pending |= bm.abort_request(live[uni(0, static_cast<int>(live.size()) - 1)]);
    } else {  // step
      if (!abort_pending && uni(0, 4) == 0) {  // a failed forward: schedule, then roll back
        // (aborts and pauses are committed by schedule() whatever happens next, so compare
        // without them)
        const std::string before = observable_state(bm);
        const int32_t reusable = bm.num_reusable_blocks();
        bm.schedule(ops);
        const bool paused = !bm.events().paused.empty();
        CHECK(bm.rollback());
        CHECK(!bm.rollback());
        if (!paused) {
          CHECK_EQ(observable_state(bm), before);
          CHECK(bm.num_reusable_blocks() <= reusable);  // evictions stay evicted
        }
        for (RequestId id : bm.events().paused) CHECK(bm.request_info(id).seq_slot < 0);
        bm.check_invariants();
      }
      const ForwardMetadata& m = bm.schedule(ops);
      abort_pending = false;
      for (int s = 0; s < m.num_seqs; ++s)
        CHECK(bm.request_info(m.request_ids[s]).seq_slot == m.seq_slots[s]);
      std::vector<TokenId> tokens(m.num_logits);
      for (auto& t : tokens) t = uni(0, 49);  // 3 is the end id: some finish early
      bm.update(tokens.data(), m.num_logits, ops);
      bm.free_finished();
      bm.check_invariants();
      ++steps;
    }
    ++ops;
    std::vector<RequestId> still;
    for (RequestId id : live)
      if (bm.contains(id)) still.push_back(id);
    live.swap(still);
  }
  for (int guard = 0; bm.has_unfinished() && guard < 100000; ++guard) {
    const ForwardMetadata& m = bm.schedule(0);
    std::vector<TokenId> tokens(m.num_logits, 5);
    bm.update(tokens.data(), m.num_logits, 0);
    bm.free_finished();
    bm.check_invariants();
  }
  CHECK(!bm.has_unfinished());
  CHECK_EQ(bm.num_free_blocks(), c.num_blocks);
  bm.check_all_seq_slots_free();
  CHECK(bm.num_reuse_hits() > 0);
  CHECK(steps > 1000);
}

// Max-utilization with more seats than batch rows (the overlap loop's pool), a small pool and
// shared prefixes: requests admitted but not batched yet plan to share cached blocks of
// requests that the same pass pauses. Such a block was counted twice (shared, and freed by
// the pause), and prepare() ran out of blocks for a generation row (OutOfKvBlocksError;
// found by the engine's soak, tests/test_soak.py).
void crowded_walk(uint32_t seed, int32_t num_blocks) {
  BatchManagerConfig c;
  c.max_batch_size = 4;
  c.max_num_tokens = 24;
  c.max_seq_len = 48;
  c.tokens_per_block = 4;
  c.num_blocks = num_blocks;
  c.num_seq_slots = 8;
  c.enable_block_reuse = true;
  c.policy = CapacitySchedulerPolicy::kMaxUtilization;
  c.queue_policy = QueuePolicy::kPriority;
  c.vocab_size = 50;
  BatchManager bm(c);
  std::mt19937 rng(seed);
  auto uni = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  std::vector<std::vector<TokenId>> prefixes(3);
  for (auto& p : prefixes)
    for (int i = 0; i < 24; ++i) p.push_back(uni(0, 49));
  RequestId next_id = 0;
  for (int ops = 0; ops < 3000; ++ops) {
    if (uni(0, 9) < 4 && bm.num_requests() < 12) {
      std::vector<TokenId> prompt;
      const auto& base = prefixes[uni(0, 2)];
      prompt.assign(base.begin(), base.begin() + uni(1, 24));
      for (int i = uni(0, 8); i > 0; --i) prompt.push_back(uni(0, 49));
      const int room = std::min(48, num_blocks * 4) - static_cast<int>(prompt.size());
      bm.add_request(next_id++, prompt.data(), static_cast<int32_t>(prompt.size()), uni(1, std::min(16, room)), -1,
                     {}, 0, ops, static_cast<float>(uni(0, 3)) / 3.0f, 0);
    } else {
      const ForwardMetadata& m = bm.schedule(ops);
      std::vector<TokenId> tokens(m.num_logits);
      for (auto& t : tokens) t = uni(0, 49);
      bm.update(tokens.data(), m.num_logits, ops);
      bm.free_finished();
      bm.check_invariants();
    }
  }
  CHECK(bm.num_reuse_hits() > 0);
}

}  // namespace

TEST(random_walk_max_utilization_more_seats_than_rows) {
  crowded_walk(11, 24);
  crowded_walk(13, 24);
  crowded_walk(19, 12);
  crowded_walk(37, 16);
}

TEST(random_walk_no_evict_fcfs) { walk(CapacitySchedulerPolicy::kGuaranteedNoEvict, QueuePolicy::kFcfs, true, 1); }
TEST(random_walk_max_utilization_priority) {
  walk(CapacitySchedulerPolicy::kMaxUtilization, QueuePolicy::kPriority, true, 2);
}
TEST(random_walk_max_utilization_unchunked) {
  walk(CapacitySchedulerPolicy::kMaxUtilization, QueuePolicy::kFcfs, false, 3);
}
TEST(random_walk_static_batch) { walk(CapacitySchedulerPolicy::kStaticBatch, QueuePolicy::kFcfs, true, 4); }

TEST_MAIN()
