// Time-budgeted steps: BatchManager::schedule(now, budget_ms) cuts context chunks so that the
// batch's predicted time (the step cost model) fits the budget. The test plays the model
// (every logits row samples token 1) and asserts the exact chunks of every step.
#include <cmath>
#include <limits>

#include "pyengine/batch_manager.h"
#include "test_harness.h"

using namespace pyengine;

namespace {

using Ids = std::vector<RequestId>;
using Chunks = std::vector<int32_t>;

struct Step {
  Ids ids;
  Chunks chunks;
};

void add(BatchManager& bm, RequestId id, int32_t prompt_len, int32_t max_new) {
  std::vector<TokenId> prompt(prompt_len, 7);
  bm.add_request(id, prompt.data(), prompt_len, max_new, /*end_id=*/-1, {}, 0, 0.0);
}

// One step under `budget_ms` (<= 0: no budget): the batch's ids and chunk sizes.
Step step(BatchManager& bm, double budget_ms) {
  const ForwardMetadata& m = budget_ms > 0 ? bm.schedule(0.0, budget_ms) : bm.schedule(0.0);
  Step s;
  s.ids.assign(m.request_ids.begin(), m.request_ids.begin() + m.num_seqs);
  for (int i = 0; i < m.num_seqs; ++i) s.chunks.push_back(m.query_start_loc[i + 1] - m.query_start_loc[i]);
  std::vector<TokenId> tokens(m.num_logits, 1);
  bm.update(tokens.data(), m.num_logits, 0.0);
  bm.free_finished();
  bm.check_invariants();
  return s;
}

BatchManagerConfig config() {
  BatchManagerConfig c;
  c.max_batch_size = 4;
  c.max_num_tokens = 64;
  c.max_seq_len = 128;
  c.tokens_per_block = 8;
  c.num_blocks = 64;
  c.enable_chunked_context = true;
  return c;
}

StepCostModel model(double fixed, double per_seq, double per_token, double per_kpair) {
  StepCostModel m;
  m.fixed_ms = fixed;
  m.per_seq_ms = per_seq;
  m.per_token_ms = per_token;
  m.per_kpair_ms = per_kpair;
  return m;
}

}  // namespace

TEST(a_token_priced_budget_cuts_chunks_in_whole_blocks) {
  BatchManager bm(config());
  bm.set_step_cost_model(model(1.0, 0.0, 0.1, 0.0));  // 4 ms: at most 30 tokens
  add(bm, 0, 40, 2);
  add(bm, 1, 5, 2);
  // 24 tokens of request 0 (32 would cost 4.2 ms), then request 1's whole 5 (3.9 ms in all).
  Step s = step(bm, 4.0);
  CHECK_EQ(s.ids, (Ids{0, 1}));
  CHECK_EQ(s.chunks, (Chunks{24, 5}));
  // Request 1 generates (its row first); request 0's last 16 tokens fit beside it (2.7 ms).
  s = step(bm, 4.0);
  CHECK_EQ(s.ids, (Ids{1, 0}));
  CHECK_EQ(s.chunks, (Chunks{1, 16}));
  // Request 1 had its two tokens: request 0 generates alone.
  s = step(bm, 4.0);
  CHECK_EQ(s.ids, Ids{0});
  CHECK_EQ(s.chunks, Chunks{1});
}

TEST(the_attention_term_prices_a_chunk_by_where_it_starts) {
  BatchManager bm(config());
  bm.set_step_cost_model(model(0.0, 0.0, 0.0, 1.0));  // 2 ms: 2,000 attention pairs
  add(bm, 0, 100, 1);
  // From 0: 56 tokens are 1,596 pairs, 64 would be 2,080. From 56: 24 tokens are
  // 24 * 56 + 300 = 1,644 pairs, 32 would be 2,320. From 80 the last 20: 1,810 pairs.
  CHECK_EQ(step(bm, 2.0).chunks, Chunks{56});
  CHECK_EQ(step(bm, 2.0).chunks, Chunks{24});
  CHECK_EQ(step(bm, 2.0).chunks, Chunks{20});
  CHECK_EQ(bm.has_unfinished(), false);
}

