// The C API of the batch manager and its KV cache (pyengine/c_api.h) over pyengine::BatchManager.
#include <string>
#include <vector>

#include "c_api/guard.h"
#include "pyengine/batch_manager.h"

using pyengine::BatchManager;
using pyengine::c_api::Error;
using pyengine::c_api::guarded;
using pyengine::c_api::ok;
using pyengine::c_api::require;

struct pe_kv_cache {
  BatchManager* bm;
};

struct pe_batch_manager {
  explicit pe_batch_manager(const pyengine::BatchManagerConfig& c) : bm(c), kv{&bm} {}
  BatchManager bm;
  pe_kv_cache kv;
};

namespace {

[[noreturn]] void unknown_request(int64_t id, const char* what) {
  throw Error{PE_ERR_NOT_FOUND, "unknown request id " + std::to_string(id) + what};
}

void fill_metadata(const pyengine::ForwardMetadata& m, pe_forward_metadata* out) {
  out->num_tokens = m.num_tokens;
  out->num_seqs = m.num_seqs;
  out->num_generation_seqs = m.num_generation_seqs;
  out->num_logits = m.num_logits;
  out->max_blocks_per_seq = m.max_blocks_per_seq;
  out->input_ids = m.input_ids.data();
  out->positions = m.positions.data();
  out->slot_mapping = m.slot_mapping.data();
  out->query_start_loc = m.query_start_loc.data();
  out->seq_lens = m.seq_lens.data();
  out->seq_slots = m.seq_slots.data();
  out->request_ids = m.request_ids.data();
  out->block_tables = m.block_tables.data();
  out->logits_indices = m.logits_indices.data();
  out->logits_slots = m.logits_slots.data();
  out->logits_request_ids = m.logits_request_ids.data();
  out->logits_offsets = m.logits_offsets.data();
  out->num_draft_tokens = m.num_draft_tokens;
}

int32_t count(size_t n) { return static_cast<int32_t>(n); }

}  // namespace

