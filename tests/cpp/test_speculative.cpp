// Speculative decoding in the batch manager: prompt-lookup drafts, the metadata of a
// generation row carrying drafts, acceptance (all, some, none; an end or max_tokens inside
// the drafts), the KV rewind with exact block ids, rollback, and a whole run whose blocks,
// reference counts and cached keys end exactly as without speculation.
#include <algorithm>
#include <stdexcept>
#include <map>
#include <set>
#include <tuple>

#include "batch_manager/draft_length.h"
#include "batch_manager/ngram_proposer.h"
#include "pyengine/batch_manager.h"
#include "test_harness.h"

using namespace pyengine;

namespace {

using Tokens = std::vector<TokenId>;

BatchManagerConfig config(int32_t k, bool ngram = false, bool reuse = false) {
  BatchManagerConfig c;
  c.max_batch_size = 4;
  c.max_num_tokens = 64;
  c.max_seq_len = 128;
  c.tokens_per_block = 4;
  c.num_blocks = 32;
  c.num_speculative_tokens = k;
  c.ngram_drafts = ngram;
  c.enable_block_reuse = reuse;
  return c;
}

void add(BatchManager& bm, RequestId id, const Tokens& prompt, int32_t max_new, TokenId end_id = -1) {
  bm.add_request(id, prompt.data(), static_cast<int32_t>(prompt.size()), max_new, end_id, {}, 0, 0.0);
}

template <typename T>
std::vector<T> head(const std::vector<T>& v, int32_t n) {
  return std::vector<T>(v.begin(), v.begin() + n);
}

// One step in which every logits row samples `tokens` (in order); returns the emitted tokens.
Tokens step(BatchManager& bm, const Tokens& tokens) {
  const ForwardMetadata& m = bm.schedule(0.0);
  CHECK_EQ(m.num_logits, static_cast<int32_t>(tokens.size()));
  bm.update(tokens.data(), static_cast<int32_t>(tokens.size()), 0.0);
  bm.check_invariants();
  return bm.events().tokens;
}

}  // namespace

TEST(ngram_proposer_takes_the_longest_most_recent_match) {
  CHECK_EQ(propose_ngram({1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3}, 1, 3, 2), (Tokens{7, 5}));  // the later "1 2 3"
  CHECK_EQ(propose_ngram({4, 5, 6, 4, 5}, 2, 3, 3), (Tokens{6, 4, 5}));  // runs into the suffix itself
  CHECK_EQ(propose_ngram({4, 5, 6, 4, 5}, 2, 3, 8), (Tokens{6, 4, 5, 6, 4, 5, 6, 4}));  // ... and on, period 3
  CHECK_EQ(propose_ngram({8, 1, 2, 9, 2}, 1, 3, 2), (Tokens{9, 2}));     // only the 1-gram "2" matches
  CHECK_EQ(propose_ngram({8, 1, 2, 9, 2}, 2, 3, 2), Tokens{});           // ... which is below n_min
  CHECK_EQ(propose_ngram({7, 3, 3, 3}, 2, 3, 4), (Tokens{3, 3, 3, 3}));  // a repeated token: period 1
  CHECK_EQ(propose_ngram({3, 3}, 1, 3, 4), (Tokens{3, 3, 3, 3}));
  CHECK_EQ(propose_ngram({3}, 1, 3, 4), Tokens{});
  CHECK_EQ(propose_ngram({1, 2, 1, 2}, 1, 2, 0), Tokens{});
}

