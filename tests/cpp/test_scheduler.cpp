// Scheduler tests in TensorRT-LLM's style: the test plays the model (every logits row
// samples token 1, never a stop token) and asserts, iteration by iteration, which requests
// run. Reference numbers are those of TensorRT-LLM's capacity/micro-batch scheduler tests.
#include <map>

#include "pyengine/batch_manager.h"
#include "test_harness.h"

using namespace pyengine;

namespace {

struct Trace {
  std::vector<std::vector<RequestId>> scheduled;          // per iteration, batch order
  std::vector<std::vector<int32_t>> chunks;               // per iteration, chunk sizes
  std::vector<std::vector<RequestId>> paused;             // per iteration
  std::map<RequestId, int> finished_at;                   // iteration of the last token
};

void add(BatchManager& bm, RequestId id, int32_t prompt_len, int32_t max_new, float priority = 0.5f,
         TokenId fill = 7) {
  std::vector<TokenId> prompt(prompt_len, fill);
  bm.add_request(id, prompt.data(), prompt_len, max_new, /*end_id=*/-1, {}, 0, 0.0, priority);
}

Trace run(BatchManager& bm, int max_iterations = 1000) {
  Trace t;
  for (int it = 0; bm.has_unfinished() && it < max_iterations; ++it) {
    const ForwardMetadata& m = bm.schedule(it);
    t.scheduled.emplace_back(m.request_ids.begin(), m.request_ids.begin() + m.num_seqs);
    std::vector<int32_t> chunks;
    for (int s = 0; s < m.num_seqs; ++s) chunks.push_back(m.query_start_loc[s + 1] - m.query_start_loc[s]);
    t.chunks.push_back(chunks);
    t.paused.push_back(bm.events().paused);
    std::vector<TokenId> tokens(m.num_logits, 1);
    bm.update(tokens.data(), m.num_logits, it);
    const StepEvents& e = bm.events();
    for (size_t i = 0; i < e.output_request_ids.size(); ++i)
      if (e.finished[i]) t.finished_at[e.output_request_ids[i]] = it;
    bm.free_finished();
    bm.check_invariants();
  }
  return t;
}

BatchManagerConfig trt_config(CapacitySchedulerPolicy policy) {
  BatchManagerConfig c;
  c.max_batch_size = 2;
  c.max_num_tokens = 1000;
  c.max_seq_len = 100;
  c.tokens_per_block = 10;
  c.num_blocks = 10;  // a 100-token cache
  c.enable_chunked_context = false;
  c.policy = policy;
  return c;
}

using Ids = std::vector<RequestId>;

}  // namespace

TEST(no_evict_runs_the_second_request_after_the_first) {
  BatchManager bm(trt_config(CapacitySchedulerPolicy::kGuaranteedNoEvict));
  add(bm, 0, 10, 80);
  add(bm, 1, 10, 80);
  Trace t = run(bm);
  CHECK_EQ(t.scheduled.size(), size_t{160});
  for (int it = 0; it < 80; ++it) CHECK_EQ(t.scheduled[it], Ids{0});
  for (int it = 80; it < 160; ++it) CHECK_EQ(t.scheduled[it], Ids{1});
  CHECK_EQ(t.finished_at[0], 79);
  CHECK_EQ(t.finished_at[1], 159);
  CHECK_EQ(bm.num_free_blocks(), 10);
  CHECK_EQ(bm.num_free_seq_slots(), 2);
}

TEST(max_utilization_pauses_the_latest_and_recomputes_it) {
  BatchManager bm(trt_config(CapacitySchedulerPolicy::kMaxUtilization));
  add(bm, 0, 10, 80);
  add(bm, 1, 10, 80);
  Trace t = run(bm);
  CHECK_EQ(t.scheduled.size(), size_t{119});
  // Both run while 10 blocks hold both: at iteration 40 each holds 50 tokens.
  for (int it = 0; it <= 40; ++it) CHECK_EQ(t.scheduled[it], (Ids{0, 1}));
  // At 41 request 0 needs a 6th block: request 1 (started last) is paused.
  CHECK_EQ(t.paused[41], Ids{1});
  for (int it = 41; it < 80; ++it) CHECK_EQ(t.scheduled[it], Ids{0});
  CHECK_EQ(t.finished_at[0], 79);
  // Request 1 resumes as a 51-token prompt (10 + 41 generated) with 39 tokens to go.
  CHECK_EQ(t.scheduled[80], Ids{1});
  CHECK_EQ(t.chunks[80], std::vector<int32_t>{51});
  for (int it = 81; it < 119; ++it) CHECK_EQ(t.chunks[it], std::vector<int32_t>{1});
  CHECK_EQ(t.finished_at[1], 118);
  for (int it = 0; it < 119; ++it)
    if (it != 41) CHECK(t.paused[it].empty());
  CHECK_EQ(bm.num_free_blocks(), 10);
}

