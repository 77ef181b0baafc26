#include "pyengine/batch_manager.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <iterator>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "batch_manager/draft_length.h"
#include "batch_manager/ngram_proposer.h"
#include "batch_manager/request.h"
#include "batch_manager/resource_manager.h"
#include "batch_manager/scheduler.h"
#include "batch_manager/seq_slot_manager.h"
#include "batch_manager/waiting_queue.h"
#include "kv_cache/kv_cache_manager.h"

namespace pyengine {
namespace {

// Steps a request proposes nothing once the adaptive draft length finds no drafts worth
// their cost, before it probes with one (BatchManagerConfig::adaptive_draft_length).
constexpr int32_t kAdaptiveDraftPause = 8;

std::string str(int64_t v) { return std::to_string(v); }

void clear_events(StepEvents& e) {
  e.aborted.clear();
  e.aborted_slots.clear();
  e.paused.clear();
  e.paused_slots.clear();
  e.assigned.clear();
  e.assigned_slots.clear();
  e.output_request_ids.clear();
  e.logits_rows.clear();
  e.tokens.clear();
  e.finished.clear();
  e.finish_reasons.clear();
}

}  // namespace

// The batch manager's state and logic; BatchManager forwards to it.
struct BatchManager::Impl {
  explicit Impl(const BatchManagerConfig& config);

  void add_request(RequestId id, const TokenId* prompt, int32_t prompt_len, int32_t max_new_tokens,
                   TokenId end_id, const std::vector<TokenId>& stop_token_ids, int32_t min_new_tokens,
                   double now, float priority, uint64_t cache_salt, bool reuse_prefix);
  bool abort_request(RequestId id);
  bool remove_waiting(RequestId id);
  bool set_max_draft_tokens(RequestId id, int32_t n);
  bool set_draft_tokens(RequestId id, const TokenId* tokens, int32_t n);
  void set_scheduled_draft_tokens(const TokenId* tokens, int32_t n);
  // Throws std::invalid_argument for a draft token outside the vocabulary (when it is known).
  void check_draft_tokens(const TokenId* tokens, int32_t n) const;
  const ForwardMetadata& schedule(double now, const StepBudget* budget);
  void update(const TokenId* tokens, int32_t num_tokens, double now);
  bool finish_request(RequestId id, FinishReason reason, double now);
  void free_finished();
  bool rollback();
  const Request& request(RequestId id) const;  // throws std::out_of_range for an unknown id
  std::vector<RequestId> waiting_ids() const;
  std::vector<RequestId> active_ids() const;
  void check_invariants() const;

  void drop_aborted();
  // Journals schedule()'s changes so that rollback() can undo them.
  struct RequestSnapshot {
    Request* r;
    RequestState state;
    int32_t context_len, context_pos, chunk_size, num_pauses, num_cached_blocks, num_reused_tokens;
    SlotId seq_slot;
    int64_t start_order;
    double first_scheduled_time;
  };
  void snapshot(Request* r);
  void begin_transaction();
  void commit_transaction();
  // Test hook (inject_fault): the armed point throws once when reached.
  static constexpr const char* kFaultPoints[] = {"schedule.aborted", "schedule.capacity", "schedule.paused",
                                                 "schedule.admitted", "schedule.prepared", "schedule.filled"};
  std::string armed_fault_;
  void fault_point(const char* point);
  void inject_fault(const std::string& point);
  bool in_transaction_ = false;
  std::vector<RequestSnapshot> snapshots_;
  std::vector<Request*> saved_active_;
  std::deque<Request*> saved_waiting_;
  int64_t saved_start_counter_ = 0;
  int64_t saved_reused_tokens_ = 0, saved_reuse_hits_ = 0;
  void fill_metadata(const std::vector<Request*>& batch);
  // Speculative decoding: the drafts of every generating request for this step.
  int32_t draft_limit(const Request& r) const;
  void propose_drafts();
  // update() for a generation row at logits row k (its drafts' rows follow); returns its rows.
  int32_t update_generation(Request* r, const TokenId* tokens, int32_t k, double now);
  void register_full_blocks(Request* r);
  void emit(Request* r, int32_t row, TokenId token, bool done);
  void remove_active(Request* r);

  BatchManagerConfig config_;
  KvCacheManager kv_;
  SeqSlotManager slots_;
  CapacityScheduler capacity_;
  MicroBatchScheduler micro_batch_;
  ResourceManager resources_;
  KvCacheResourceManager* kv_resource_ = nullptr;  // owned by resources_

  std::unordered_map<RequestId, std::unique_ptr<Request>> requests_;
  WaitingQueue waiting_;
  std::vector<Request*> active_;     // holding resources, in start order
  std::vector<Request*> batch_;      // the last schedule()'s batch
  std::vector<Request*> finished_;   // finished by the last update(), not yet freed
  int64_t start_counter_ = 0;
  bool abort_pending_ = false;
  int64_t total_draft_tokens_ = 0, total_accepted_draft_tokens_ = 0;