TEST(a_generation_row_with_drafts_is_one_logits_row_per_token) {
  BatchManager bm(config(3));
  add(bm, 1, {10, 11, 12, 13, 14}, 10);
  CHECK_EQ(step(bm, {20}), Tokens{20});  // the prompt: blocks 0, 1
  CHECK(bm.set_draft_tokens(1, Tokens{21, 22, 23}.data(), 3));
  const ForwardMetadata& m = bm.schedule(0.0);
  CHECK_EQ(m.num_seqs, 1);
  CHECK_EQ(m.num_generation_seqs, 1);
  CHECK_EQ(m.num_tokens, 4);
  CHECK_EQ(m.num_logits, 4);
  CHECK_EQ(head(m.input_ids, 4), (Tokens{20, 21, 22, 23}));
  CHECK_EQ(head(m.positions, 4), (std::vector<int32_t>{5, 6, 7, 8}));
  CHECK_EQ(head(m.slot_mapping, 4), (std::vector<int32_t>{5, 6, 7, 8}));  // blocks 1 and 2
  CHECK_EQ(head(m.query_start_loc, 2), (std::vector<int32_t>{0, 4}));
  CHECK_EQ(m.seq_lens[0], 9);
  CHECK_EQ(head(m.logits_indices, 4), (std::vector<int32_t>{0, 1, 2, 3}));
  CHECK_EQ(head(m.logits_offsets, 4), (std::vector<int32_t>{0, 1, 2, 3}));
  CHECK_EQ(bm.block_table(1), (std::vector<BlockId>{0, 1, 2}));
  // 21 and 22 accepted, 23 rejected (99 was sampled there): 21, 22, 99 emitted
  const Tokens sampled{21, 22, 99, 50};
  bm.update(sampled.data(), 4, 0.0);
  const StepEvents& e = bm.events();
  CHECK_EQ(e.tokens, (Tokens{21, 22, 99}));
  CHECK_EQ(e.logits_rows, (std::vector<int32_t>{0, 1, 2}));
  CHECK_EQ(e.output_request_ids, (std::vector<RequestId>{1, 1, 1}));
  CHECK_EQ(e.finished, (std::vector<uint8_t>{0, 0, 0}));
  const RequestInfo info = bm.request_info(1);
  CHECK_EQ(info.num_generated, 4);
  CHECK_EQ(info.num_computed_tokens, 8);  // 5 prompt + 20 21 22; 99 has no KV yet
  CHECK_EQ(info.num_draft_tokens, int64_t{3});
  CHECK_EQ(info.num_accepted_draft_tokens, int64_t{2});
  // block 2 held only the rejected draft's position 8: back at the head of the free queue
  CHECK_EQ(bm.block_table(1), (std::vector<BlockId>{0, 1}));
  CHECK_EQ(bm.num_free_blocks(), 30);
  bm.check_invariants();
  // the next step (no drafts) writes position 8 into the same block, as without speculation
  const ForwardMetadata& m2 = bm.schedule(0.0);
  CHECK_EQ(m2.num_tokens, 1);
  CHECK_EQ(m2.input_ids[0], 99);
  CHECK_EQ(m2.positions[0], 8);
  CHECK_EQ(bm.block_table(1), (std::vector<BlockId>{0, 1, 2}));
}

TEST(all_drafts_rejected_or_all_accepted) {
  BatchManager bm(config(2));
  add(bm, 1, {1, 2, 3, 4}, 20);
  step(bm, {5});
  CHECK(bm.set_draft_tokens(1, Tokens{6, 7}.data(), 2));
  CHECK_EQ(step(bm, {8, 6, 7}), Tokens{8});  // the first draft is already wrong
  CHECK_EQ(bm.request_info(1).num_computed_tokens, 5);
  CHECK_EQ(bm.block_table(1).size(), size_t{2});  // positions 0..4
  CHECK(bm.set_draft_tokens(1, Tokens{9, 10}.data(), 2));
  CHECK_EQ(step(bm, {9, 10, 11}), (Tokens{9, 10, 11}));  // both, and the token after them
  CHECK_EQ(bm.request_info(1).num_computed_tokens, 8);
  CHECK_EQ(bm.request_info(1).num_accepted_draft_tokens, int64_t{2});
  CHECK_EQ(bm.request_info(1).num_draft_tokens, int64_t{4});
  CHECK_EQ(bm.block_table(1).size(), size_t{2});
}

TEST(an_end_inside_the_accepted_drafts_cuts_there) {
  BatchManager bm(config(3));
  add(bm, 1, {1, 2, 3}, 20, /*end_id=*/2);
  step(bm, {5});
  CHECK(bm.set_draft_tokens(1, Tokens{6, 2, 7}.data(), 3));
  CHECK_EQ(step(bm, {6, 2, 7, 8}), (Tokens{6, 2}));  // all accepted, but 2 ends it
  const StepEvents& e = bm.events();
  CHECK_EQ(e.finished, (std::vector<uint8_t>{0, 1}));
  CHECK_EQ(e.finish_reasons.back(), static_cast<int32_t>(FinishReason::kEndId));
  bm.free_finished();
  CHECK_EQ(bm.num_free_blocks(), 32);
  bm.check_invariants();
}

