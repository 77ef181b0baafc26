#include "batch_manager/seq_slot_manager.h"

#include <string>

namespace pyengine {

SeqSlotManager::SeqSlotManager(int32_t num_slots) : num_slots_(num_slots) {
  if (num_slots <= 0)
    throw std::invalid_argument("num_slots must be positive, got " + std::to_string(num_slots));
  for (SlotId s = 0; s < num_slots; ++s) free_slots_.push_back(s);
}

SlotId SeqSlotManager::slot_of(RequestId id) const {
  auto it = owners_.find(id);
  return it == owners_.end() ? -1 : it->second;
}

SlotId SeqSlotManager::acquire(RequestId id) {
  if (has_slot(id))
    throw std::logic_error("request " + std::to_string(id) + " already holds slot " +
                           std::to_string(slot_of(id)));
  if (free_slots_.empty())
    throw NoFreeSeqSlotError("no free sequence slot for request " + std::to_string(id) + " (all " +
                             std::to_string(num_slots_) + " taken)");
  const SlotId slot = free_slots_.front();
  free_slots_.pop_front();
  owners_.emplace(id, slot);
  if (journaling_) journal_.push_back({true, id, slot});
  return slot;
}

void SeqSlotManager::release(RequestId id) {
  auto it = owners_.find(id);
  if (it == owners_.end())
    throw std::logic_error("request " + std::to_string(id) + " holds no sequence slot");
  free_slots_.push_back(it->second);
  if (journaling_) journal_.push_back({false, id, it->second});
  owners_.erase(it);
}

void SeqSlotManager::rollback() {
  journaling_ = false;
  for (auto it = journal_.rbegin(); it != journal_.rend(); ++it) {
    if (it->acquired) {  // it came from the front of the free list
      owners_.erase(it->id);
      free_slots_.push_front(it->slot);
    } else {  // it went to the back
      free_slots_.pop_back();
      owners_.emplace(it->id, it->slot);
    }
  }
  journal_.clear();
}

void SeqSlotManager::check_all_free() const {
  if (owners_.empty()) return;
  std::string holders;
  for (const auto& kv : owners_)
    holders += (holders.empty() ? "" : ", ") + std::to_string(kv.first) + "->" + std::to_string(kv.second);
  throw std::logic_error(std::to_string(owners_.size()) + " sequence slot(s) still held: " + holders);
}

}  // namespace pyengine