  ForwardMetadata meta_;
  StepEvents events_;
  StepCostModel step_cost_;  // for schedule(now, budget_ms)
};

BatchManager::Impl::Impl(const BatchManagerConfig& config)
    : config_(config),
      kv_(config.num_blocks, config.tokens_per_block, config.enable_block_reuse),
      slots_(config.num_seq_slots > 0 ? config.num_seq_slots : config.max_batch_size),
      capacity_(config.policy, slots_.num_slots(), config.enable_chunked_context, config.queue_policy),
      micro_batch_(config.max_batch_size, config.max_num_tokens, config.enable_chunked_context,
                   config.tokens_per_block),
      waiting_(config.queue_policy) {
  if (config.max_seq_len <= 0)
    throw std::invalid_argument("max_seq_len must be positive, got " + str(config.max_seq_len));
  if (config.num_speculative_tokens < 0 || config.num_speculative_tokens >= config.max_num_tokens)
    throw std::invalid_argument("num_speculative_tokens must be in [0, max_num_tokens=" + str(config.max_num_tokens) +
                                "), got " + str(config.num_speculative_tokens));
  if (config.ngram_drafts && config.model_drafts)
    throw std::invalid_argument("ngram_drafts and model_drafts are two sources of drafts: set one");
  if (config.prompt_lookup_min < 1 || config.prompt_lookup_max < config.prompt_lookup_min)
    throw std::invalid_argument("prompt lookup n-gram sizes must satisfy 1 <= prompt_lookup_min <= "
                                "prompt_lookup_max, got " + str(config.prompt_lookup_min) + " and " +
                                str(config.prompt_lookup_max));
  if (!(config.draft_row_cost >= 0.0 && config.draft_row_cost < 1e6) ||
      !(config.draft_propose_cost >= 0.0 && config.draft_propose_cost < 1e6))
    throw std::invalid_argument("draft_row_cost and draft_propose_cost must be finite and >= 0, got " +
                                std::to_string(config.draft_row_cost) + " and " +
                                std::to_string(config.draft_propose_cost));
  resources_.add(std::make_unique<SeqSlotResourceManager>(slots_));
  auto kv_resource = std::make_unique<KvCacheResourceManager>(kv_, config.tokens_per_block);
  kv_resource_ = kv_resource.get();
  resources_.add(std::move(kv_resource));

  meta_.max_blocks_per_seq = kv_.blocks_for_tokens(config.max_seq_len);
  const size_t T = config.max_num_tokens, B = config.max_batch_size;
  meta_.input_ids.assign(T, 0);
  meta_.positions.assign(T, 0);
  meta_.slot_mapping.assign(T, 0);
  meta_.query_start_loc.assign(B + 1, 0);
  meta_.seq_lens.assign(B, 0);
  meta_.seq_slots.assign(B, 0);
  meta_.request_ids.assign(B, 0);
  meta_.block_tables.assign(B * meta_.max_blocks_per_seq, 0);
  const size_t L = std::max(T, B);  // logits rows: one per token of a generation row with drafts
  meta_.logits_indices.assign(L, 0);
  meta_.logits_slots.assign(L, 0);
  meta_.logits_request_ids.assign(L, 0);
  meta_.logits_offsets.assign(L, 0);
}

void BatchManager::Impl::add_request(RequestId id, const TokenId* prompt, int32_t prompt_len,
                                     int32_t max_new_tokens, TokenId end_id,
                                     const std::vector<TokenId>& stop_token_ids, int32_t min_new_tokens,
                                     double now, float priority, uint64_t cache_salt,
                                     bool reuse_prefix) {
  if (requests_.count(id)) throw std::invalid_argument("request_id " + str(id) + " is already in use");
  if (prompt_len <= 0 || prompt == nullptr) throw std::invalid_argument("prompt is empty");
  if (config_.vocab_size > 0)
    for (int32_t i = 0; i < prompt_len; ++i)
      if (prompt[i] < 0 || prompt[i] >= config_.vocab_size)
        throw std::invalid_argument("prompt token id " + str(prompt[i]) + " at position " + str(i) +
                                    " is outside the vocabulary [0, " + str(config_.vocab_size) + ")");
  if (max_new_tokens < 1)
    throw std::invalid_argument("max_tokens must be at least 1, got " + str(max_new_tokens));
  if (min_new_tokens < 0 || min_new_tokens > max_new_tokens)
    throw std::invalid_argument("min_tokens must be in [0, max_tokens=" + str(max_new_tokens) + "], got " +
                                str(min_new_tokens));
  const int64_t total = int64_t{prompt_len} + max_new_tokens;
  if (total > config_.max_seq_len)
    throw std::invalid_argument("prompt length " + str(prompt_len) + " + max_tokens " + str(max_new_tokens) +
                                " = " + str(total) + " exceeds max_seq_len " + str(config_.max_seq_len));
  if (kv_.blocks_for_tokens(static_cast<int32_t>(total)) > kv_.num_blocks())
    throw std::invalid_argument("prompt length " + str(prompt_len) + " + max_tokens " + str(max_new_tokens) +
                                " needs " + str(kv_.blocks_for_tokens(static_cast<int32_t>(total))) +
                                " KV blocks; the pool has " + str(kv_.num_blocks()));
  if (!config_.enable_chunked_context) {
    // Without chunking a context runs in one forward; a paused request is recomputed with
    // its generated tokens, so under max-utilization the longest context is total - 1.
    const int64_t longest =
        config_.policy == CapacitySchedulerPolicy::kMaxUtilization ? total - 1 : int64_t{prompt_len};
    if (longest > config_.max_num_tokens)
      throw std::invalid_argument("a context of " + str(longest) + " tokens exceeds max_num_tokens " +
                                  str(config_.max_num_tokens) + " and chunked prefill is off");
  }
  auto req = std::make_unique<Request>(id, std::vector<TokenId>(prompt, prompt + prompt_len), max_new_tokens,
                                       end_id, stop_token_ids, min_new_tokens, now);
  req->priority = priority;
  req->cache_root = KvCacheManager::root_key(cache_salt);
  req->reuse_prefix = reuse_prefix;
  req->max_draft_tokens = config_.num_speculative_tokens;
  if (kv_.reuse_enabled()) req->update_block_keys(kv_.tokens_per_block());
  waiting_.push(req.get());
  requests_.emplace(id, std::move(req));
}

bool BatchManager::Impl::abort_request(RequestId id) {
  auto it = requests_.find(id);
  if (it == requests_.end() || it->second->is_finished()) return false;
  it->second->abort_requested = true;
  abort_pending_ = true;
  return true;
}

bool BatchManager::Impl::remove_waiting(RequestId id) {
  auto it = requests_.find(id);
  if (it == requests_.end() || it->second->state != RequestState::kWaiting || it->second->seq_slot >= 0 ||
      kv_.has_sequence(id))
    return false;
  waiting_.erase(it->second.get());
  requests_.erase(it);
  return true;
}

bool BatchManager::Impl::set_max_draft_tokens(RequestId id, int32_t n) {
  if (n < 0 || n > config_.num_speculative_tokens)
    throw std::invalid_argument("max_draft_tokens must be in [0, num_speculative_tokens=" +
                                str(config_.num_speculative_tokens) + "], got " + str(n));
  auto it = requests_.find(id);
  if (it == requests_.end()) return false;
  it->second->max_draft_tokens = n;
  return true;
}

void BatchManager::Impl::check_draft_tokens(const TokenId* tokens, int32_t n) const {
  if (config_.vocab_size > 0)
    for (int32_t i = 0; i < n; ++i)
      if (tokens[i] < 0 || tokens[i] >= config_.vocab_size)
        throw std::invalid_argument("draft token id " + str(tokens[i]) + " is outside the vocabulary [0, " +
                                    str(config_.vocab_size) + ")");
}

bool BatchManager::Impl::set_draft_tokens(RequestId id, const TokenId* tokens, int32_t n) {
  if (n < 0 || (n > 0 && tokens == nullptr)) throw std::invalid_argument("set_draft_tokens: no tokens");
  check_draft_tokens(tokens, n);
  auto it = requests_.find(id);
  if (it == requests_.end() || !it->second->in_generation()) return false;
  Request* r = it->second.get();
  r->draft_tokens.assign(tokens, tokens + n);
  r->drafts_from_caller = true;
  return true;
}

void BatchManager::Impl::set_scheduled_draft_tokens(const TokenId* tokens, int32_t n) {
  if (n != meta_.num_draft_tokens)
    throw std::invalid_argument("set_scheduled_draft_tokens: the batch has " + str(meta_.num_draft_tokens) +
                                " draft tokens, got " + str(n));
  if (n > 0 && tokens == nullptr) throw std::invalid_argument("set_scheduled_draft_tokens: no tokens");
  check_draft_tokens(tokens, n);
  // generation sequences come first; a sequence's rows are its last token, then its drafts
  int32_t k = 0;
  for (int32_t s = 0; s < meta_.num_generation_seqs; ++s) {
    Request* r = batch_[static_cast<size_t>(s)];
    const int32_t row = meta_.query_start_loc[static_cast<size_t>(s)];
    const int32_t drafts = meta_.query_start_loc[static_cast<size_t>(s) + 1] - row - 1;
    for (int32_t j = 0; j < drafts; ++j, ++k) {
      meta_.input_ids[static_cast<size_t>(row + 1 + j)] = tokens[k];
      // (a request the caller ended since the schedule has dropped its drafts: update() skips it)
      if (static_cast<size_t>(j) < r->draft_tokens.size()) r->draft_tokens[static_cast<size_t>(j)] = tokens[k];
    }
  }
}

int32_t BatchManager::Impl::draft_limit(const Request& r) const {
  // never past max_new_tokens: the drafts and the token after them are all generated tokens
  return std::max(0, std::min(r.max_draft_tokens, r.max_new_tokens - r.num_generated() - 1));
}

void BatchManager::Impl::propose_drafts() {
  double cost = 0.0;
  if (config_.adaptive_draft_length) {
    const auto generating = std::count_if(active_.begin(), active_.end(), [](const Request* r) { return r->in_generation(); });
    cost = draft_token_cost(config_.draft_row_cost, config_.draft_propose_cost, static_cast<int32_t>(generating));
  }
  for (Request* r : active_) {
    if (!r->in_generation()) continue;
    int32_t limit = draft_limit(*r);
    if (!r->drafts_from_caller) {
      r->draft_tokens.clear();
      if (r->draft_pause > 0) {
        --r->draft_pause;  // backing off (Request::draft_misses), or an adaptive pause
        continue;
      }
      if (config_.adaptive_draft_length && limit > 0) {
        const int32_t k = best_draft_count(r->draft_acceptance.rate(), cost, limit);
        if (k == 0 && !r->draft_probe) {  // drafts do not pay: none for 8 steps, then a probe
          r->draft_pause = kAdaptiveDraftPause - 1;
          r->draft_probe = true;
          continue;
        }
        limit = std::max(k, 1);
        r->draft_probe = false;
      }
      if (config_.ngram_drafts && limit > 0) {
        r->draft_tokens = propose_ngram(r->tokens, config_.prompt_lookup_min, config_.prompt_lookup_max, limit);
      } else if (config_.model_drafts && limit > 0) {
        r->draft_tokens.assign(static_cast<size_t>(limit), 0);  // placeholders: set_scheduled_draft_tokens
      }
    } else if (static_cast<int32_t>(r->draft_tokens.size()) > limit) {
      r->draft_tokens.resize(static_cast<size_t>(limit));
    }
  }
}

const Request& BatchManager::Impl::request(RequestId id) const {
  auto it = requests_.find(id);
  if (it == requests_.end()) throw std::out_of_range("unknown request_id " + str(id));
  return *it->second;
}

std::vector<RequestId> BatchManager::Impl::waiting_ids() const {
  std::vector<RequestId> ids;
  for (const Request* r : waiting_.requests()) ids.push_back(r->id);
  return ids;
}

std::vector<RequestId> BatchManager::Impl::active_ids() const {
  std::vector<RequestId> ids;
  for (const Request* r : active_) ids.push_back(r->id);
  return ids;
}

void BatchManager::Impl::remove_active(Request* r) {
  active_.erase(std::remove(active_.begin(), active_.end(), r), active_.end());
}

void BatchManager::Impl::drop_aborted() {
  if (!abort_pending_) return;
  abort_pending_ = false;
  std::vector<Request*> dropped;
  for (auto& kv : requests_)
    if (kv.second->abort_requested) dropped.push_back(kv.second.get());
  std::sort(dropped.begin(), dropped.end(), [](const Request* a, const Request* b) { return a->id < b->id; });
  for (Request* r : dropped) {
    events_.aborted.push_back(r->id);
    events_.aborted_slots.push_back(r->seq_slot);
    resources_.free(*r);  // KV, then slot
    remove_active(r);
    waiting_.erase(r);
    requests_.erase(r->id);
  }
}

void BatchManager::Impl::snapshot(Request* r) {
  snapshots_.push_back({r, r->state, r->context_len, r->context_pos, r->chunk_size, r->num_pauses,
                        r->num_cached_blocks, r->num_reused_tokens, r->seq_slot, r->start_order,
                        r->first_scheduled_time});
}

void BatchManager::Impl::begin_transaction() {
  commit_transaction();
  // The copies that may throw (bad_alloc) come first: if one does, nothing is journaled and
  // nothing has changed.
  snapshots_.clear();
  saved_active_ = active_;
  saved_waiting_ = waiting_.requests();
  for (Request* r : active_) snapshot(r);
  saved_start_counter_ = start_counter_;
  saved_reused_tokens_ = kv_resource_->total_reused_tokens();
  saved_reuse_hits_ = kv_resource_->num_reuse_hits();
  kv_.begin();
  slots_.begin();
  in_transaction_ = true;
}

void BatchManager::Impl::fault_point(const char* point) {
  if (armed_fault_.empty() || armed_fault_ != point) return;
  armed_fault_.clear();
  throw std::runtime_error(std::string("injected fault at ") + point);
}

void BatchManager::Impl::inject_fault(const std::string& point) {
  if (!point.empty() && std::find(std::begin(kFaultPoints), std::end(kFaultPoints), point) == std::end(kFaultPoints)) {
    std::string known;
    for (const char* p : kFaultPoints) known += (known.empty() ? "" : ", ") + std::string(p);
    throw std::invalid_argument("inject_fault: unknown point '" + point + "' (known: " + known + ")");
  }
  armed_fault_ = point;
}

void BatchManager::Impl::commit_transaction() {
  if (!in_transaction_) return;
  in_transaction_ = false;
  kv_.commit();
  slots_.commit();
  snapshots_.clear();
}

bool BatchManager::Impl::rollback() {
  if (!in_transaction_) return false;
  in_transaction_ = false;
  kv_.rollback();
  slots_.rollback();
  for (auto it = snapshots_.rbegin(); it != snapshots_.rend(); ++it) {
    Request* r = it->r;
    if (!r->is_finished()) r->state = it->state;  // an end decided since (a stop string) stands
    r->context_len = it->context_len;
    r->context_pos = it->context_pos;
    r->chunk_size = 0;
    r->num_pauses = it->num_pauses;
    r->num_cached_blocks = it->num_cached_blocks;
    r->num_reused_tokens = it->num_reused_tokens;
    r->seq_slot = it->seq_slot;
    r->start_order = it->start_order;
    r->first_scheduled_time = it->first_scheduled_time;
    r->planned_reuse_blocks = 0;
    r->clear_drafts();
  }
  snapshots_.clear();
  events_.assigned.clear();  // nobody holds what the undone schedule assigned
  events_.assigned_slots.clear();
  active_ = saved_active_;
  // The queue as the schedule found it (its pauses included), less what ended since: a
  // request the schedule paused that the caller then ended (finish_request).
  saved_waiting_.erase(std::remove_if(saved_waiting_.begin(), saved_waiting_.end(),
                                      [](const Request* r) { return r->is_finished(); }),
                       saved_waiting_.end());
  waiting_.restore(std::move(saved_waiting_));
  start_counter_ = saved_start_counter_;
  kv_resource_->restore_stats(saved_reused_tokens_, saved_reuse_hits_);
  batch_.clear();
  meta_.num_tokens = meta_.num_seqs = meta_.num_generation_seqs = meta_.num_logits = meta_.num_draft_tokens = 0;
  return true;
}

const ForwardMetadata& BatchManager::Impl::schedule(double now, const StepBudget* budget) {
  // A finished request left in the active list would be scheduled as a context chunk of
  // negative length (and widen the token budget past the metadata buffers).
  for (const Request* r : active_)
    if (r->is_finished())
      throw std::logic_error("request " + str(r->id) + " is finished but not retired: free_finished() must run "
                             "before schedule()");
  commit_transaction();
  clear_events(events_);
  drop_aborted();  // aborts are committed: they never come back
  fault_point("schedule.aborted");

  CapacitySchedule cap = capacity_.schedule(active_, waiting_.requests(), kv_);
  fault_point("schedule.capacity");
  // Pause: free first, then requeue at the front (earliest started ends up first). Pauses
  // are committed too, before the transaction: this step's forward may write into the
  // blocks they free, so a rollback must not hand those blocks back to them.
  for (Request* r : cap.paused) {
    events_.paused.push_back(r->id);
    events_.paused_slots.push_back(r->seq_slot);
    resources_.free(*r);
    remove_active(r);
    r->reset_for_recompute();
  }
  for (Request* r : cap.paused) waiting_.push_front(r);
  fault_point("schedule.paused");
  // Strong guarantee from here: whatever throws, the transaction is rolled back (the aborts
  // and pauses above stand, as after a rollback by the caller) before the exception leaves.
  begin_transaction();
  try {
    snapshots_.reserve(snapshots_.size() + cap.admitted.size());
    for (Request* r : cap.admitted) snapshot(r);
    for (Request* r : cap.admitted) {
      waiting_.erase(r);
      r->state = RequestState::kContextInProgress;
      r->start_order = start_counter_++;
      active_.push_back(r);
    }
    fault_point("schedule.admitted");

    if (config_.num_speculative_tokens > 0) propose_drafts();
    batch_ = micro_batch_.schedule(active_, kv_, budget);
    for (Request* r : batch_)
      if (r->seq_slot < 0) events_.assigned.push_back(r->id);
    resources_.prepare(batch_);
    fault_point("schedule.prepared");
    for (RequestId id : events_.assigned) events_.assigned_slots.push_back(requests_.at(id)->seq_slot);
    for (Request* r : batch_)
      if (r->first_scheduled_time < 0) r->first_scheduled_time = now;
    fill_metadata(batch_);
    fault_point("schedule.filled");
  } catch (...) {
    rollback();
    throw;
  }
  return meta_;
}

void BatchManager::Impl::fill_metadata(const std::vector<Request*>& batch) {
  const int32_t tpb = kv_.tokens_per_block();
  const int32_t mbps = meta_.max_blocks_per_seq;
  int32_t nt = 0, nl = 0, ngen = 0, ndraft = 0;
  for (size_t s = 0; s < batch.size(); ++s) {
    const Request* r = batch[s];
    const int32_t start = r->context_pos;
    const int32_t len = r->chunk_size;
    const std::vector<BlockId>& table = kv_.block_table(r->id);
    meta_.query_start_loc[s] = nt;
    const bool generating = r->in_generation();
    for (int32_t j = 0; j < len; ++j, ++nt) {
      const int32_t pos = start + j;
      // a generation row: its last sampled token, then its drafts
      meta_.input_ids[nt] = generating && j > 0 ? r->draft_tokens[static_cast<size_t>(j - 1)] : r->tokens[pos];
      meta_.positions[nt] = pos;
      meta_.slot_mapping[nt] = table[pos / tpb] * tpb + pos % tpb;
      if (generating) {
        meta_.logits_indices[nl] = nt;
        meta_.logits_slots[nl] = r->seq_slot;
        meta_.logits_request_ids[nl] = r->id;
        meta_.logits_offsets[nl] = j;
        ++nl;
      }
    }
    meta_.seq_lens[s] = start + len;
    meta_.seq_slots[s] = r->seq_slot;
    meta_.request_ids[s] = r->id;
    std::copy(table.begin(), table.end(), meta_.block_tables.begin() + static_cast<std::ptrdiff_t>(s) * mbps);
    if (generating) {
      ++ngen;
      ndraft += len - 1;
    }
    if (!generating && start + len == r->context_len) {
      meta_.logits_indices[nl] = nt - 1;
      meta_.logits_slots[nl] = r->seq_slot;
      meta_.logits_request_ids[nl] = r->id;
      meta_.logits_offsets[nl] = 0;
      ++nl;
    }
  }
  meta_.query_start_loc[batch.size()] = nt;
  meta_.num_tokens = nt;
  meta_.num_seqs = static_cast<int32_t>(batch.size());
  meta_.num_generation_seqs = ngen;
  meta_.num_draft_tokens = ndraft;
  meta_.num_logits = nl;
}

void BatchManager::Impl::update(const TokenId* tokens, int32_t num_tokens, double now) {
  if (num_tokens != meta_.num_logits)
    throw std::invalid_argument("update() got " + str(num_tokens) + " tokens for " + str(meta_.num_logits) +
                                " logits rows");
  commit_transaction();
  int32_t k = 0;
  for (Request* r : batch_) {
    if (r->is_finished()) {  // ended by the caller after this batch was scheduled (it was generating)
      k += r->chunk_size;    // discard its tokens
      r->clear_drafts();
      continue;
    }
    if (r->in_generation()) {
      k += update_generation(r, tokens, k, now);
      continue;
    }
    r->context_pos += r->chunk_size;
    register_full_blocks(r);
    if (r->context_pos < r->context_len) continue;  // more chunks to go: no token yet
    r->state = RequestState::kGenerationInProgress;
    const int32_t row = k++;
    emit(r, row, tokens[row], r->append_token(tokens[row], now));
  }
  batch_.clear();
}

int32_t BatchManager::Impl::update_generation(Request* r, const TokenId* tokens, int32_t k, double now) {
  const int32_t rows = r->chunk_size;
  const int32_t drafts = rows - 1;
  // a draft is accepted while it equals the token sampled at the row before it
  int32_t accepted = 0;
  while (accepted < drafts && tokens[k + accepted] == r->draft_tokens[static_cast<size_t>(accepted)]) ++accepted;
  int32_t emitted = 0;
  bool done = false;
  while (emitted <= accepted && !done) {
    const TokenId t = tokens[k + emitted];
    done = r->append_token(t, now);
    emit(r, k + emitted, t, done);
    ++emitted;
  }
  r->num_draft_tokens += drafts;
  r->num_accepted_draft_tokens += accepted;
  if (drafts > 0 && !r->drafts_from_caller) {
    r->draft_acceptance.observe(accepted, drafts);
    r->draft_misses = accepted > 0 ? 0 : r->draft_misses + 1;
    // (a draft model backs off for 4 steps at most: its acceptance changes with the text, and
    // its drafts cost less than a missed run of accepted ones)
    if (r->draft_misses >= 2) r->draft_pause = 1 << std::min(r->draft_misses - 2, config_.model_drafts ? 2 : 6);
  }
  total_draft_tokens_ += drafts;
  total_accepted_draft_tokens_ += accepted;
  r->clear_drafts();
  // the KV of the row's token and of the drafts emitted after it is valid; the rest is rewound
  r->context_pos += emitted;
  if (drafts > 0) kv_.truncate(r->id, r->context_pos);
  register_full_blocks(r);
  return rows;
}

void BatchManager::Impl::register_full_blocks(Request* r) {
  const int32_t full_blocks = r->context_pos / kv_.tokens_per_block();
  if (kv_.reuse_enabled() && full_blocks > r->num_cached_blocks) {
    r->update_block_keys(kv_.tokens_per_block());
    kv_.cache_blocks(r->id, r->block_keys, r->tokens, r->cache_root, full_blocks);
    r->num_cached_blocks = full_blocks;
  }
}

void BatchManager::Impl::emit(Request* r, int32_t row, TokenId token, bool done) {
  if (kv_.reuse_enabled()) r->update_block_keys(kv_.tokens_per_block());
  events_.output_request_ids.push_back(r->id);
  events_.logits_rows.push_back(row);
  events_.tokens.push_back(token);
  events_.finished.push_back(done ? 1 : 0);
  events_.finish_reasons.push_back(static_cast<int32_t>(r->finish_reason));
  if (done) finished_.push_back(r);
}

bool BatchManager::Impl::finish_request(RequestId id, FinishReason reason, double now) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return false;
  Request* r = it->second.get();
  // Generating, or paused by the schedule since its last token (it holds nothing then).
  const bool paused = r->state == RequestState::kWaiting && r->num_generated() > 0;
  if (!r->in_generation() && !paused) return false;
  if (paused) waiting_.erase(r);
  r->finish(reason, now);
  finished_.push_back(r);
  return true;
}

