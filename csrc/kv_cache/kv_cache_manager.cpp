#include "kv_cache/kv_cache_manager.h"

#include <algorithm>
#include <string>
#include <unordered_set>

namespace pyengine {
namespace {

uint64_t mix(uint64_t x) {  // splitmix64's finalizer
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

}  // namespace

uint64_t KvCacheManager::block_key(uint64_t parent_key, const TokenId* tokens, int32_t num_tokens) {
  uint64_t h = mix(parent_key ^ 0x9e3779b97f4a7c15ULL);
  for (int32_t i = 0; i < num_tokens; ++i) h = mix(h ^ (static_cast<uint64_t>(static_cast<uint32_t>(tokens[i])) + 0x632be59bd9b4e019ULL * (i + 1)));
  return h;
}

uint64_t KvCacheManager::root_key(uint64_t salt) { return salt == 0 ? 0 : mix(salt ^ 0xd1b54a32d192ed03ULL); }

KvCacheManager::KvCacheManager(int32_t num_blocks, int32_t tokens_per_block, bool enable_reuse)
    : num_blocks_(num_blocks), tokens_per_block_(tokens_per_block), enable_reuse_(enable_reuse) {
  if (num_blocks <= 0)
    throw std::invalid_argument("num_blocks must be positive, got " + std::to_string(num_blocks));
  if (tokens_per_block <= 0)
    throw std::invalid_argument("tokens_per_block must be positive, got " + std::to_string(tokens_per_block));
  blocks_.resize(num_blocks);
  for (BlockId b = 0; b < num_blocks; ++b) push_free_back(b);
}

void KvCacheManager::push_free_back(BlockId b) {
  log({Op::kPushFreeBack, b, 0, 0, 0, {}});
  Block& blk = blocks_[b];
  blk.in_free = true;
  blk.prev = free_tail_;
  blk.next = -1;
  if (free_tail_ >= 0) blocks_[free_tail_].next = b; else free_head_ = b;
  free_tail_ = b;
  ++free_size_;
  if (blk.cached) ++num_reusable_free_;
}

void KvCacheManager::push_free_front(BlockId b) {
  log({Op::kPushFreeFront, b, 0, 0, 0, {}});
  relink_free(b, -1, free_head_);
}

void KvCacheManager::unlink_free(BlockId b) {
  Block& blk = blocks_[b];
  log({Op::kUnlinkFree, b, blk.prev, blk.next, 0, {}});
  if (blk.prev >= 0) blocks_[blk.prev].next = blk.next; else free_head_ = blk.next;
  if (blk.next >= 0) blocks_[blk.next].prev = blk.prev; else free_tail_ = blk.prev;
  blk.prev = blk.next = -1;
  blk.in_free = false;
  --free_size_;
  if (blk.cached) --num_reusable_free_;
}

void KvCacheManager::relink_free(BlockId b, BlockId prev, BlockId next) {
  Block& blk = blocks_[b];
  blk.prev = prev;
  blk.next = next;
  if (prev >= 0) blocks_[prev].next = b; else free_head_ = b;
  if (next >= 0) blocks_[next].prev = b; else free_tail_ = b;
  blk.in_free = true;
  ++free_size_;
  if (blk.cached) ++num_reusable_free_;
}

void KvCacheManager::set_ref(BlockId b, int32_t ref) {
  log({Op::kRef, b, blocks_[b].ref, 0, 0, {}});
  blocks_[b].ref = ref;
}

void KvCacheManager::begin() {
  journal_.clear();
  journaling_ = true;
}

void KvCacheManager::commit() {
  journal_.clear();
  journaling_ = false;
}

void KvCacheManager::rollback() {
  journaling_ = false;
  for (auto it = journal_.rbegin(); it != journal_.rend(); ++it) {
    switch (it->op) {
      case Op::kUnlinkFree:
        relink_free(it->block, it->a, it->b);
        break;
      case Op::kPushFreeBack: {
        // It is the tail again at this point of the replay.
        Block& blk = blocks_[it->block];
        if (blk.prev >= 0) blocks_[blk.prev].next = -1; else free_head_ = -1;
        free_tail_ = blk.prev;
        blk.prev = blk.next = -1;
        blk.in_free = false;
        --free_size_;
        if (blk.cached) --num_reusable_free_;
        break;
      }
      case Op::kPushFreeFront:  // it is the head again at this point of the replay
        unlink_free(it->block);
        break;
      case Op::kRef:
        blocks_[it->block].ref = it->a;
        break;
      case Op::kTablePop:
        tables_[it->id].push_back(it->block);
        break;
      case Op::kTableCreate:
        tables_.erase(it->id);
        break;
      case Op::kTablePush:
        tables_[it->id].pop_back();
        break;
      case Op::kTableErase:
        tables_[it->id] = std::move(it->table);
        break;
    }
  }
  journal_.clear();
}

BlockId KvCacheManager::pop_free_front() {
  const BlockId b = free_head_;
  unlink_free(b);
  Block& blk = blocks_[b];
  if (blk.cached) {  // evict: its content is about to be overwritten
    cached_.erase(blk.key);
    blk.cached = false;
    blk.tokens.clear();
  }
  return b;
}

BlockId KvCacheManager::lookup(uint64_t key, uint64_t parent, const TokenId* tokens) const {
  auto it = cached_.find(key);
  if (it == cached_.end()) return -1;
  const Block& blk = blocks_[it->second];
  if (blk.parent != parent || !std::equal(blk.tokens.begin(), blk.tokens.end(), tokens)) return -1;
  return it->second;
}

KvCacheManager::ReuseProbe KvCacheManager::probe_reuse(const std::vector<uint64_t>& keys,
                                                       const std::vector<TokenId>& tokens, uint64_t root,
                                                       int32_t max_blocks) const {
  ReuseProbe p;
  for (BlockId b : reuse_chain(keys, tokens, root, max_blocks)) {
    ++p.blocks;
    if (blocks_[b].ref > 0) ++p.in_use;
  }
  return p;
}

std::vector<BlockId> KvCacheManager::reuse_chain(const std::vector<uint64_t>& keys,
                                                 const std::vector<TokenId>& tokens, uint64_t root,
                                                 int32_t max_blocks) const {
  std::vector<BlockId> chain;
  if (!enable_reuse_) return chain;
  const int32_t n = std::min<int32_t>(max_blocks, static_cast<int32_t>(keys.size()));
  uint64_t parent = root;
  for (int32_t i = 0; i < n; ++i) {
    const BlockId b = lookup(keys[i], parent, tokens.data() + static_cast<size_t>(i) * tokens_per_block_);
    if (b < 0) break;
    chain.push_back(b);
    parent = keys[i];
  }
  return chain;
}

int32_t KvCacheManager::add_sequence_with_reuse(RequestId id, const std::vector<uint64_t>& keys,
                                                const std::vector<TokenId>& tokens, uint64_t root,
                                                int32_t max_blocks) {
  add_sequence(id);
  if (!enable_reuse_) return 0;
  std::vector<BlockId>& table = tables_[id];
  const int32_t n = std::min<int32_t>(max_blocks, static_cast<int32_t>(keys.size()));
  uint64_t parent = root;
  for (int32_t i = 0; i < n; ++i) {
    const BlockId b = lookup(keys[i], parent, tokens.data() + static_cast<size_t>(i) * tokens_per_block_);
    if (b < 0) break;
    if (blocks_[b].in_free) unlink_free(b);
    set_ref(b, blocks_[b].ref + 1);
    log({Op::kTablePush, b, 0, 0, id, {}});
    table.push_back(b);
    parent = keys[i];
  }
  return static_cast<int32_t>(table.size());
}

void KvCacheManager::cache_blocks(RequestId id, const std::vector<uint64_t>& keys,
                                  const std::vector<TokenId>& tokens, uint64_t root, int32_t num_full_blocks) {
  if (!enable_reuse_) return;
  const std::vector<BlockId>& table = block_table(id);
  const int32_t n = std::min<int32_t>({num_full_blocks, static_cast<int32_t>(keys.size()),
                                       static_cast<int32_t>(table.size())});
  for (int32_t i = 0; i < n; ++i) {
    Block& blk = blocks_[table[i]];
    if (blk.cached || cached_.count(keys[i])) continue;  // registered, or the same content is elsewhere
    blk.cached = true;
    blk.key = keys[i];
    blk.parent = i == 0 ? root : keys[i - 1];
    const auto first = tokens.begin() + static_cast<std::ptrdiff_t>(i) * tokens_per_block_;
    blk.tokens.assign(first, first + tokens_per_block_);
    cached_.emplace(keys[i], table[i]);
  }
}

std::vector<CachedBlockRecord> KvCacheManager::export_cached() const {
  std::vector<CachedBlockRecord> out;
  for (BlockId b = free_tail_; b >= 0; b = blocks_[b].prev) {
    const Block& blk = blocks_[b];
    if (blk.cached) out.push_back({b, blk.key, blk.parent, blk.tokens});
  }
  return out;
}

std::vector<BlockId> KvCacheManager::import_cached(const std::vector<CachedBlockRecord>& records) {
  if (journaling_) throw std::logic_error("import_cached inside a transaction");
  if (!enable_reuse_) throw std::invalid_argument("import_cached: prefix reuse is disabled");
  // Validate everything first: a bad record changes nothing.
  std::unordered_set<uint64_t> keys;
  for (size_t i = 0; i < records.size(); ++i) {
    const CachedBlockRecord& r = records[i];
    const std::string name = "import_cached: record " + std::to_string(i);
    if (static_cast<int32_t>(r.tokens.size()) != tokens_per_block_)
      throw std::invalid_argument(name + " has " + std::to_string(r.tokens.size()) + " tokens, expected " +
                                  std::to_string(tokens_per_block_));
    if (block_key(r.parent, r.tokens.data(), tokens_per_block_) != r.key)
      throw std::invalid_argument(name + ": its key is not the chained key of its parent and tokens");
    if (!keys.insert(r.key).second) throw std::invalid_argument(name + " repeats an earlier record's key");
  }
  // Free blocks with no reusable content, in free queue order.
  std::vector<BlockId> empty;
  for (BlockId b = free_head_; b >= 0; b = blocks_[b].next)
    if (!blocks_[b].cached) empty.push_back(b);
  std::vector<BlockId> got(records.size(), -1);
  size_t next = 0;
  for (size_t i = 0; i < records.size() && next < empty.size(); ++i) {
    const CachedBlockRecord& r = records[i];
    if (cached_.count(r.key)) continue;
    if (keys.count(r.parent) && !cached_.count(r.parent)) continue;  // its parent record was not placed
    const BlockId b = empty[next++];
    unlink_free(b);  // relinked at the tail below, once cached
    Block& blk = blocks_[b];
    blk.cached = true;
    blk.key = r.key;
    blk.parent = r.parent;
    blk.tokens = r.tokens;
    cached_.emplace(r.key, b);
    got[i] = b;
  }
  for (auto it = got.rbegin(); it != got.rend(); ++it)
    if (*it >= 0) push_free_back(*it);
  return got;
}

void KvCacheManager::add_sequence(RequestId id) {
  if (!tables_.emplace(id, std::vector<BlockId>{}).second)
    throw std::logic_error("request " + std::to_string(id) + " already has a block table");
  log({Op::kTableCreate, -1, 0, 0, id, {}});
}

int32_t KvCacheManager::num_blocks_of(RequestId id) const {
  auto it = tables_.find(id);
  return it == tables_.end() ? 0 : static_cast<int32_t>(it->second.size());
}

int32_t KvCacheManager::num_exclusive_blocks_of(RequestId id) const {
  auto it = tables_.find(id);
  if (it == tables_.end()) return 0;
  return static_cast<int32_t>(std::count_if(it->second.begin(), it->second.end(),
                                            [&](BlockId b) { return blocks_[b].ref == 1; }));
}

int32_t KvCacheManager::blocks_needed(RequestId id, int32_t num_tokens) const {
  const int32_t need = blocks_for_tokens(num_tokens) - num_blocks_of(id);
  return need > 0 ? need : 0;
}

void KvCacheManager::add_tokens(RequestId id, int32_t num_tokens) {
  auto it = tables_.find(id);
  if (it == tables_.end()) throw std::logic_error("request " + std::to_string(id) + " has no block table");
  const int32_t need = blocks_for_tokens(num_tokens) - static_cast<int32_t>(it->second.size());
  if (need <= 0) return;
  if (need > free_size_)
    throw OutOfKvBlocksError("request " + std::to_string(id) + " needs " + std::to_string(need) +
                             " more KV blocks, " + std::to_string(free_size_) + " free");
  for (int32_t i = 0; i < need; ++i) {
    const BlockId b = pop_free_front();
    set_ref(b, 1);
    log({Op::kTablePush, b, 0, 0, id, {}});
    it->second.push_back(b);
  }
}

void KvCacheManager::truncate(RequestId id, int32_t num_tokens) {
  auto it = tables_.find(id);
  if (it == tables_.end()) throw std::logic_error("request " + std::to_string(id) + " has no block table");
  const size_t keep = static_cast<size_t>(std::max(blocks_for_tokens(num_tokens), 0));
  while (it->second.size() > keep) {
    const BlockId b = it->second.back();
    it->second.pop_back();
    log({Op::kTablePop, b, 0, 0, id, {}});
    set_ref(b, blocks_[b].ref - 1);
    if (blocks_[b].ref == 0) push_free_front(b);
  }
}

void KvCacheManager::remove_sequence(RequestId id) {
  auto it = tables_.find(id);
  if (it == tables_.end()) throw std::logic_error("request " + std::to_string(id) + " has no block table");
  for (auto b = it->second.rbegin(); b != it->second.rend(); ++b) {
    set_ref(*b, blocks_[*b].ref - 1);
    if (blocks_[*b].ref == 0) push_free_back(*b);
  }
  if (journaling_) log({Op::kTableErase, -1, 0, 0, id, it->second});
  tables_.erase(it);
}

const std::vector<BlockId>& KvCacheManager::block_table(RequestId id) const {
  auto it = tables_.find(id);
  if (it == tables_.end()) throw std::logic_error("request " + std::to_string(id) + " has no block table");
  return it->second;
}

void KvCacheManager::check_invariants() const {
  std::vector<int32_t> owners(num_blocks_, 0);
  for (const auto& kv : tables_)
    for (BlockId b : kv.second) ++owners.at(b);
  std::vector<int32_t> in_queue(num_blocks_, 0);
  int32_t n = 0, reusable = 0;
  for (BlockId b = free_head_; b >= 0; b = blocks_[b].next) {
    ++in_queue.at(b);
    ++n;
    reusable += blocks_[b].cached;
    if (n > num_blocks_) throw std::logic_error("the free queue has a cycle");
  }
  if (n != free_size_ || reusable != num_reusable_free_)
    throw std::logic_error("free queue counts are off");
  for (BlockId b = 0; b < num_blocks_; ++b) {
    const Block& blk = blocks_[b];
    const std::string name = "KV block " + std::to_string(b);
    if (blk.ref != owners[b])
      throw std::logic_error(name + " has ref count " + std::to_string(blk.ref) + " but " +
                             std::to_string(owners[b]) + " owning tables");
    if ((blk.ref == 0) != (in_queue[b] == 1) || in_queue[b] > 1 || blk.in_free != (in_queue[b] == 1))
      throw std::logic_error(name + " is neither free nor owned exactly once");
    if (blk.cached) {
      auto it = cached_.find(blk.key);
      if (it == cached_.end() || it->second != b) throw std::logic_error(name + " carries a key it is not cached under");
    }
  }
  for (const auto& kv : cached_)
    if (!blocks_.at(kv.second).cached || blocks_[kv.second].key != kv.first)
      throw std::logic_error("a cached key points at a block that does not carry it");
}

}  // namespace pyengine
