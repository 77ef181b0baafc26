// Basic types shared by the whole C++ core.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace pyengine {

using TokenId = int32_t;
using RequestId = int64_t;
using SlotId = int32_t;
using BlockId = int32_t;

// Thrown when a sequence slot is requested and every seat is taken.
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

}  // namespace pyengine