void BatchManager::Impl::free_finished() {
  for (Request* r : finished_) {
    resources_.free(*r);
    remove_active(r);
    requests_.erase(r->id);
  }
  finished_.clear();
}

void BatchManager::Impl::check_invariants() const {
  kv_.check_invariants();
  int32_t holders = 0;  // requests that believe they hold a sequence slot
  for (const auto& kv : requests_) {
    const Request& r = *kv.second;
    if (r.is_finished() && std::find(finished_.begin(), finished_.end(), &r) == finished_.end())
      throw std::logic_error("finished request " + str(r.id) + " was not retired");
    if (r.seq_slot >= 0) {
      ++holders;
      if (slots_.slot_of(r.id) != r.seq_slot)
        throw std::logic_error("request " + str(r.id) + " believes it holds sequence slot " + str(r.seq_slot));
    }
    if (r.state == RequestState::kWaiting && (r.seq_slot >= 0 || kv_.has_sequence(r.id)))
      throw std::logic_error("waiting request " + str(r.id) + " holds resources");
  }
  if (holders != slots_.num_slots() - slots_.num_free())
    throw std::logic_error("sequence slots held (" + str(slots_.num_slots() - slots_.num_free()) +
                           ") differ from requests holding one (" + str(holders) + ")");
  if (kv_.num_sequences() > static_cast<int32_t>(active_.size()) + static_cast<int32_t>(finished_.size()))
    throw std::logic_error("more block tables than active requests");
}

