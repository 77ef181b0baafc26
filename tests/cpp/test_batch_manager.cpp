#include "pyengine/batch_manager.h"
#include "test_harness.h"

using namespace pyengine;

namespace {
BatchManagerConfig small_config() {
  BatchManagerConfig c;
  c.max_batch_size = 4;
  c.max_num_tokens = 16;
  c.max_seq_len = 32;
  c.tokens_per_block = 4;
  c.num_blocks = 16;
  c.vocab_size = 100;
  return c;
}
std::vector<int32_t> head(const std::vector<int32_t>& v, int n) { return {v.begin(), v.begin() + n}; }
}  // namespace

TEST(metadata_describes_the_batch_exactly) {
  BatchManager bm(small_config());
  std::vector<TokenId> p0{11, 12, 13, 14, 15, 16}, p1{21, 22, 23};
  bm.add_request(100, p0.data(), 6, 2, -1, {}, 0, 0.0);
  bm.add_request(200, p1.data(), 3, 2, -1, {}, 0, 0.0);
  const ForwardMetadata& m = bm.schedule(1.0);
  CHECK_EQ(m.num_seqs, 2);
  CHECK_EQ(m.num_tokens, 9);
  CHECK_EQ(m.num_logits, 2);
  CHECK_EQ(head(m.input_ids, 9), (std::vector<int32_t>{11, 12, 13, 14, 15, 16, 21, 22, 23}));
  CHECK_EQ(head(m.positions, 9), (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 0, 1, 2}));
  // request 100 got blocks 0, 1; request 200 block 2.
  CHECK_EQ(head(m.slot_mapping, 9), (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 8, 9, 10}));
  CHECK_EQ(head(m.query_start_loc, 3), (std::vector<int32_t>{0, 6, 9}));
  CHECK_EQ(head(m.seq_lens, 2), (std::vector<int32_t>{6, 3}));
  CHECK_EQ(m.block_tables[0], 0);
  CHECK_EQ(m.block_tables[1], 1);
  CHECK_EQ(m.block_tables[m.max_blocks_per_seq], 2);
  CHECK_EQ(head(m.logits_indices, 2), (std::vector<int32_t>{5, 8}));
  CHECK_EQ(head(m.seq_slots, 2), (std::vector<int32_t>{0, 1}));
  CHECK_EQ(bm.events().assigned, (std::vector<RequestId>{100, 200}));

  std::vector<TokenId> sampled{50, 60};
  bm.update(sampled.data(), 2, 2.0);
  CHECK_EQ(bm.events().output_request_ids, (std::vector<RequestId>{100, 200}));
  CHECK_EQ(bm.request_info(100).first_token_time, 2.0);
  CHECK_EQ(bm.request_info(100).first_scheduled_time, 1.0);
  bm.free_finished();

  const ForwardMetadata& g = bm.schedule(3.0);  // both decode: the sampled token at its position
  CHECK_EQ(g.num_tokens, 2);
  CHECK_EQ(g.num_generation_seqs, 2);
  CHECK_EQ(head(g.input_ids, 2), (std::vector<int32_t>{50, 60}));
  CHECK_EQ(head(g.positions, 2), (std::vector<int32_t>{6, 3}));
  CHECK_EQ(head(g.slot_mapping, 2), (std::vector<int32_t>{6, 11}));
  CHECK_EQ(head(g.seq_lens, 2), (std::vector<int32_t>{7, 4}));
  std::vector<TokenId> s2{51, 61};
  bm.update(s2.data(), 2, 4.0);
  CHECK_EQ(bm.events().finished, (std::vector<uint8_t>{1, 1}));
  CHECK_EQ(bm.events().finish_reasons[0], static_cast<int32_t>(FinishReason::kLength));
  bm.free_finished();
  CHECK(!bm.has_unfinished());
  CHECK_EQ(bm.num_free_blocks(), 16);
  bm.check_all_seq_slots_free();
}