TEST(drafts_never_pass_max_tokens) {
  BatchManager bm(config(4));
  add(bm, 1, {1, 2, 3}, 3);
  step(bm, {5});  // 1 of 3 generated: 1 draft at most (it and the token after it make 3)
  CHECK(bm.set_draft_tokens(1, Tokens{6, 7, 8, 9}.data(), 4));
  const ForwardMetadata& m = bm.schedule(0.0);
  CHECK_EQ(m.num_tokens, 2);
  const Tokens sampled{6, 7};
  bm.update(sampled.data(), 2, 0.0);
  CHECK_EQ(bm.events().tokens, (Tokens{6, 7}));
  CHECK_EQ(bm.events().finished, (std::vector<uint8_t>{0, 1}));
  CHECK_EQ(bm.events().finish_reasons.back(), static_cast<int32_t>(FinishReason::kLength));
  bm.free_finished();
  bm.check_invariants();
  CHECK_EQ(bm.num_free_blocks(), 32);
}

TEST(drafts_go_after_every_generation_token_and_before_context_chunks) {
  BatchManagerConfig c = config(3);
  c.max_num_tokens = 8;
  BatchManager bm(c);
  add(bm, 1, {1, 2, 3}, 10);
  add(bm, 2, {4, 5, 6}, 10);
  step(bm, {7, 8});  // both prompts: 3 + 3 tokens
  add(bm, 3, {9, 9, 9, 9, 9, 9, 9, 9}, 4);
  CHECK(bm.set_draft_tokens(1, Tokens{11, 12, 13}.data(), 3));
  CHECK(bm.set_draft_tokens(2, Tokens{21, 22, 23}.data(), 3));
  const ForwardMetadata& m = bm.schedule(0.0);
  // 8 tokens: the two generation tokens, then request 1's 3 drafts, then request 2's 3; no
  // token is left for request 3's prompt, which waits
  CHECK_EQ(m.num_seqs, 2);
  CHECK_EQ(head(m.query_start_loc, 3), (std::vector<int32_t>{0, 4, 8}));
  CHECK_EQ(m.num_logits, 8);
  CHECK_EQ(head(m.logits_offsets, 8), (std::vector<int32_t>{0, 1, 2, 3, 0, 1, 2, 3}));
  bm.rollback();
}

TEST(rollback_undoes_the_draft_blocks_and_drops_the_drafts) {
  BatchManager bm(config(3));
  add(bm, 1, {1, 2, 3, 4}, 20);
  step(bm, {5});
  const std::vector<BlockId> before = bm.block_table(1);
  const int32_t free_before = bm.num_free_blocks();
  CHECK(bm.set_draft_tokens(1, Tokens{6, 7, 8}.data(), 3));
  CHECK_EQ(bm.schedule(0.0).num_tokens, 4);
  CHECK(bm.block_table(1) != before);
  CHECK(bm.rollback());
  CHECK_EQ(bm.block_table(1), before);
  CHECK_EQ(bm.num_free_blocks(), free_before);
  bm.check_invariants();
  CHECK_EQ(bm.schedule(0.0).num_tokens, 1);  // the drafts were for the undone step
}

TEST(set_draft_tokens_is_checked) {
  BatchManagerConfig c = config(2);
  c.vocab_size = 100;
  BatchManager bm(c);
  add(bm, 1, {1, 2, 3}, 5);
  CHECK(!bm.set_draft_tokens(1, Tokens{4}.data(), 1));  // not generating yet
  CHECK(!bm.set_draft_tokens(7, Tokens{4}.data(), 1));  // unknown
  step(bm, {5});
  CHECK_THROWS(bm.set_draft_tokens(1, Tokens{100}.data(), 1), std::invalid_argument,
               "draft token id 100 is outside the vocabulary [0, 100)");
  CHECK_THROWS(bm.set_max_draft_tokens(1, 3), std::invalid_argument,
               "max_draft_tokens must be in [0, num_speculative_tokens=2], got 3");
  CHECK_THROWS(bm.set_max_draft_tokens(1, -1), std::invalid_argument, "got -1");
  CHECK(bm.set_max_draft_tokens(1, 0));  // this request never speculates
  CHECK(bm.set_draft_tokens(1, Tokens{4}.data(), 1));
  CHECK_EQ(bm.schedule(0.0).num_tokens, 1);
  bm.rollback();
  BatchManagerConfig bad = config(64);
  CHECK_THROWS(BatchManager{bad}, std::invalid_argument,
               "num_speculative_tokens must be in [0, max_num_tokens=64), got 64");
  bad = config(2);
  bad.prompt_lookup_min = 3;
  bad.prompt_lookup_max = 2;
  CHECK_THROWS(BatchManager{bad}, std::invalid_argument, "got 3 and 2");
}