// ---- BatchManager: the public face, forwarding to Impl ----

BatchManager::BatchManager(const BatchManagerConfig& config) : impl_(std::make_unique<Impl>(config)) {}
BatchManager::~BatchManager() = default;
BatchManager::BatchManager(BatchManager&&) noexcept = default;
BatchManager& BatchManager::operator=(BatchManager&&) noexcept = default;

void BatchManager::add_request(RequestId id, const TokenId* prompt, int32_t prompt_len, int32_t max_new_tokens,
                               TokenId end_id, const std::vector<TokenId>& stop_token_ids,
                               int32_t min_new_tokens, double now, float priority, uint64_t cache_salt,
                               bool reuse_prefix) {
  impl_->add_request(id, prompt, prompt_len, max_new_tokens, end_id, stop_token_ids, min_new_tokens, now,
                     priority, cache_salt, reuse_prefix);
}
bool BatchManager::abort_request(RequestId id) { return impl_->abort_request(id); }
bool BatchManager::remove_waiting(RequestId id) { return impl_->remove_waiting(id); }
bool BatchManager::set_max_draft_tokens(RequestId id, int32_t n) { return impl_->set_max_draft_tokens(id, n); }
bool BatchManager::set_draft_tokens(RequestId id, const TokenId* tokens, int32_t n) {
  return impl_->set_draft_tokens(id, tokens, n);
}
void BatchManager::set_scheduled_draft_tokens(const TokenId* tokens, int32_t n) {
  impl_->set_scheduled_draft_tokens(tokens, n);
}
const ForwardMetadata& BatchManager::schedule(double now) { return impl_->schedule(now, nullptr); }