TEST(stop_conditions_end_id_stop_tokens_and_min_tokens) {
  BatchManager bm(small_config());
  std::vector<TokenId> p{1, 2};
  bm.add_request(1, p.data(), 2, 10, /*end_id=*/9, {}, 0, 0.0);
  bm.add_request(2, p.data(), 2, 10, -1, {7, 8}, 0, 0.0);
  bm.add_request(3, p.data(), 2, 10, 9, {}, /*min_new_tokens=*/2, 0.0);
  const ForwardMetadata& m = bm.schedule(0);
  CHECK_EQ(m.num_logits, 3);
  std::vector<TokenId> t{9, 8, 9};
  bm.update(t.data(), 3, 0);
  const StepEvents& e = bm.events();
  CHECK_EQ(e.finished, (std::vector<uint8_t>{1, 1, 0}));
  CHECK_EQ(e.finish_reasons[0], static_cast<int32_t>(FinishReason::kEndId));
  CHECK_EQ(e.finish_reasons[1], static_cast<int32_t>(FinishReason::kStopToken));
  CHECK_EQ(bm.request_info(2).stop_token, 8);
  bm.free_finished();
  bm.schedule(1);
  std::vector<TokenId> t2{9};
  bm.update(t2.data(), 1, 1);
  CHECK_EQ(bm.events().finished, (std::vector<uint8_t>{1}));
  bm.free_finished();
  CHECK(!bm.has_unfinished());
}

TEST(the_caller_can_end_a_generating_request) {
  BatchManager bm(small_config());
  std::vector<TokenId> p{1, 2};
  bm.add_request(1, p.data(), 2, 10, -1, {}, 0, 0.0);
  bm.add_request(2, p.data(), 2, 10, -1, {}, 0, 0.0);
  CHECK(!bm.finish_request(1, FinishReason::kStopString, 0.0));  // still waiting
  const ForwardMetadata& m = bm.schedule(0);
  std::vector<TokenId> t(m.num_logits, 4);
  bm.update(t.data(), m.num_logits, 0);
  CHECK(bm.finish_request(1, FinishReason::kStopString, 1.0));
  CHECK(!bm.finish_request(1, FinishReason::kStopString, 1.0));  // already finished
  CHECK(!bm.finish_request(99, FinishReason::kStopString, 1.0));
  bm.free_finished();
  CHECK(!bm.contains(1));
  CHECK(bm.contains(2));
  CHECK_EQ(bm.num_free_blocks(), 15);
  CHECK_EQ(bm.num_free_seq_slots(), 3);
  bm.check_invariants();
}

TEST(a_request_ended_while_its_next_step_is_in_flight_discards_that_token) {
  BatchManager bm(small_config());
  std::vector<TokenId> p{1, 2};
  bm.add_request(1, p.data(), 2, 10, -1, {}, 0, 0.0);
  bm.add_request(2, p.data(), 2, 10, -1, {}, 0, 0.0);
  const ForwardMetadata& m = bm.schedule(0);
  std::vector<TokenId> t(m.num_logits, 4);
  bm.update(t.data(), m.num_logits, 0);
  bm.free_finished();
  bm.schedule(1);                                                 // step n: both in the batch
  CHECK(bm.finish_request(1, FinishReason::kStopString, 1.0));    // the caller ends 1 (step n-1's text)
  std::vector<TokenId> t2{7, 8};
  bm.update(t2.data(), 2, 2.0);
  CHECK_EQ(bm.events().output_request_ids, std::vector<RequestId>{2});  // 1's token 7 is discarded
  CHECK_EQ(bm.events().logits_rows, std::vector<int32_t>{1});          // 2's token came from row 1
  CHECK_EQ(bm.events().tokens, std::vector<TokenId>{8});
  CHECK_EQ(bm.request_info(1).prompt_len + bm.request_info(1).num_generated, 3);
  bm.free_finished();
  CHECK(!bm.contains(1));
  // A rollback never revives a request ended meanwhile.
  bm.add_request(3, p.data(), 2, 10, -1, {}, 0, 0.0);
  bm.schedule(3);
  CHECK(bm.finish_request(2, FinishReason::kStopString, 3.0));
  CHECK(bm.rollback());
  CHECK(bm.request_info(2).state == RequestState::kFinished);
  // Still active (the rolled-back batch held it): scheduling before retiring it is refused.
  CHECK_THROWS(bm.schedule(3.5), std::logic_error, "free_finished");
  bm.free_finished();
  CHECK(!bm.contains(2));
  bm.check_invariants();
}

