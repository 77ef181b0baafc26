#include "batch_manager/scheduler.h"

#include <algorithm>
#include <string>
#include <unordered_set>

namespace pyengine {

MicroBatchScheduler::MicroBatchScheduler(int32_t max_batch_size, int32_t max_num_tokens,
                                         bool enable_chunked_context, int32_t chunk_unit)
    : max_batch_size_(max_batch_size),
      max_num_tokens_(max_num_tokens),
      enable_chunked_context_(enable_chunked_context),
      chunk_unit_(chunk_unit) {
  if (max_batch_size <= 0)
    throw std::invalid_argument("max_batch_size must be positive, got " + std::to_string(max_batch_size));
  if (max_num_tokens <= 0)
    throw std::invalid_argument("max_num_tokens must be positive, got " + std::to_string(max_num_tokens));
  if (chunk_unit <= 0)
    throw std::invalid_argument("chunk_unit must be positive, got " + std::to_string(chunk_unit));
  if (enable_chunked_context && max_num_tokens < chunk_unit)
    throw std::invalid_argument("max_num_tokens (" + std::to_string(max_num_tokens) +
                                ") must be at least the chunk unit (" + std::to_string(chunk_unit) +
                                ") with chunked context");
}

namespace {

// The batch's predicted time so far, against a step's time budget (none: everything fits).
class TimeLedger {
 public:
  explicit TimeLedger(const StepBudget* budget) : budget_(budget) {}

  void add(int64_t tokens, int64_t pairs) {
    ++seqs_;
    tokens_ += tokens;
    pairs_ += pairs;
  }
  // Tokens added to the sequences already counted (draft tokens of a generation row).
  void extend(int64_t tokens, int64_t pairs) {
    tokens_ += tokens;
    pairs_ += pairs;
  }
  bool extension_fits(int64_t tokens, int64_t pairs) const {
    return budget_ == nullptr || budget_->model.cost_ms(seqs_, tokens_ + tokens, pairs_ + pairs) <= budget_->budget_ms;
  }
  bool fits(int64_t tokens, int64_t pairs) const {
    return budget_ == nullptr ||
           budget_->model.cost_ms(seqs_ + 1, tokens_ + tokens, pairs_ + pairs) <= budget_->budget_ms;
  }
  // The longest chunk of a context request at `start` with `rest` tokens left, at most
  // `max_tokens`, that fits: its whole rest, else a multiple of `unit` (0 if none fits).
  int32_t longest_chunk(int32_t start, int32_t rest, int32_t max_tokens, int32_t unit, bool chunking) const {
    if (rest <= max_tokens && fits(rest, chunk_attention_pairs(start, rest))) return rest;
    if (!chunking) return 0;
    int32_t lo = 0, hi = std::min(rest - 1, max_tokens) / unit;  // in units; lo always fits
    while (lo < hi) {  // the cost grows with the chunk: the largest fitting count of units
      const int32_t mid = (lo + hi + 1) / 2;
      if (fits(int64_t{mid} * unit, chunk_attention_pairs(start, int64_t{mid} * unit)))
        lo = mid;
      else
        hi = mid - 1;
    }
    return lo * unit;
  }

 private:
  const StepBudget* budget_;
  int64_t seqs_ = 0, tokens_ = 0, pairs_ = 0;
};

}  // namespace

std::vector<Request*> MicroBatchScheduler::schedule(const std::vector<Request*>& fitting,
                                                   const KvCacheManager& kv, const StepBudget* time_budget) const {
  std::vector<Request*> batch;
  int32_t budget = max_num_tokens_;
  TimeLedger ledger(time_budget);
  for (Request* r : fitting) {
    r->chunk_size = 0;
    if (!r->in_generation()) continue;
    if (static_cast<int32_t>(batch.size()) >= max_batch_size_ || budget < 1) break;
    r->chunk_size = 1;
    budget -= 1;
    ledger.add(1, r->num_tokens());  // generation rows are not limited by the time budget
    batch.push_back(r);
  }
  // Draft tokens (speculative decoding) next: after every generation row has its token,
  // before any context chunk; the most of each request's drafts that fit the token budget
  // and the time budget (unlike the row's own token, drafts are optional).
  for (Request* r : batch) {
    int32_t d = std::min(static_cast<int32_t>(r->draft_tokens.size()), budget);
    const int64_t one_row = chunk_attention_pairs(r->context_pos, 1);
    while (d > 0 && !ledger.extension_fits(d, chunk_attention_pairs(r->context_pos, 1 + d) - one_row)) --d;
    if (d == 0) continue;
    r->chunk_size = 1 + d;
    budget -= d;
    ledger.extend(d, chunk_attention_pairs(r->context_pos, 1 + d) - one_row);
  }
  const int32_t tpb = kv.tokens_per_block();
  std::unordered_set<uint64_t> in_flight;  // keys of blocks this batch's context chunks complete
  for (Request* r : fitting) {
    if (r->in_generation()) continue;
    if (static_cast<int32_t>(batch.size()) >= max_batch_size_) break;
    int32_t start = r->context_pos;
    r->planned_reuse_blocks = 0;
    if (kv.reuse_enabled() && r->reuse_prefix && !kv.has_sequence(r->id)) {
      const int32_t reusable = probe_reuse(*r, kv).blocks;
      const size_t next = static_cast<size_t>(reusable);
      if (static_cast<int32_t>(next) < r->max_reusable_blocks(tpb) && next < r->block_keys.size() &&
          in_flight.count(r->block_keys[next]))
        continue;  // another request computes that block now: reuse it next step
      r->planned_reuse_blocks = reusable;
      start = reusable * tpb;
    }
    const int32_t rest = r->context_len - start;
    int32_t chunk;
    if (rest <= budget) {
      chunk = rest;
    } else if (enable_chunked_context_) {
      chunk = budget / chunk_unit_ * chunk_unit_;  // all chunks but the last are whole units
      if (chunk == 0) break;
    } else {
      continue;  // does not fit this step's budget; a shorter one behind it may
    }
    if (time_budget != nullptr) {
      chunk = ledger.longest_chunk(start, rest, chunk, chunk_unit_, enable_chunked_context_);
      if (chunk == 0 && batch.empty())  // progress: one unit (or the whole rest), whatever it costs
        chunk = enable_chunked_context_ ? std::min(rest, chunk_unit_) : rest;
      if (chunk == 0) continue;  // a shorter rest behind it may still fit
    }
    r->chunk_size = chunk;
    budget -= chunk;
    ledger.add(chunk, chunk_attention_pairs(start, chunk));
    batch.push_back(r);
    for (int32_t b = start / tpb; b < (start + chunk) / tpb && b < static_cast<int32_t>(r->block_keys.size()); ++b)
      in_flight.insert(r->block_keys[b]);
  }
  return batch;
}

}  // namespace pyengine