const ForwardMetadata& BatchManager::schedule(double now, double budget_ms) {
  if (!(std::isfinite(budget_ms) && budget_ms > 0.0))
    throw std::invalid_argument("the step's time budget must be a positive number of milliseconds, got " +
                                std::to_string(budget_ms));
  const StepBudget budget{impl_->step_cost_, budget_ms};
  return impl_->schedule(now, &budget);
}

void BatchManager::set_step_cost_model(const StepCostModel& model) {
  const std::pair<const char*, double> coefficients[] = {{"fixed_ms", model.fixed_ms},
                                                         {"per_seq_ms", model.per_seq_ms},
                                                         {"per_token_ms", model.per_token_ms},
                                                         {"per_kpair_ms", model.per_kpair_ms}};
  for (const auto& [name, value] : coefficients)
    if (!(std::isfinite(value) && value >= 0.0))
      throw std::invalid_argument(std::string("step cost model: ") + name +
                                  " must be a finite number >= 0, got " + std::to_string(value));
  impl_->step_cost_ = model;
}

const StepCostModel& BatchManager::step_cost_model() const { return impl_->step_cost_; }
void BatchManager::update(const TokenId* tokens, int32_t num_tokens, double now) {
  impl_->update(tokens, num_tokens, now);
}
bool BatchManager::finish_request(RequestId id, FinishReason reason, double now) {
  return impl_->finish_request(id, reason, now);
}
void BatchManager::free_finished() { impl_->free_finished(); }
bool BatchManager::rollback() { return impl_->rollback(); }
void BatchManager::inject_fault(const std::string& point) { impl_->inject_fault(point); }