TEST(micro_batch_of_two_runs_four_requests_in_two_waves) {
  BatchManagerConfig c = trt_config(CapacitySchedulerPolicy::kGuaranteedNoEvict);
  c.num_blocks = 100;
  BatchManager bm(c);
  for (RequestId id = 0; id < 4; ++id) add(bm, id, 10, 80);
  Trace t = run(bm);
  CHECK_EQ(t.scheduled.size(), size_t{160});
  for (int it = 0; it < 80; ++it) CHECK_EQ(t.scheduled[it], (Ids{0, 1}));
  for (int it = 80; it < 160; ++it) CHECK_EQ(t.scheduled[it], (Ids{2, 3}));
}

TEST(chunked_context_respects_the_token_budget_in_whole_blocks) {
  BatchManagerConfig c;
  c.max_batch_size = 4;
  c.max_num_tokens = 20;
  c.max_seq_len = 128;
  c.tokens_per_block = 8;
  c.num_blocks = 64;
  c.enable_chunked_context = true;
  BatchManager bm(c);
  add(bm, 0, 37, 3);
  add(bm, 1, 5, 3);
  Trace t = run(bm);
  // Iteration 0: request 0 takes 16 tokens (20 rounded down to whole 8-token blocks); the
  // remaining 4-token budget cannot hold request 1's whole 5-token prompt nor a whole block.
  CHECK_EQ(t.scheduled[0], Ids{0});
  CHECK_EQ(t.chunks[0], std::vector<int32_t>{16});
  CHECK_EQ(t.scheduled[1], Ids{0});
  CHECK_EQ(t.chunks[1], std::vector<int32_t>{16});
  // Iteration 2: the last 5 tokens of request 0, then request 1's whole prompt.
  CHECK_EQ(t.scheduled[2], (Ids{0, 1}));
  CHECK_EQ(t.chunks[2], (std::vector<int32_t>{5, 5}));
  // Then both generate, generation rows first.
  CHECK_EQ(t.scheduled[3], (Ids{0, 1}));
  CHECK_EQ(t.chunks[3], (std::vector<int32_t>{1, 1}));
  CHECK_EQ(t.scheduled.size(), size_t{5});
}

TEST(no_evict_waits_for_blocks_reserved_to_completion) {
  BatchManagerConfig c;
  c.max_batch_size = 4;
  c.max_num_tokens = 64;
  c.max_seq_len = 64;
  c.tokens_per_block = 4;
  c.num_blocks = 6;
  BatchManager bm(c);
  add(bm, 0, 8, 8);  // 16 tokens at completion: 4 blocks reserved
  add(bm, 1, 4, 4);  // 8 tokens: 2 blocks -> fits beside
  add(bm, 2, 4, 4);  // must wait for a finish
  Trace t = run(bm);
  CHECK_EQ(t.scheduled[0], (Ids{0, 1}));
  CHECK_EQ(t.finished_at[1], 3);
  CHECK_EQ(t.scheduled[4], (Ids{0, 2}));
}

TEST(static_batch_admits_only_when_nothing_runs) {
  BatchManagerConfig c = trt_config(CapacitySchedulerPolicy::kStaticBatch);
  c.num_blocks = 100;
  c.max_batch_size = 4;
  BatchManager bm(c);
  add(bm, 0, 10, 80);
  add(bm, 1, 10, 40);
  const ForwardMetadata& m = bm.schedule(0);
  CHECK_EQ(m.num_seqs, 2);  // both start together
  add(bm, 2, 10, 10);       // arrives while they run
  std::vector<TokenId> tok(m.num_logits, 1);
  bm.update(tok.data(), m.num_logits, 0);
  bm.free_finished();
  Trace t = run(bm);  // iterations 1, 2, ... of the same run
  for (int it = 0; it < 39; ++it) CHECK_EQ(t.scheduled[it], (Ids{0, 1}));
  for (int it = 39; it < 79; ++it) CHECK_EQ(t.scheduled[it], Ids{0});  // 1 is done, 2 still waits
  for (int it = 79; it < 89; ++it) CHECK_EQ(t.scheduled[it], Ids{2});
  CHECK_EQ(t.scheduled.size(), size_t{89});
}