TEST(prompt_lookup_drafts_are_proposed_by_schedule) {
  BatchManager bm(config(3, /*ngram=*/true));
  add(bm, 1, {1, 2, 3, 4, 1, 2, 3}, 20);
  step(bm, {4});  // tokens 1 2 3 4 1 2 3 4: "1 2 3 4" occurred at 0, followed by 1 2 3
  const ForwardMetadata& m = bm.schedule(0.0);
  CHECK_EQ(head(m.input_ids, m.num_tokens), (Tokens{4, 1, 2, 3}));
  bm.rollback();
}

namespace {

// A deterministic "model": the next token of a sequence, a function of its last two tokens
// over a small alphabet, so sequences fall into cycles that prompt lookup predicts -- and
// leave them now and then (every 7th position), so drafts are also rejected.
TokenId next_token(const Tokens& seq) {
  const size_t n = seq.size();
  const TokenId a = seq[n - 2], b = seq[n - 1];
  return static_cast<TokenId>((a * 7 + b * 3 + (n % 7 == 0 ? 5 : 0)) % 11 + 1);
}

struct RunResult {
  std::map<RequestId, Tokens> outputs;
  std::vector<Tokens> sequences;  // prompt + output of every request
  std::set<std::tuple<uint64_t, uint64_t, Tokens>> cached;  // (key, parent, tokens)
  std::vector<CachedBlockRecord> records;
  int32_t free_blocks = 0, reusable = 0;
  int64_t drafted = 0, accepted = 0;
};

// Runs the prompts to completion, every logits row sampling next_token() of its sequence.
RunResult run(const BatchManagerConfig& c, const std::vector<Tokens>& prompts, int32_t max_new) {
  BatchManager bm(c);
  std::map<RequestId, Tokens> seqs;
  for (size_t i = 0; i < prompts.size(); ++i) {
    add(bm, static_cast<RequestId>(i + 1), prompts[i], max_new);
    seqs[static_cast<RequestId>(i + 1)] = prompts[i];
  }
  RunResult out;
  while (bm.has_unfinished()) {
    const ForwardMetadata& m = bm.schedule(0.0);
    Tokens sampled;
    int32_t row = 0;
    for (int32_t s = 0; s < m.num_seqs; ++s) {
      const RequestId id = m.request_ids[s];
      const int32_t q0 = m.query_start_loc[s], q1 = m.query_start_loc[s + 1];
      Tokens seq = seqs[id];  // committed tokens; a generation row's drafts follow them
      for (; row < m.num_logits && m.logits_request_ids[row] == id; ++row) {
        const int32_t j = m.logits_offsets[row];
        Tokens with_drafts = seq;
        for (int32_t t = q0 + 1; t <= q0 + j && t < q1; ++t) with_drafts.push_back(m.input_ids[t]);
        sampled.push_back(next_token(with_drafts));
      }
    }
    bm.update(sampled.data(), static_cast<int32_t>(sampled.size()), 0.0);
    const StepEvents& e = bm.events();
    for (size_t i = 0; i < e.tokens.size(); ++i) seqs[e.output_request_ids[i]].push_back(e.tokens[i]);
    for (size_t i = 0; i < e.tokens.size(); ++i)
      if (e.finished[i]) {
        const RequestInfo info = bm.request_info(e.output_request_ids[i]);
        out.drafted += info.num_draft_tokens;
        out.accepted += info.num_accepted_draft_tokens;
      }
    bm.free_finished();
    bm.check_invariants();
  }
  for (const auto& kv : seqs) out.outputs[kv.first] = Tokens(kv.second.begin() + prompts[kv.first - 1].size(), kv.second.end());
  for (const auto& kv : seqs) out.sequences.push_back(kv.second);
  out.records = bm.export_cached_blocks();
  for (const CachedBlockRecord& r : out.records) out.cached.insert({r.key, r.parent, r.tokens});
  out.free_blocks = bm.num_free_blocks();
  out.reusable = bm.num_reusable_blocks();
  return out;
}

}  // namespace

