// split_columns (csrc/kernels/cpu/column_split.h), the linear kernels' sharing of output columns
// between threads: every column computed exactly once, in calls aligned to the grain, whatever
// the team; a thread slowed down has its share taken by the others.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/cpu/column_split.h"
#include "test_harness.h"

using pyengine::kernels::cpu::split_columns;

namespace {

struct Coverage {
  std::unique_ptr<std::atomic<int>[]> hits;
  std::atomic<int> misaligned{0};
  std::atomic<int> calls{0};
  explicit Coverage(int32_t n) : hits(new std::atomic<int>[n]) {
    for (int32_t i = 0; i < n; ++i) hits[i] = 0;
  }
};

// Runs split_columns and checks every column was computed once and every call began on a grain
// boundary and ended on one (or at N).
void check_cover(int32_t N, int nt, int32_t grain, int64_t group_bytes) {
  Coverage c(N);
  split_columns(N, nt, grain, group_bytes, [&](int32_t n0, int32_t n1) {
    c.calls++;
    if (n0 % grain != 0 || (n1 % grain != 0 && n1 != N) || n0 >= n1) c.misaligned++;
    for (int32_t i = n0; i < n1; ++i) c.hits[i]++;
  });
  const std::string what = "N=" + std::to_string(N) + " nt=" + std::to_string(nt) + " grain=" +
                           std::to_string(grain) + " group_bytes=" + std::to_string(group_bytes);
  int wrong = 0;
  for (int32_t i = 0; i < N; ++i) wrong += c.hits[i] != 1;
  CHECK_EQ(wrong, 0);
  CHECK_EQ(c.misaligned.load(), 0);
  if (wrong != 0 || c.misaligned != 0) std::cerr << "  in " << what << "\n";
}

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

TEST(every_column_is_computed_once_in_grain_aligned_calls) {
  for (int32_t N : {1, 7, 8, 64, 1000, 1024, 4099})
    for (int nt : {1, 2, 3, 5})
      for (int32_t grain : {1, 4, 8})
        // one group per chunk (the most claims and steals), a few, and the whole range at once
        for (int64_t group_bytes : {int64_t{1} << 20, int64_t{4096}, int64_t{1}}) check_cover(N, nt, grain, group_bytes);
}

TEST(chunks_follow_the_weight_bytes_of_a_group) {
  // 1024 columns of grain 8 at 4 KiB a group: 16 KiB chunks of 4 groups (32 columns), on one thread
  std::vector<std::pair<int32_t, int32_t>> calls;
  split_columns(1024, 1, 8, 4096, [&](int32_t n0, int32_t n1) { calls.emplace_back(n0, n1); });
  CHECK_EQ(calls.size(), size_t{1});  // one thread: the whole range in one call
  calls.clear();
#if defined(_OPENMP)
  std::atomic<int> bad{0};
  split_columns(1024, 2, 8, 4096, [&](int32_t n0, int32_t n1) {
    if (n1 - n0 > 32) bad++;
  });
  CHECK_EQ(bad.load(), 0);
#endif
}

TEST(a_team_smaller_than_asked_for_still_covers_every_column) {
  // nested in a parallel region, the inner team has one thread: the unowned shares are drained
#if defined(_OPENMP)
  Coverage c(777);
  PYENGINE_OMP(parallel num_threads(2))
  {
    PYENGINE_OMP(single)
    split_columns(777, 4, 4, 64, [&](int32_t n0, int32_t n1) {
      for (int32_t i = n0; i < n1; ++i) c.hits[i]++;
    });
  }
  int wrong = 0;
  for (int32_t i = 0; i < 777; ++i) wrong += c.hits[i] != 1;
  CHECK_EQ(wrong, 0);
#else
  std::cout << "  (built without OpenMP: one thread runs every share)\n";
  check_cover(777, 4, 4, 64);
#endif
}

TEST(a_slow_thread_has_its_share_taken) {
#if defined(_OPENMP)
  // thread 0 spends 200 us on each call, thread 1 nothing: thread 1 ends up with most columns
  const int32_t N = 4096;
  std::atomic<int32_t> by_thread[2] = {0, 0};
  std::atomic<int> team{0};
  split_columns(N, 2, 8, 4096, [&](int32_t n0, int32_t n1) {
    const int t = pyengine::kernels::cpu::thread_id();
    if (t == 0) {
      const double until = now() + 200e-6;
      while (now() < until) {
      }
    }
    if (t < 2) by_thread[t] += n1 - n0;
    if (t == 0) team = pyengine::kernels::cpu::team_size();
  });
  CHECK_EQ(by_thread[0] + by_thread[1], N);
  if (team == 2) {
    CHECK(by_thread[1] > N * 3 / 4);
    std::cout << "  thread 0 computed " << by_thread[0] << " columns, thread 1 " << by_thread[1] << "\n";
  } else {
    std::cout << "  (skipped: the runtime gave a team of " << team.load() << ")\n";
  }
#else
  std::cout << "  (skipped: built without OpenMP)\n";
#endif
}

int main() { return test::run_all(); }
