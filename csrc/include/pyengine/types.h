// Basic types shared by the whole C++ core and seen by its callers: ids, errors, and the
// enums of the batch manager's configuration and of its per-request reports.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace pyengine {

using TokenId = int32_t;
using RequestId = int64_t;
using SlotId = int32_t;   // a sequence slot: the row of every per-request array that lives across steps
using BlockId = int32_t;  // a block of the paged KV cache

// Thrown when a sequence slot is requested and every sequence slot is taken.
class NoFreeSeqSlotError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Thrown when the KV pool cannot provide the blocks asked for.
class OutOfKvBlocksError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class CapacitySchedulerPolicy : int32_t {
  kGuaranteedNoEvict = 0,  // admit only when blocks to completion can be reserved
  kMaxUtilization = 1,     // admit greedily; pause the latest-started request when blocks run out
  kStaticBatch = 2,        // admit (as no-evict) only when nothing is running
};

// The order in which waiting requests start.
enum class QueuePolicy : int32_t {
  kFcfs = 0,      // arrival order
  kPriority = 1,  // higher priority first, arrival order among equals
};

enum class RequestState : int32_t {
  kWaiting = 0,                // queued: never started, or paused and waiting to be recomputed
  kContextInProgress = 1,      // its context (prompt) is being computed, possibly over several chunks
  kGenerationInProgress = 2,   // producing one token per step
  kFinished = 3,
};

enum class FinishReason : int32_t {
  kNone = 0,
  kEndId = 1,      // sampled the end id ("stop")
  kStopToken = 2,  // sampled one of the stop token ids ("stop")
  kLength = 3,     // reached max_new_tokens ("length")
  kAbort = 4,      // aborted by the caller ("abort")
  kStopString = 5, // the caller found a stop string in the text ("stop")
};

// One reusable block of the prefix cache, as exported for persistence and imported back:
// its chained key, the key before it in the chain (the root key for a chain's first block)
// and its tokens (tokens_per_block of them). `block`: the pool block that holds its K/V.
struct CachedBlockRecord {
  BlockId block = -1;
  uint64_t key = 0;
  uint64_t parent = 0;
  std::vector<TokenId> tokens;
};

}  // namespace pyengine