TEST(one_request_ends_with_exactly_the_blocks_and_keys_of_a_run_without_speculation) {
  const std::vector<Tokens> prompts{{3, 5, 2, 9, 4, 4}};
  const RunResult plain = run(config(0, false, true), prompts, 60);
  const RunResult spec = run(config(3, true, true), prompts, 60);
  CHECK_EQ(spec.outputs.at(1), plain.outputs.at(1));
  CHECK(spec.accepted > 0 && spec.accepted < spec.drafted);  // some drafts accepted, some not
  CHECK_EQ(spec.free_blocks, plain.free_blocks);
  CHECK_EQ(spec.reusable, plain.reusable);
  CHECK_EQ(spec.records.size(), plain.records.size());
  for (size_t i = 0; i < std::min(spec.records.size(), plain.records.size()); ++i) {
    CHECK_EQ(spec.records[i].block, plain.records[i].block);  // the same block ids, same order
    CHECK_EQ(spec.records[i].key, plain.records[i].key);
    CHECK_EQ(spec.records[i].tokens, plain.records[i].tokens);
  }
}

namespace {

// Every cached block's chain (its tokens and its ancestors') is a prefix of a request's
// final sequence: nothing unverified was ever keyed.
bool cached_chains_are_verified_prefixes(const RunResult& r) {
  std::map<uint64_t, const CachedBlockRecord*> by_key;
  for (const CachedBlockRecord& rec : r.records) by_key[rec.key] = &rec;
  for (const CachedBlockRecord& rec : r.records) {
    Tokens chain;
    for (const CachedBlockRecord* p = &rec; p != nullptr;) {
      chain.insert(chain.begin(), p->tokens.begin(), p->tokens.end());
      auto it = by_key.find(p->parent);
      p = it == by_key.end() ? nullptr : it->second;
    }
    bool found = false;
    for (const Tokens& seq : r.sequences)
      for (size_t off = 0; !found && off + chain.size() <= seq.size(); off += 4)  // a chain may lack its evicted head
        found = std::equal(chain.begin(), chain.end(), seq.begin() + static_cast<std::ptrdiff_t>(off));
    if (!found) return false;
  }
  return true;
}

}  // namespace

TEST(many_requests_with_shared_prefixes_cache_only_verified_tokens) {
  const std::vector<Tokens> prompts{{3, 5, 2, 9, 4, 4, 1}, {3, 5, 2, 9, 4, 4, 7, 2}, {6, 1}, {3, 5, 2, 9, 8}};
  for (CapacitySchedulerPolicy policy : {CapacitySchedulerPolicy::kGuaranteedNoEvict,
                                         CapacitySchedulerPolicy::kMaxUtilization}) {
    // a pool that evicts nothing (the same cached blocks as without speculation), and one
    // that evicts (and, under max_utilization, pauses requests)
    for (int32_t num_blocks : {128, 24}) {
      BatchManagerConfig plain_c = config(0, false, true), spec_c = config(4, true, true);
      plain_c.policy = spec_c.policy = policy;
      plain_c.num_blocks = spec_c.num_blocks = num_blocks;
      const RunResult plain = run(plain_c, prompts, 50);
      const RunResult spec = run(spec_c, prompts, 50);
      CHECK_EQ(spec.outputs.size(), prompts.size());
      for (const auto& kv : plain.outputs) CHECK_EQ(spec.outputs.at(kv.first), kv.second);
      CHECK(spec.accepted > 0);
      CHECK_EQ(spec.free_blocks, plain.free_blocks);
      CHECK(cached_chains_are_verified_prefixes(spec));
      if (num_blocks == 128) CHECK(spec.cached == plain.cached);  // the same keys, parents and tokens
    }
  }
}

