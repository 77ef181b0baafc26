// How the linear kernels share a layer's output columns (weight rows) between threads.
#pragma once

#include "parallel.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace pyengine::kernels::cpu {

// The groups [begin, end) of `groups` in order that thread t of a team of T takes (the same
// share for every t in 0..T-1 whatever else the thread does).
struct GroupRange {
  int32_t begin, end;
};
static inline GroupRange thread_groups(int32_t groups, int t, int T) {
  return {static_cast<int32_t>(static_cast<int64_t>(groups) * t / T),
          static_cast<int32_t>(static_cast<int64_t>(groups) * (t + 1) / T)};
}

// Weight bytes a thread claims at a time from its range in split_columns: small enough that the
// threads finish within about a chunk's time of each other (~1 us at one core's share of the
// memory bandwidth), large enough that a claim (one uncontended compare-and-swap) costs nothing.
constexpr int64_t kSplitChunkBytes = 16 << 10;

namespace split_detail {

// One thread's remaining groups [lo, hi), packed in one word so that the owner (taking chunks
// from the front) and a thief (taking half from the back) agree by compare-and-swap.
struct alignas(64) Range {
  std::atomic<uint64_t> word;
};
inline uint64_t pack(uint32_t lo, uint32_t hi) { return (static_cast<uint64_t>(hi) << 32) | lo; }
inline uint32_t lo_of(uint64_t w) { return static_cast<uint32_t>(w); }
inline uint32_t hi_of(uint64_t w) { return static_cast<uint32_t>(w >> 32); }

// Takes up to `chunk` groups from the front of r; false when r is empty.
inline bool claim_front(Range& r, uint32_t chunk, uint32_t& b, uint32_t& e) {
  uint64_t w = r.word.load(std::memory_order_relaxed);
  for (;;) {
    const uint32_t lo = lo_of(w), hi = hi_of(w);
    if (lo >= hi) return false;
    const uint32_t n = std::min(chunk, hi - lo);
    if (r.word.compare_exchange_weak(w, pack(lo + n, hi), std::memory_order_acq_rel)) {
      b = lo;
      e = lo + n;
      return true;
    }
  }
}

// Moves the back half of the fullest other range (more than one chunk left) into `mine`; false
// when no range has that much left.
inline bool steal_half(Range* ranges, int nt, int me, uint32_t chunk) {
  for (;;) {
    int victim = -1;
    uint32_t most = chunk;
    for (int t = 0; t < nt; ++t) {
      const uint64_t w = ranges[t].word.load(std::memory_order_relaxed);
      const uint32_t left = hi_of(w) > lo_of(w) ? hi_of(w) - lo_of(w) : 0;
      if (t != me && left > most) {
        most = left;
        victim = t;
      }
    }
    if (victim < 0) return false;
    uint64_t w = ranges[victim].word.load(std::memory_order_relaxed);
    const uint32_t lo = lo_of(w), hi = hi_of(w);
    if (hi <= lo || hi - lo <= chunk) continue;  // taken meanwhile: look again
    const uint32_t mid = hi - (hi - lo) / 2;
    if (ranges[victim].word.compare_exchange_strong(w, pack(lo, mid), std::memory_order_acq_rel)) {
      ranges[me].word.store(pack(mid, hi), std::memory_order_release);
      return true;
    }
  }
}

}  // namespace split_detail

// Calls rows(n0, n1) over [0, N) on `nt` threads (1: on the calling thread), each call a
// multiple of `grain` columns (the last takes the rest). Each thread starts on its own contiguous
// share and streams it in order, a chunk of about kSplitChunkBytes (given the weight bytes of one
// group of `grain` columns) at a time; a thread done with its share takes the back half of the
// fullest share left, so that a thread slowed down (a busier core, an interrupt) does not leave
// the others waiting at the end. Which thread computes a column does not change its result.
template <typename Rows>
void split_columns(int32_t N, int nt, int32_t grain, int64_t group_bytes, Rows&& rows) {
  nt = std::max(1, std::min(nt, (N + grain - 1) / grain));
  if (nt == 1) {
    rows(0, N);
    return;
  }
  const int32_t groups = (N + grain - 1) / grain;
  const auto chunk = static_cast<uint32_t>(std::max<int64_t>(1, kSplitChunkBytes / std::max<int64_t>(1, group_bytes)));
  constexpr int kOnStack = 16;
  split_detail::Range on_stack[kOnStack];
  std::unique_ptr<split_detail::Range[]> on_heap;
  split_detail::Range* ranges = on_stack;
  if (nt > kOnStack) {
    on_heap.reset(new split_detail::Range[nt]);
    ranges = on_heap.get();
  }
  for (int t = 0; t < nt; ++t) {
    const GroupRange g = thread_groups(groups, t, nt);
    ranges[t].word.store(split_detail::pack(static_cast<uint32_t>(g.begin), static_cast<uint32_t>(g.end)),
                         std::memory_order_relaxed);
  }
PYENGINE_OMP(parallel num_threads(nt))
  {
    const int me = cpu::thread_id();
    if (me < nt) {
      uint32_t b = 0, e = 0;
      do {
        while (split_detail::claim_front(ranges[me], chunk, b, e))
          rows(static_cast<int32_t>(b) * grain, std::min(N, static_cast<int32_t>(e) * grain));
      } while (split_detail::steal_half(ranges, nt, me, chunk));
    }
  }
  // A team smaller than asked for (nested in another parallel region, a thread limit) leaves
  // shares without an owner, and stealing leaves the last chunk of each: done here.
  for (int t = 0; t < nt; ++t) {
    uint32_t b = 0, e = 0;
    while (split_detail::claim_front(ranges[t], chunk, b, e))
      rows(static_cast<int32_t>(b) * grain, std::min(N, static_cast<int32_t>(e) * grain));
  }
}

}  // namespace pyengine::kernels::cpu