bool BatchManager::has_unfinished() const { return !impl_->requests_.empty(); }
int32_t BatchManager::num_requests() const { return static_cast<int32_t>(impl_->requests_.size()); }
int32_t BatchManager::num_waiting() const { return static_cast<int32_t>(impl_->waiting_.size()); }
int32_t BatchManager::num_active() const { return static_cast<int32_t>(impl_->active_.size()); }
bool BatchManager::contains(RequestId id) const { return impl_->requests_.count(id) != 0; }
std::vector<RequestId> BatchManager::waiting_ids() const { return impl_->waiting_ids(); }
std::vector<RequestId> BatchManager::active_ids() const { return impl_->active_ids(); }

RequestInfo BatchManager::request_info(RequestId id) const {
  const Request& r = impl_->request(id);
  RequestInfo info;
  info.id = r.id;
  info.state = r.state;
  info.seq_slot = r.seq_slot;
  info.prompt_len = r.prompt_len;
  info.num_generated = r.num_generated();
  info.context_len = r.context_len;
  info.num_computed_tokens = r.context_pos;
  info.num_blocks = impl_->kv_.num_blocks_of(id);
  info.num_pauses = r.num_pauses;
  info.num_reused_tokens = r.num_reused_tokens;
  info.arrival_time = r.arrival_time;
  info.first_scheduled_time = r.first_scheduled_time;
  info.first_token_time = r.first_token_time;
  info.finish_time = r.finish_time;
  info.finish_reason = r.finish_reason;
  info.stop_token = r.stop_token;
  info.num_draft_tokens = r.num_draft_tokens;
  info.num_accepted_draft_tokens = r.num_accepted_draft_tokens;
  return info;
}