TEST(generation_rows_keep_priority_and_an_empty_step_still_progresses) {
  BatchManager bm(config());
  bm.set_step_cost_model(model(10.0, 0.0, 0.0, 0.0));  // every batch costs more than the budget
  add(bm, 0, 20, 2);
  add(bm, 1, 5, 1);
  // Nothing fits 1 ms: the first context request gets one block, the next waits.
  Step s = step(bm, 1.0);
  CHECK_EQ(s.ids, Ids{0});
  CHECK_EQ(s.chunks, Chunks{8});
  CHECK_EQ(step(bm, 1.0).chunks, Chunks{8});
  CHECK_EQ(step(bm, 1.0).chunks, Chunks{4});
  // Request 0 generates whatever its row costs; request 1 waits while the row fills the budget.
  s = step(bm, 1.0);
  CHECK_EQ(s.ids, Ids{0});
  CHECK_EQ(s.chunks, Chunks{1});
  // Request 0 has finished: request 1 runs alone (its whole 5-token prompt is one chunk).
  s = step(bm, 1.0);
  CHECK_EQ(s.ids, Ids{1});
  CHECK_EQ(s.chunks, Chunks{5});
  CHECK_EQ(bm.has_unfinished(), false);
}

TEST(without_chunking_a_prompt_that_does_not_fit_lets_a_shorter_one_pass) {
  BatchManagerConfig c = config();
  c.enable_chunked_context = false;
  BatchManager bm(c);
  bm.set_step_cost_model(model(0.0, 0.0, 0.1, 0.0));  // 3 ms: 30 tokens
  add(bm, 0, 10, 4);
  add(bm, 1, 40, 1);
  add(bm, 2, 12, 1);
  Step s = step(bm, 3.0);  // 10 + 12 tokens; 40 would not fit
  CHECK_EQ(s.ids, (Ids{0, 2}));
  CHECK_EQ(s.chunks, (Chunks{10, 12}));
  // Two generation rows (0.2 ms) leave 28 tokens: request 1's 40 still waits.
  s = step(bm, 3.0);
  CHECK_EQ(s.ids, (Ids{0}));  // request 2 finished after its one token
  CHECK_EQ(s.chunks, Chunks{1});
  // Once nothing else runs, the progress rule gives request 1 its whole prompt.
  step(bm, 3.0);
  step(bm, 3.0);  // request 0's last token
  s = step(bm, 3.0);
  CHECK_EQ(s.ids, Ids{1});
  CHECK_EQ(s.chunks, Chunks{40});
}

TEST(the_budget_is_per_call_and_without_one_nothing_changes) {
  BatchManager a(config()), b(config());
  b.set_step_cost_model(model(1.0, 0.0, 0.1, 0.0));
  for (BatchManager* bm : {&a, &b}) add(*bm, 0, 60, 1);
  // No budget: the 64-token limit alone (60 tokens at once), whatever the model says.
  CHECK_EQ(step(a, 0.0).chunks, Chunks{60});
  CHECK_EQ(step(b, 3.0).chunks, Chunks{16});  // 1 + 1.6 ms
  CHECK_EQ(step(b, 5.0).chunks, Chunks{40});  // 1 + 4.0 ms
  CHECK_EQ(step(b, 0.0).chunks, Chunks{4});
}

TEST(bad_budgets_and_cost_models_are_refused_and_change_nothing) {
  BatchManager bm(config());
  add(bm, 0, 16, 1);
  for (double bad : {0.0, -1.0, std::nan(""), std::numeric_limits<double>::infinity()}) {
    bool threw = false;
    try {
      bm.schedule(0.0, bad);
    } catch (const std::invalid_argument& e) {
      threw = std::string(e.what()).find("time budget") != std::string::npos;
    }
    CHECK(threw);
  }
  CHECK_EQ(bm.num_waiting(), 1);
  bm.set_step_cost_model(model(1.0, 2.0, 3.0, 4.0));
  bool threw = false;
  try {
    bm.set_step_cost_model(model(1.0, -2.0, 3.0, 4.0));
  } catch (const std::invalid_argument& e) {
    threw = std::string(e.what()).find("per_seq_ms") != std::string::npos;
  }
  CHECK(threw);
  CHECK_EQ(bm.step_cost_model().per_seq_ms, 2.0);
}

TEST_MAIN()