extern "C" {

pe_batch_manager_config pe_batch_manager_config_default(void) {
  const pyengine::BatchManagerConfig d;
  pe_batch_manager_config c;
  c.max_batch_size = d.max_batch_size;
  c.max_num_tokens = d.max_num_tokens;
  c.max_seq_len = d.max_seq_len;
  c.tokens_per_block = d.tokens_per_block;
  c.num_blocks = d.num_blocks;
  c.num_seq_slots = d.num_seq_slots;
  c.enable_chunked_context = d.enable_chunked_context ? 1 : 0;
  c.policy = static_cast<int32_t>(d.policy);
  c.vocab_size = d.vocab_size;
  c.enable_block_reuse = d.enable_block_reuse ? 1 : 0;
  c.queue_policy = static_cast<int32_t>(d.queue_policy);
  c.num_speculative_tokens = d.num_speculative_tokens;
  c.ngram_drafts = d.ngram_drafts ? 1 : 0;
  c.prompt_lookup_min = d.prompt_lookup_min;
  c.prompt_lookup_max = d.prompt_lookup_max;
  c.model_drafts = d.model_drafts ? 1 : 0;
  c.adaptive_draft_length = d.adaptive_draft_length ? 1 : 0;
  c.draft_row_cost = d.draft_row_cost;
  c.draft_propose_cost = d.draft_propose_cost;
  return c;
}

pe_status pe_batch_manager_create(const pe_batch_manager_config* config, pe_batch_manager** out) {
  return guarded([&] {
    require(out, "out");
    *out = nullptr;
    require(config, "config");
    if (config->policy < 0 || config->policy > 2)
      throw Error{PE_ERR_INVALID_ARGUMENT, "policy: must be 0, 1 or 2, got " + std::to_string(config->policy)};
    if (config->queue_policy < 0 || config->queue_policy > 1)
      throw Error{PE_ERR_INVALID_ARGUMENT,
                  "queue_policy: must be 0 or 1, got " + std::to_string(config->queue_policy)};
    pyengine::BatchManagerConfig c;
    c.max_batch_size = config->max_batch_size;
    c.max_num_tokens = config->max_num_tokens;
    c.max_seq_len = config->max_seq_len;
    c.tokens_per_block = config->tokens_per_block;
    c.num_blocks = config->num_blocks;
    c.num_seq_slots = config->num_seq_slots;
    c.enable_chunked_context = config->enable_chunked_context != 0;
    c.policy = static_cast<pyengine::CapacitySchedulerPolicy>(config->policy);
    c.vocab_size = config->vocab_size;
    c.enable_block_reuse = config->enable_block_reuse != 0;
    c.queue_policy = static_cast<pyengine::QueuePolicy>(config->queue_policy);
    c.num_speculative_tokens = config->num_speculative_tokens;
    c.ngram_drafts = config->ngram_drafts != 0;
    c.prompt_lookup_min = config->prompt_lookup_min;
    c.prompt_lookup_max = config->prompt_lookup_max;
    c.model_drafts = config->model_drafts != 0;
    c.adaptive_draft_length = config->adaptive_draft_length != 0;
    c.draft_row_cost = config->draft_row_cost;
    c.draft_propose_cost = config->draft_propose_cost;
    *out = new pe_batch_manager(c);
    return ok();
  });
}

void pe_batch_manager_free(pe_batch_manager* bm) { delete bm; }  // ~BatchManager does not throw

pe_request_params pe_request_params_default(void) {
  pe_request_params p;
  p.prompt = nullptr;
  p.prompt_len = 0;
  p.max_new_tokens = 16;
  p.min_new_tokens = 0;
  p.end_id = -1;
  p.stop_token_ids = nullptr;
  p.num_stop_token_ids = 0;
  p.priority = 0.5f;
  p.cache_salt = 0;
  p.reuse_prefix = 1;
  return p;
}

pe_status pe_batch_manager_add_request(pe_batch_manager* bm, int64_t id, const pe_request_params* params,
                                       double now) {
  return guarded([&] {
    require(bm, "bm");
    require(params, "params");
    if (params->num_stop_token_ids < 0)
      throw Error{PE_ERR_INVALID_ARGUMENT,
                  "num_stop_token_ids: must be >= 0, got " + std::to_string(params->num_stop_token_ids)};
    if (params->num_stop_token_ids > 0) require(params->stop_token_ids, "stop_token_ids");
    const std::vector<int32_t> stops(params->stop_token_ids, params->stop_token_ids + params->num_stop_token_ids);
    bm->bm.add_request(id, params->prompt, params->prompt_len, params->max_new_tokens, params->end_id, stops,
                       params->min_new_tokens, now, params->priority, params->cache_salt, params->reuse_prefix != 0);
    return ok();
  });
}

pe_status pe_batch_manager_set_draft_tokens(pe_batch_manager* bm, int64_t id, const int32_t* tokens, int32_t n) {
  return guarded([&] {
    require(bm, "bm");
    if (n < 0) throw Error{PE_ERR_INVALID_ARGUMENT, "n: must be >= 0, got " + std::to_string(n)};
    if (n > 0) require(tokens, "tokens");
    if (!bm->bm.set_draft_tokens(id, tokens, n)) unknown_request(id, " (or it is not generating)");
    return ok();
  });
}

pe_status pe_batch_manager_set_scheduled_draft_tokens(pe_batch_manager* bm, const int32_t* tokens, int32_t n) {
  return guarded([&] {
    require(bm, "bm");
    if (n > 0) require(tokens, "tokens");
    bm->bm.set_scheduled_draft_tokens(tokens, n);
    return ok();
  });
}

pe_status pe_batch_manager_set_max_draft_tokens(pe_batch_manager* bm, int64_t id, int32_t n) {
  return guarded([&] {
    require(bm, "bm");
    if (!bm->bm.set_max_draft_tokens(id, n)) unknown_request(id, "");
    return ok();
  });
}

pe_status pe_batch_manager_abort(pe_batch_manager* bm, int64_t id) {
  return guarded([&] {
    require(bm, "bm");
    if (!bm->bm.abort_request(id)) unknown_request(id, "");
    return ok();
  });
}

pe_status pe_batch_manager_finish_request(pe_batch_manager* bm, int64_t id, int32_t reason, double now) {
  return guarded([&] {
    require(bm, "bm");
    if (reason < PE_FINISH_NONE || reason > PE_FINISH_STOP_STRING)
      throw Error{PE_ERR_INVALID_ARGUMENT, "reason: not a pe_finish_reason: " + std::to_string(reason)};
    if (!bm->bm.finish_request(id, static_cast<pyengine::FinishReason>(reason), now))
      unknown_request(id, " (or not generating)");
    return ok();
  });
}

pe_status pe_batch_manager_schedule(pe_batch_manager* bm, double now, pe_forward_metadata* out) {
  return guarded([&] {
    require(bm, "bm");
    const pyengine::ForwardMetadata& m = bm->bm.schedule(now);
    if (out != nullptr) fill_metadata(m, out);
    return ok();
  });
}

pe_status pe_batch_manager_metadata(const pe_batch_manager* bm, pe_forward_metadata* out) {
  return guarded([&] {
    require(bm, "bm");
    require(out, "out");
    fill_metadata(bm->bm.metadata(), out);
    return ok();
  });
}

pe_status pe_batch_manager_update(pe_batch_manager* bm, const int32_t* tokens, int32_t num_tokens, double now) {
  return guarded([&] {
    require(bm, "bm");
    if (num_tokens > 0) require(tokens, "tokens");
    bm->bm.update(tokens, num_tokens, now);
    return ok();
  });
}

pe_status pe_batch_manager_free_finished(pe_batch_manager* bm) {
  return guarded([&] {
    require(bm, "bm");
    bm->bm.free_finished();
    return ok();
  });
}

pe_status pe_batch_manager_rollback(pe_batch_manager* bm) {
  return guarded([&] {
    require(bm, "bm");
    if (!bm->bm.rollback())
      throw Error{PE_ERR_INVALID_STATE, "rollback: no schedule to undo (valid between schedule and update)"};
    return ok();
  });
}

pe_status pe_batch_manager_events(const pe_batch_manager* bm, pe_step_events* out) {
  return guarded([&] {
    require(bm, "bm");
    require(out, "out");
    const pyengine::StepEvents& e = bm->bm.events();
    out->num_aborted = count(e.aborted.size());
    out->aborted = e.aborted.data();
    out->aborted_slots = e.aborted_slots.data();
    out->num_paused = count(e.paused.size());
    out->paused = e.paused.data();
    out->paused_slots = e.paused_slots.data();
    out->num_assigned = count(e.assigned.size());
    out->assigned = e.assigned.data();
    out->assigned_slots = e.assigned_slots.data();
    out->num_outputs = count(e.output_request_ids.size());
    out->output_request_ids = e.output_request_ids.data();
    out->logits_rows = e.logits_rows.data();
    out->tokens = e.tokens.data();
    out->finished = e.finished.data();
    out->finish_reasons = e.finish_reasons.data();
    return ok();
  });
}

pe_status pe_batch_manager_stats_get(const pe_batch_manager* bm, pe_batch_manager_stats* out) {
  return guarded([&] {
    require(bm, "bm");
    require(out, "out");
    out->num_requests = bm->bm.num_requests();
    out->num_waiting = bm->bm.num_waiting();
    out->num_active = bm->bm.num_active();
    out->has_unfinished = bm->bm.has_unfinished() ? 1 : 0;
    out->num_seq_slots = bm->bm.num_seq_slots();
    out->num_free_seq_slots = bm->bm.num_free_seq_slots();
    return ok();
  });
}

pe_status pe_batch_manager_request_info(const pe_batch_manager* bm, int64_t id, pe_request_info* out) {
  return guarded([&] {
    require(bm, "bm");
    require(out, "out");
    if (!bm->bm.contains(id)) unknown_request(id, "");
    const pyengine::RequestInfo r = bm->bm.request_info(id);
    out->id = r.id;
    out->state = static_cast<int32_t>(r.state);
    out->seq_slot = r.seq_slot;
    out->prompt_len = r.prompt_len;
    out->num_generated = r.num_generated;
    out->context_len = r.context_len;
    out->num_computed_tokens = r.num_computed_tokens;
    out->num_blocks = r.num_blocks;
    out->num_pauses = r.num_pauses;
    out->num_reused_tokens = r.num_reused_tokens;
    out->finish_reason = static_cast<int32_t>(r.finish_reason);
    out->stop_token = r.stop_token;
    out->arrival_time = r.arrival_time;
    out->first_scheduled_time = r.first_scheduled_time;
    out->first_token_time = r.first_token_time;
    out->finish_time = r.finish_time;
    out->num_draft_tokens = r.num_draft_tokens;
    out->num_accepted_draft_tokens = r.num_accepted_draft_tokens;
    return ok();
  });
}

pe_status pe_batch_manager_check_invariants(const pe_batch_manager* bm) {
  return guarded([&] {
    require(bm, "bm");
    try {
      bm->bm.check_invariants();
    } catch (const std::logic_error& e) {  // a broken invariant is the library's failure
      throw Error{PE_ERR_RUNTIME, e.what()};
    }
    return ok();
  });
}

pe_kv_cache* pe_batch_manager_kv_cache(pe_batch_manager* bm) { return bm == nullptr ? nullptr : &bm->kv; }

pe_status pe_kv_cache_stats_get(const pe_kv_cache* kv, pe_kv_cache_stats* out) {
  return guarded([&] {
    require(kv, "kv");
    require(out, "out");
    const BatchManager& bm = *kv->bm;
    out->num_blocks = bm.num_blocks();
    out->tokens_per_block = bm.tokens_per_block();
    out->num_free_blocks = bm.num_free_blocks();
    out->num_reusable_blocks = bm.num_reusable_blocks();
    out->total_reused_tokens = bm.total_reused_tokens();
    out->num_reuse_hits = bm.num_reuse_hits();
    return ok();
  });
}

pe_status pe_kv_cache_block_table(const pe_kv_cache* kv, int64_t id, int32_t* out, int32_t capacity,
                                  int32_t* num_blocks) {
  return guarded([&] {
    require(kv, "kv");
    require(num_blocks, "num_blocks");
    if (capacity < 0) throw Error{PE_ERR_INVALID_ARGUMENT, "capacity: must be >= 0, got " + std::to_string(capacity)};
    if (capacity > 0) require(out, "out");
    std::vector<int32_t> table;
    try {
      table = kv->bm->block_table(id);
    } catch (const std::logic_error& e) {  // no table: unknown, queued or retired
      throw Error{PE_ERR_NOT_FOUND, e.what()};
    }
    *num_blocks = count(table.size());
    if (*num_blocks > capacity)
      throw Error{PE_ERR_INVALID_ARGUMENT, "capacity: " + std::to_string(capacity) + " is less than the " +
                                               std::to_string(*num_blocks) + " blocks of request " +
                                               std::to_string(id)};
    for (int32_t i = 0; i < *num_blocks; ++i) out[i] = table[static_cast<size_t>(i)];
    return ok();
  });
}

}  // extern "C"
