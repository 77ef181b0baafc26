#include "pyengine/kv_cache_manager.h"

#include <string>

namespace pyengine {

KvCacheManager::KvCacheManager(int32_t num_blocks, int32_t tokens_per_block)
    : num_blocks_(num_blocks), tokens_per_block_(tokens_per_block) {
  if (num_blocks <= 0)
    throw std::invalid_argument("num_blocks must be positive, got " + std::to_string(num_blocks));
  if (tokens_per_block <= 0)
    throw std::invalid_argument("tokens_per_block must be positive, got " +
                                std::to_string(tokens_per_block));
  for (BlockId b = 0; b < num_blocks; ++b) free_blocks_.push_back(b);
}

void KvCacheManager::add_sequence(RequestId id) {
  if (!tables_.emplace(id, std::vector<BlockId>{}).second)
    throw std::logic_error("request " + std::to_string(id) + " already has a block table");
}

int32_t KvCacheManager::num_blocks_of(RequestId id) const {
  auto it = tables_.find(id);
  return it == tables_.end() ? 0 : static_cast<int32_t>(it->second.size());
}

int32_t KvCacheManager::blocks_needed(RequestId id, int32_t num_tokens) const {
  const int32_t need = blocks_for_tokens(num_tokens) - num_blocks_of(id);
  return need > 0 ? need : 0;
}

void KvCacheManager::add_tokens(RequestId id, int32_t num_tokens) {
  auto it = tables_.find(id);
  if (it == tables_.end())
    throw std::logic_error("request " + std::to_string(id) + " has no block table");
  const int32_t need = blocks_for_tokens(num_tokens) - static_cast<int32_t>(it->second.size());
  if (need <= 0) return;
  if (need > num_free_blocks())
    throw OutOfKvBlocksError("request " + std::to_string(id) + " needs " + std::to_string(need) +
                             " more KV blocks, " + std::to_string(num_free_blocks()) + " free");
  for (int32_t i = 0; i < need; ++i) {
    it->second.push_back(free_blocks_.front());
    free_blocks_.pop_front();
  }
}

void KvCacheManager::remove_sequence(RequestId id) {
  auto it = tables_.find(id);
  if (it == tables_.end())
    throw std::logic_error("request " + std::to_string(id) + " has no block table");
  for (BlockId b : it->second) free_blocks_.push_back(b);
  tables_.erase(it);
}

const std::vector<BlockId>& KvCacheManager::block_table(RequestId id) const {
  auto it = tables_.find(id);
  if (it == tables_.end())
    throw std::logic_error("request " + std::to_string(id) + " has no block table");
  return it->second;
}

void KvCacheManager::check_invariants() const {
  std::vector<int> seen(num_blocks_, 0);
  for (BlockId b : free_blocks_) ++seen.at(b);
  for (const auto& kv : tables_)
    for (BlockId b : kv.second) ++seen.at(b);
  for (BlockId b = 0; b < num_blocks_; ++b)
    if (seen[b] != 1)
      throw std::logic_error("KV block " + std::to_string(b) + " is owned " +
                             std::to_string(seen[b]) + " times (free list + tables)");
}

}  // namespace pyengine