std::vector<BlockId> BatchManager::block_table(RequestId id) const { return impl_->kv_.block_table(id); }

int64_t BatchManager::total_reused_tokens() const { return impl_->kv_resource_->total_reused_tokens(); }
int64_t BatchManager::num_reuse_hits() const { return impl_->kv_resource_->num_reuse_hits(); }
int64_t BatchManager::total_draft_tokens() const { return impl_->total_draft_tokens_; }
int64_t BatchManager::total_accepted_draft_tokens() const { return impl_->total_accepted_draft_tokens_; }
std::vector<CachedBlockRecord> BatchManager::export_cached_blocks() const {
  if (has_unfinished()) throw std::logic_error("export_cached_blocks: requests are in flight; the engine must be idle");
  return impl_->kv_.export_cached();
}

std::vector<BlockId> BatchManager::import_cached_blocks(const std::vector<CachedBlockRecord>& records) {
  if (has_unfinished()) throw std::logic_error("import_cached_blocks: requests are in flight; the engine must be idle");
  impl_->commit_transaction();  // idle: the last step holds nothing a rollback could restore
  return impl_->kv_.import_cached(records);
}

int32_t BatchManager::num_blocks() const { return impl_->kv_.num_blocks(); }
int32_t BatchManager::num_free_blocks() const { return impl_->kv_.num_free_blocks(); }
int32_t BatchManager::num_reusable_blocks() const { return impl_->kv_.num_reusable_blocks(); }
int32_t BatchManager::tokens_per_block() const { return impl_->kv_.tokens_per_block(); }
int32_t BatchManager::num_seq_slots() const { return impl_->slots_.num_slots(); }
int32_t BatchManager::num_free_seq_slots() const { return impl_->slots_.num_free(); }
void BatchManager::check_all_seq_slots_free() const { impl_->slots_.check_all_free(); }

const ForwardMetadata& BatchManager::metadata() const { return impl_->meta_; }
const StepEvents& BatchManager::events() const { return impl_->events_; }
const BatchManagerConfig& BatchManager::config() const { return impl_->config_; }
void BatchManager::check_invariants() const { impl_->check_invariants(); }

}  // namespace pyengine