TEST(prompt_lookup_backs_off_from_a_request_whose_drafts_keep_failing) {
  // The "model" alternates token 3 with a fresh token: whenever the sequence ends in 3, the
  // 1-gram lookup finds the previous 3 and drafts the fresh token that followed it -- always
  // wrong. After 2 misses in a row the request pauses proposing for 1, 2, 4, ... steps.
  BatchManagerConfig c = config(1, /*ngram=*/true);
  c.prompt_lookup_min = c.prompt_lookup_max = 1;
  BatchManager bm(c);
  add(bm, 1, {3, 50}, 100);
  int32_t fresh = 200;
  Tokens seq{3, 50};
  std::vector<int32_t> drafted_at;
  for (int32_t s = 0; s < 40 && bm.has_unfinished(); ++s) {
    const ForwardMetadata& m = bm.schedule(0.0);
    if (m.num_draft_tokens > 0) drafted_at.push_back(s);
    Tokens sampled;
    for (int32_t row = 0; row < m.num_logits; ++row)  // the next token after each row's prefix
      sampled.push_back(seq.back() == 3 && row == 0 ? fresh : (row == 0 ? 3 : fresh + 1));
    bm.update(sampled.data(), m.num_logits, 0.0);
    for (TokenId t : bm.events().tokens) seq.push_back(t);
    if (seq.back() != 3) ++fresh;
    bm.check_invariants();
  }
  // Step 0 computes the prompt; the sequence ends in 3 before every odd step. Drafts at 1 and
  // 3 (misses 1, 2: pause 1 step, the 4th), 5 (miss 3: pause 2, steps 6-7), 9 (pause 4, steps
  // 10-13), 15 (pause 8, steps 16-23), 25 (pause 16): without the back-off, every odd step.
  CHECK_EQ(drafted_at, (std::vector<int32_t>{1, 3, 5, 9, 15, 25}));
  CHECK_EQ(bm.request_info(1).num_accepted_draft_tokens, int64_t{0});
}

TEST(a_draft_model_backs_off_for_four_steps_at_most) {
  // Every draft is wrong (the model samples 99): after 2 misses in a row the request pauses
  // drafting for 1, 2, then 4 steps at most (prompt lookup: up to 64).
  BatchManagerConfig c = config(2);
  c.model_drafts = true;
  BatchManager bm(c);
  add(bm, 1, {3, 50}, 100);
  std::vector<int32_t> drafted_at;
  for (int32_t s = 0; s < 30; ++s) {
    const ForwardMetadata& m = bm.schedule(0.0);
    if (m.num_draft_tokens > 0) {
      drafted_at.push_back(s);
      const Tokens drafts(static_cast<size_t>(m.num_draft_tokens), 7);
      bm.set_scheduled_draft_tokens(drafts.data(), m.num_draft_tokens);
    }
    const Tokens sampled(static_cast<size_t>(m.num_logits), 99);
    bm.update(sampled.data(), m.num_logits, 0.0);
    bm.check_invariants();
  }
  // misses at 1, 2 (pause 1: step 3), 4 (pause 2: 5-6), 7 (pause 4: 8-11), 12, 17, 22, 27
  CHECK_EQ(drafted_at, (std::vector<int32_t>{1, 2, 4, 7, 12, 17, 22, 27}));
}

