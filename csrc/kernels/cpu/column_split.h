// How the linear kernels share a layer's output columns (weight rows) between threads.
#pragma once

#include "parallel.h"

#include <algorithm>
#include <cstdint>

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

// Calls rows(n0, n1) over [0, N) on `nt` threads (1: on the calling thread): contiguous ranges,
// each a multiple of `grain` columns (the last takes the rest), so that each thread streams its
// own part of the weights in order.
template <typename Rows>
void split_columns(int32_t N, int nt, int32_t grain, Rows&& rows) {
  nt = std::max(1, std::min(nt, (N + grain - 1) / grain));
  if (nt == 1) {
    rows(0, N);
    return;
  }
  const int32_t groups = (N + grain - 1) / grain;
PYENGINE_OMP(parallel num_threads(nt))
  {
    const GroupRange g = thread_groups(groups, cpu::thread_id(), cpu::team_size());
    rows(g.begin * grain, std::min(N, g.end * grain));
  }
}

}  // namespace pyengine::kernels::cpu
