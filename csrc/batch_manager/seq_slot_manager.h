// The pool of sequence slots. A request holds one sequence slot from its first scheduled
// step to its end; arrays that live across steps (sampler state, ...) are indexed by slot.
#pragma once

#include <deque>
#include <unordered_map>
#include <vector>

#include "pyengine/types.h"

namespace pyengine {

class SeqSlotManager {
 public:
  explicit SeqSlotManager(int32_t num_slots);

  int32_t num_slots() const { return num_slots_; }
  int32_t num_free() const { return static_cast<int32_t>(free_slots_.size()); }
  bool has_slot(RequestId id) const { return owners_.count(id) != 0; }
  // The request's slot, or -1.
  SlotId slot_of(RequestId id) const;

  // Gives a sequence slot to a request that has none. Throws std::logic_error if it already
  // has one, NoFreeSeqSlotError if every sequence slot is taken.
  SlotId acquire(RequestId id);
  // Returns the request's sequence slot. Throws std::logic_error if it holds none.
  void release(RequestId id);

  // Conservation check (shutdown): throws std::logic_error naming the holders if any
  // sequence slot is still taken.
  void check_all_free() const;

  // Transactions, as in KvCacheManager: rollback() undoes every acquire/release since
  // begin(), restoring the free order exactly.
  void begin() { journal_.clear(); journaling_ = true; }
  void commit() { journal_.clear(); journaling_ = false; }
  void rollback();

 private:
  struct Undo {
    bool acquired;  // true: undo an acquire; false: undo a release
    RequestId id;
    SlotId slot;
  };
  bool journaling_ = false;
  std::vector<Undo> journal_;

  int32_t num_slots_;
  std::deque<SlotId> free_slots_;
  std::unordered_map<RequestId, SlotId> owners_;
};

}  // namespace pyengine