TEST(a_request_paused_since_its_last_token_can_still_be_ended) {
  // With the overlap loop, step n's schedule may pause a request before the caller finds a
  // stop string in its step n-1 token: finish_request takes it out of the queue.
  BatchManagerConfig c = small_config();
  c.policy = CapacitySchedulerPolicy::kMaxUtilization;
  c.num_blocks = 3;  // 12 tokens
  for (bool roll_back : {false, true}) {
    BatchManager bm(c);
    std::vector<TokenId> p1{1, 2, 3, 4}, p2{5, 6, 7};
    bm.add_request(1, p1.data(), 4, 8, -1, {}, 0, 0.0);
    bm.add_request(2, p2.data(), 3, 8, -1, {}, 0, 0.0);
    for (int it = 0;; ++it) {  // decode until the schedule pauses 2 (started last)
      const ForwardMetadata& m = bm.schedule(it);
      if (!bm.events().paused.empty()) break;
      std::vector<TokenId> t(m.num_logits, 9);
      bm.update(t.data(), m.num_logits, it);
      bm.free_finished();
      CHECK(it < 8);
    }
    CHECK_EQ(bm.events().paused, std::vector<RequestId>{2});
    CHECK_EQ(bm.waiting_ids(), std::vector<RequestId>{2});
    CHECK(bm.request_info(2).num_generated > 0);
    CHECK(bm.finish_request(2, FinishReason::kStopString, 5.0));
    CHECK(bm.waiting_ids().empty());
    CHECK(!bm.finish_request(2, FinishReason::kStopString, 5.0));  // already finished
    if (roll_back) {
      CHECK(bm.rollback());  // the failed step's pause stands: 2 stays ended, holding nothing
      CHECK(bm.request_info(2).state == RequestState::kFinished);
      CHECK(bm.request_info(2).seq_slot < 0);
    } else {
      const ForwardMetadata& m = bm.metadata();
      std::vector<TokenId> t(m.num_logits, 9);
      bm.update(t.data(), m.num_logits, 6.0);
    }
    bm.check_invariants();
    bm.free_finished();
    CHECK(!bm.contains(2));
    bm.check_invariants();
    while (bm.has_unfinished()) {  // 1 runs to its end; 2 is never recomputed
      const ForwardMetadata& m = bm.schedule(7.0);
      CHECK(bm.events().assigned.empty() || bm.events().assigned == std::vector<RequestId>{1});
      std::vector<TokenId> t(m.num_logits, 9);
      bm.update(t.data(), m.num_logits, 7.0);
      bm.free_finished();
    }
    CHECK_EQ(bm.num_free_blocks(), 3);
    bm.check_all_seq_slots_free();
  }
}

TEST(bad_requests_raise_and_change_nothing) {
  BatchManager bm(small_config());
  std::vector<TokenId> p{1, 2, 3};
  std::vector<TokenId> bad{1, 100};
  CHECK_THROWS(bm.add_request(1, p.data(), 0, 4, -1, {}, 0, 0), std::invalid_argument, "prompt is empty");
  CHECK_THROWS(bm.add_request(1, bad.data(), 2, 4, -1, {}, 0, 0), std::invalid_argument,
               "prompt token id 100 at position 1 is outside the vocabulary [0, 100)");
  CHECK_THROWS(bm.add_request(1, p.data(), 3, 0, -1, {}, 0, 0), std::invalid_argument,
               "max_tokens must be at least 1, got 0");
  CHECK_THROWS(bm.add_request(1, p.data(), 3, 4, -1, {}, 5, 0), std::invalid_argument, "min_tokens");
  CHECK_THROWS(bm.add_request(1, p.data(), 3, 30, -1, {}, 0, 0), std::invalid_argument,
               "prompt length 3 + max_tokens 30 = 33 exceeds max_seq_len 32");
  CHECK_EQ(bm.num_requests(), 0);
  bm.add_request(1, p.data(), 3, 4, -1, {}, 0, 0);
  CHECK_THROWS(bm.add_request(1, p.data(), 3, 4, -1, {}, 0, 0), std::invalid_argument,
               "request_id 1 is already in use");
  CHECK_EQ(bm.num_requests(), 1);

  BatchManagerConfig tiny = small_config();
  tiny.num_blocks = 2;
  BatchManager small_pool(tiny);
  CHECK_THROWS(small_pool.add_request(1, p.data(), 3, 10, -1, {}, 0, 0), std::invalid_argument,
               "needs 4 KV blocks; the pool has 2");
  BatchManagerConfig nochunk = small_config();
  nochunk.enable_chunked_context = false;
  BatchManager nc(nochunk);
  std::vector<TokenId> longp(20, 1);
  CHECK_THROWS(nc.add_request(1, longp.data(), 20, 2, -1, {}, 0, 0), std::invalid_argument,
               "exceeds max_num_tokens 16 and chunked prefill is off");
}

