// Resource managers, prepared in order (slots, then KV: it needs the final batch shape)
// and freed in reverse order (KV before slot), as the step contract requires.
#pragma once

#include <memory>
#include <vector>

#include "batch_manager/request.h"
#include "batch_manager/seq_slot_manager.h"
#include "kv_cache/kv_cache_manager.h"

namespace pyengine {

class BaseResourceManager {
 public:
  virtual ~BaseResourceManager() = default;
  virtual const char* name() const = 0;
  // Gives the batch's requests what they need this step. May shrink context chunks (never
  // grow them); a request whose chunk becomes 0 is removed from the batch.
  virtual void prepare(std::vector<Request*>& batch) = 0;
  // Takes back whatever the request holds (no-op for what it does not hold).
  virtual void free(Request& request) = 0;
};

class SeqSlotResourceManager : public BaseResourceManager {
 public:
  explicit SeqSlotResourceManager(SeqSlotManager& slots) : slots_(slots) {}
  const char* name() const override { return "seq_slots"; }
  void prepare(std::vector<Request*>& batch) override;
  void free(Request& request) override;

 private:
  SeqSlotManager& slots_;
};

class KvCacheResourceManager : public BaseResourceManager {
 public:
  KvCacheResourceManager(KvCacheManager& kv, int32_t chunk_unit) : kv_(kv), chunk_unit_(chunk_unit) {}
  const char* name() const override { return "kv_cache"; }
  // New tables first (taking their planned prefix from the cache, which moves their
  // context position), then generation rows, then context chunks (shrunk to what is free).
  void prepare(std::vector<Request*>& batch) override;
  void free(Request& request) override;

  int64_t total_reused_tokens() const { return total_reused_tokens_; }
  int64_t num_reuse_hits() const { return num_reuse_hits_; }
  void restore_stats(int64_t reused_tokens, int64_t hits) {
    total_reused_tokens_ = reused_tokens;
    num_reuse_hits_ = hits;
  }

 private:
  KvCacheManager& kv_;
  int32_t chunk_unit_;
  int64_t total_reused_tokens_ = 0;
  int64_t num_reuse_hits_ = 0;
};

class ResourceManager {
 public:
  void add(std::unique_ptr<BaseResourceManager> manager) { managers_.push_back(std::move(manager)); }
  void prepare(std::vector<Request*>& batch);
  void free(Request& request);

 private:
  std::vector<std::unique_ptr<BaseResourceManager>> managers_;
};

}  // namespace pyengine