TEST(the_best_draft_count_maximizes_tokens_per_unit_of_cost) {
  // (1 + a + ... + a^k) / (1 + k c): a = 0.6, c = 0.22 -> k = 1: 1.311, 2: 1.361, 3: 1.311
  CHECK_EQ(best_draft_count(0.6, 0.22, 3), 2);
  CHECK_EQ(best_draft_count(0.6, 0.22, 1), 1);  // the limit holds
  CHECK_EQ(best_draft_count(0.6, 0.12, 3), 3);  // 1.429, 1.581, 1.600
  CHECK_EQ(best_draft_count(1.0, 0.9, 5), 5);   // every draft accepted: always worth it while c < 1
  CHECK_EQ(best_draft_count(0.2, 0.22, 4), 0);  // a < c: not even one pays
  CHECK_EQ(best_draft_count(0.22, 0.22, 4), 0); // a tie goes to fewer drafts
  CHECK_EQ(best_draft_count(0.9, 0.0, 0), 0);
  // rho B / (1 + (B - 1) rho) + delta: one request pays rho + delta; 64 pay nearly a whole row
  CHECK_NEAR(draft_token_cost(0.12, 0.1, 1), 0.22, 1e-12);
  CHECK_NEAR(draft_token_cost(0.12, 0.0, 4), 0.48 / 1.36, 1e-12);
  CHECK_NEAR(draft_token_cost(0.12, 0.0, 64), 7.68 / 8.56, 1e-12);
  DraftAcceptance a;
  CHECK_NEAR(a.rate(), 0.6, 1e-12);
  a.observe(2, 2);  // both accepted: no rejection
  CHECK_NEAR(a.rate(), (1.2 * 0.875 + 2) / (1.2 * 0.875 + 2 + 0.8 * 0.875), 1e-12);
  a.observe(0, 3);
  CHECK_NEAR(a.rejected, 0.8 * 0.875 * 0.875 + 1, 1e-12);
}

namespace {

// Runs one request with model drafts (placeholders filled with 7) and adaptive draft length
// for `steps` steps, the model sampling 7 (drafts accepted) or 99 (rejected); returns the
// draft count of each step that had drafts, by step.
std::map<int32_t, int32_t> adaptive_run(bool accept, int32_t steps) {
  BatchManagerConfig c = config(3);
  c.max_seq_len = 256;
  c.num_blocks = 64;
  c.model_drafts = true;
  c.adaptive_draft_length = true;
  c.draft_row_cost = 0.12;
  c.draft_propose_cost = 0.1;
  BatchManager bm(c);
  add(bm, 1, {3, 50}, 200);
  std::map<int32_t, int32_t> drafted;
  for (int32_t s = 0; s < steps; ++s) {
    const ForwardMetadata& m = bm.schedule(0.0);
    if (m.num_draft_tokens > 0) {
      drafted[s] = m.num_draft_tokens;
      const Tokens drafts(static_cast<size_t>(m.num_draft_tokens), 7);
      bm.set_scheduled_draft_tokens(drafts.data(), m.num_draft_tokens);
    }
    const Tokens sampled(static_cast<size_t>(m.num_logits), accept ? 7 : 99);
    bm.update(sampled.data(), m.num_logits, 0.0);
    bm.check_invariants();
  }
  return drafted;
}

}  // namespace

TEST(adaptive_draft_length_follows_the_acceptance) {
  // c = 0.12 + 0.1 = 0.22 at batch 1. Every draft accepted: the prior (0.6) gives 2 drafts,
  // then the estimate (0.81 after one verification) the limit, 3, every step.
  std::map<int32_t, int32_t> expected;
  expected[1] = 2;
  for (int32_t s = 2; s < 12; ++s) expected[s] = 3;
  CHECK_EQ(adaptive_run(true, 12), expected);
  // Every draft rejected: 2 drafts (a 0.6), 1 (0.38), the miss back-off's pause at step 3,
  // 1 (0.27), its pause of 2 steps, then a = 0.20 < c: none for 8 steps (7-14), a probe with
  // one at 15, whose miss pauses 4 steps (16-19); none for 8 (20-27), a probe at 28, ...
  CHECK_EQ(adaptive_run(false, 45),
           (std::map<int32_t, int32_t>{{1, 2}, {2, 1}, {4, 1}, {15, 1}, {28, 1}, {41, 1}}));
}

TEST(adaptive_draft_length_drafts_less_in_a_larger_batch) {
  // rho = 0.12, delta = 0, prior a = 0.6: alone, c = 0.12 and 3 drafts pay best; among 4
  // generating requests c = 0.48 / 1.36 = 0.353 and 1 does (1.182 against 1.149 for 2).
  BatchManagerConfig c = config(3);
  c.model_drafts = true;
  c.adaptive_draft_length = true;
  c.draft_row_cost = 0.12;
  BatchManager one(c);
  add(one, 1, {3, 50}, 20);
  step(one, {7});
  CHECK_EQ(one.schedule(0.0).num_draft_tokens, 3);
  one.rollback();
  BatchManager four(c);
  for (RequestId id = 1; id <= 4; ++id) add(four, id, {3, 50}, 20);
  step(four, {7, 7, 7, 7});
  const ForwardMetadata& m = four.schedule(0.0);
  CHECK_EQ(m.num_draft_tokens, 4);
  CHECK_EQ(head(m.query_start_loc, 5), (std::vector<int32_t>{0, 2, 4, 6, 8}));
  four.rollback();
  BatchManagerConfig bad = c;
  bad.draft_row_cost = -0.5;
  CHECK_THROWS(BatchManager{bad}, std::invalid_argument, "draft_row_cost and draft_propose_cost must be finite and >= 0");
}

