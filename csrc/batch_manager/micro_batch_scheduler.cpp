#include "pyengine/scheduler.h"

#include <algorithm>
#include <string>

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

std::vector<Request*> MicroBatchScheduler::schedule(const std::vector<Request*>& fitting) const {
  std::vector<Request*> batch;
  int32_t budget = max_num_tokens_;
  for (Request* r : fitting) {
    r->chunk_size = 0;
    if (!r->in_generation()) continue;
    if (static_cast<int32_t>(batch.size()) >= max_batch_size_ || budget < 1) break;
    r->chunk_size = 1;
    budget -= 1;
    batch.push_back(r);
  }
  for (Request* r : fitting) {
    if (r->in_generation()) continue;
    if (static_cast<int32_t>(batch.size()) >= max_batch_size_) break;
    const int32_t rest = r->context_remaining();
    int32_t chunk;
    if (rest <= budget) {
      chunk = rest;
    } else if (enable_chunked_context_) {
      chunk = budget / chunk_unit_ * chunk_unit_;  // all chunks but the last are whole units
      if (chunk == 0) break;
    } else {
      continue;  // does not fit this step's budget; a shorter one behind it may
    }
    r->chunk_size = chunk;
    budget -= chunk;
    batch.push_back(r);
  }
  return batch;
}

}  // namespace pyengine