TEST(priority_queue_runs_highest_first_fifo_among_equals) {
  BatchManagerConfig c = trt_config(CapacitySchedulerPolicy::kGuaranteedNoEvict);
  c.max_batch_size = 1;
  c.num_blocks = 100;
  c.queue_policy = QueuePolicy::kPriority;
  BatchManager bm(c);
  const float prios[12] = {0.5f, 0.3f, 1.0f, 0.6f, 0.5f, 1.0f, 0.3f, 0.6f, 0.5f, 1.0f, 0.3f, 0.6f};
  for (RequestId id = 0; id < 12; ++id) add(bm, id, 10, 2, prios[id]);
  Trace t = run(bm);
  Ids order;
  for (const Ids& s : t.scheduled)
    if (order.empty() || order.back() != s[0]) order.push_back(s[0]);
  CHECK_EQ(order, (Ids{2, 5, 9, 3, 7, 11, 0, 4, 8, 1, 6, 10}));
}

TEST(max_utilization_pauses_the_lower_priority_request) {
  BatchManagerConfig c = trt_config(CapacitySchedulerPolicy::kMaxUtilization);
  c.queue_policy = QueuePolicy::kPriority;
  BatchManager bm(c);
  add(bm, 0, 10, 80, /*priority=*/1.0f);
  add(bm, 1, 10, 80, /*priority=*/0.3f);
  // Started in the same step; FCFS would pause request 1 (started last) anyway, so make
  // the low-priority request the earlier one to tell the policies apart.
  BatchManager bm2(c);
  add(bm2, 0, 10, 80, 0.3f);
  add(bm2, 1, 10, 80, 1.0f);
  Trace t = run(bm);
  Trace t2 = run(bm2);
  CHECK_EQ(t.paused[41], Ids{1});
  CHECK_EQ(t2.paused[41], Ids{0});  // the lower priority one, though it started first
  for (int it = 41; it < 80; ++it) CHECK_EQ(t2.scheduled[it], Ids{1});
  CHECK_EQ(t2.chunks[80], std::vector<int32_t>{51});
}

TEST(identical_prompts_with_chunks_share_blocks) {
  BatchManagerConfig c;
  c.max_batch_size = 2;
  c.max_num_tokens = 20;
  c.max_seq_len = 64;
  c.tokens_per_block = 10;
  c.num_blocks = 20;
  c.enable_block_reuse = true;
  BatchManager bm(c);
  add(bm, 0, 50, 4);
  add(bm, 1, 50, 4);
  Trace t = run(bm);
  CHECK_EQ(t.scheduled[0], Ids{0});
  CHECK_EQ(t.chunks[0], std::vector<int32_t>{20});
  CHECK_EQ(t.scheduled[1], Ids{0});
  CHECK_EQ(t.chunks[1], std::vector<int32_t>{20});
  // Iteration 2: request 0's last 10 tokens; request 1 reuses the 4 blocks request 0
  // produced and computes only its last block.
  CHECK_EQ(t.scheduled[2], (Ids{0, 1}));
  CHECK_EQ(t.chunks[2], (std::vector<int32_t>{10, 10}));
  CHECK_EQ(bm.total_reused_tokens(), int64_t{40});
  CHECK_EQ(bm.num_reuse_hits(), int64_t{1});
}

TEST(prefix_aware_admission_waits_one_step_instead_of_computing_twice) {
  BatchManagerConfig c;
  c.max_batch_size = 2;
  c.max_num_tokens = 128;
  c.max_seq_len = 64;
  c.tokens_per_block = 10;
  c.num_blocks = 20;
  c.enable_block_reuse = true;
  BatchManager bm(c);
  add(bm, 0, 50, 4);
  add(bm, 1, 50, 4);
  add(bm, 2, 30, 4, 0.5f, /*fill=*/8);  // another prefix: not held back
  Trace t = run(bm);
  CHECK_EQ(t.scheduled[0], (Ids{0}));   // 1 waits for 0's blocks; 2 has no sequence slot yet
  CHECK_EQ(t.scheduled[1], (Ids{0, 1}));
  CHECK_EQ(t.chunks[1], (std::vector<int32_t>{1, 10}));
  CHECK_EQ(bm.total_reused_tokens(), int64_t{40});
}

TEST_MAIN()