TEST(model_drafts_are_placeholders_that_set_scheduled_draft_tokens_fills) {
  BatchManagerConfig c = config(3);
  c.model_drafts = true;
  c.vocab_size = 100;
  BatchManager bm(c);
  add(bm, 1, {10, 11, 12, 13, 14}, 10);
  add(bm, 2, {30, 31}, 3);
  add(bm, 3, {40, 41, 42}, 10);
  CHECK(bm.set_max_draft_tokens(3, 0));  // (a request that may not speculate)
  CHECK_EQ(step(bm, {20, 32, 43}), (Tokens{20, 32, 43}));  // the prompts: request 1 in blocks 0 and 1
  const ForwardMetadata& m = bm.schedule(0.0);
  // request 1: 3 placeholders; request 2: 1 (2 of 3 tokens would be generated); request 3: none
  CHECK_EQ(m.num_generation_seqs, 3);
  CHECK_EQ(m.num_draft_tokens, 4);
  CHECK_EQ(head(m.query_start_loc, 4), (std::vector<int32_t>{0, 4, 6, 7}));
  CHECK_EQ(head(m.input_ids, 7), (Tokens{20, 0, 0, 0, 32, 0, 43}));
  CHECK_THROWS(bm.set_scheduled_draft_tokens(Tokens{21, 22, 23}.data(), 3), std::invalid_argument,
               "set_scheduled_draft_tokens: the batch has 4 draft tokens, got 3");
  CHECK_THROWS(bm.set_scheduled_draft_tokens(Tokens{21, 22, 100, 33}.data(), 4), std::invalid_argument,
               "draft token id 100 is outside the vocabulary [0, 100)");
  CHECK_EQ(head(m.input_ids, 7), (Tokens{20, 0, 0, 0, 32, 0, 43}));  // unchanged by the failed calls
  bm.set_scheduled_draft_tokens(Tokens{21, 22, 23, 33}.data(), 4);
  CHECK_EQ(head(m.input_ids, 7), (Tokens{20, 21, 22, 23, 32, 33, 43}));
  CHECK_EQ(bm.block_table(1), (std::vector<BlockId>{0, 1, 4}));  // positions 5..8 (2 and 3: the other prompts)
  // request 1: 21 accepted, 22 rejected (77 sampled there); request 2: 33 accepted, then 34
  // ends it at max_tokens; request 3: one token
  const Tokens sampled{21, 77, 5, 6, 33, 34, 44};
  bm.update(sampled.data(), 7, 0.0);
  CHECK_EQ(bm.events().tokens, (Tokens{21, 77, 33, 34, 44}));
  CHECK_EQ(bm.events().finished, (std::vector<uint8_t>{0, 0, 0, 1, 0}));
  CHECK_EQ(bm.request_info(1).num_computed_tokens, 7);  // 5 prompt + 20 21
  CHECK_EQ(bm.request_info(1).num_accepted_draft_tokens, int64_t{1});
  CHECK_EQ(bm.block_table(1), (std::vector<BlockId>{0, 1}));  // block 4 held only position 8: rewound
  bm.free_finished();
  bm.check_invariants();
  // the next schedule gives request 1 fresh placeholders
  const ForwardMetadata& m2 = bm.schedule(0.0);
  CHECK_EQ(head(m2.input_ids, 4), (Tokens{77, 0, 0, 0}));
  bm.rollback();
  BatchManagerConfig both = config(2, /*ngram=*/true);
  both.model_drafts = true;
  CHECK_THROWS(BatchManager{both}, std::invalid_argument, "ngram_drafts and model_drafts are two sources");
}

TEST_MAIN()