TEST(abort_frees_a_waiting_a_prefilling_and_a_decoding_request) {
  BatchManagerConfig c = small_config();
  c.max_batch_size = 2;
  c.max_num_tokens = 8;
  BatchManager bm(c);
  std::vector<TokenId> shortp{1, 2}, longp(12, 3);
  bm.add_request(1, shortp.data(), 2, 8, -1, {}, 0, 0);
  bm.add_request(2, longp.data(), 12, 8, -1, {}, 0, 0);
  bm.add_request(3, shortp.data(), 2, 8, -1, {}, 0, 0);  // waits: two sequence slots
  const ForwardMetadata& m = bm.schedule(0);
  CHECK_EQ(m.num_seqs, 2);  // 1 whole, 2's first chunk (4 tokens)
  std::vector<TokenId> t(m.num_logits, 5);
  bm.update(t.data(), m.num_logits, 0);
  bm.free_finished();
  CHECK(bm.request_info(2).state == RequestState::kContextInProgress);
  CHECK(bm.abort_request(1));  // decoding
  CHECK(bm.abort_request(2));  // mid-prefill
  CHECK(bm.abort_request(3));  // waiting
  CHECK(!bm.abort_request(99));
  bm.schedule(1);
  CHECK_EQ(bm.events().aborted, (std::vector<RequestId>{1, 2, 3}));
  CHECK_EQ(bm.events().aborted_slots, (std::vector<SlotId>{0, 1, -1}));
  CHECK_EQ(bm.metadata().num_seqs, 0);
  CHECK(!bm.has_unfinished());
  CHECK_EQ(bm.num_free_blocks(), c.num_blocks);
  bm.check_all_seq_slots_free();
}

TEST(the_public_accessors_report_a_request_and_the_pools) {
  BatchManagerConfig c = small_config();
  c.num_seq_slots = 3;
  BatchManager bm(c);
  CHECK_EQ(bm.num_blocks(), 16);
  CHECK_EQ(bm.tokens_per_block(), 4);
  CHECK_EQ(bm.num_seq_slots(), 3);
  CHECK_EQ(bm.num_free_seq_slots(), 3);
  CHECK_THROWS(bm.request_info(7), std::out_of_range, "unknown request_id 7");
  CHECK_THROWS(bm.block_table(7), std::logic_error, "request 7 has no block table");

  std::vector<TokenId> p{1, 2, 3, 4, 5, 6};
  bm.add_request(7, p.data(), 6, 3, /*end_id=*/9, {}, 0, 0.5);
  RequestInfo w = bm.request_info(7);
  CHECK(w.state == RequestState::kWaiting);
  CHECK_EQ(w.id, RequestId{7});
  CHECK_EQ(w.seq_slot, -1);
  CHECK_EQ(w.prompt_len, 6);
  CHECK_EQ(w.num_generated, 0);
  CHECK_EQ(w.context_len, 6);
  CHECK_EQ(w.num_computed_tokens, 0);
  CHECK_EQ(w.num_blocks, 0);
  CHECK_EQ(w.arrival_time, 0.5);
  CHECK_EQ(w.first_scheduled_time, -1.0);
  CHECK_THROWS(bm.block_table(7), std::logic_error, "has no block table");  // queued: holds none

  bm.schedule(1.0);
  CHECK_EQ(bm.block_table(7), (std::vector<BlockId>{0, 1}));
  CHECK_EQ(bm.num_free_blocks(), 14);
  CHECK_EQ(bm.num_free_seq_slots(), 2);
  CHECK_THROWS(bm.check_all_seq_slots_free(), std::logic_error, "1 sequence slot(s) still held: 7->0");
  std::vector<TokenId> t{4};
  bm.update(t.data(), 1, 2.0);
  RequestInfo g = bm.request_info(7);
  CHECK(g.state == RequestState::kGenerationInProgress);
  CHECK_EQ(g.seq_slot, 0);
  CHECK_EQ(g.num_generated, 1);
  CHECK_EQ(g.num_computed_tokens, 6);
  CHECK_EQ(g.num_blocks, 2);
  CHECK_EQ(g.first_scheduled_time, 1.0);
  CHECK_EQ(g.first_token_time, 2.0);

  bm.schedule(3.0);
  std::vector<TokenId> end{9};
  bm.update(end.data(), 1, 4.0);
  RequestInfo f = bm.request_info(7);  // finished, not yet retired
  CHECK(f.state == RequestState::kFinished);
  CHECK(f.finish_reason == FinishReason::kEndId);
  CHECK_EQ(f.stop_token, 9);
  CHECK_EQ(f.finish_time, 4.0);
  bm.free_finished();
  CHECK_THROWS(bm.request_info(7), std::out_of_range, "unknown request_id 7");
  CHECK_EQ(bm.num_free_blocks(), 16);
  bm.check_all_seq_slots_free();

  BatchManager moved(std::move(bm));  // the state moves; the metadata buffers stay put
  CHECK_EQ(moved.num_seq_slots(), 3);
  CHECK(!moved.has_unfinished());
}

TEST_MAIN()
