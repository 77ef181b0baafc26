// The CUDA kernels' shared-memory opt-in bookkeeping (csrc/kernels/cuda/smem_opt_in.h), on the
// host: the CUDA call is replaced by a recorder, so no GPU (and no CUDA build) is needed.
#include <atomic>
#include <stdexcept>
#include <thread>
#include <vector>

#include "kernels/cuda/smem_opt_in.h"
#include "test_harness.h"

using pyengine::kernels::cuda::detail::SmemOptInRegistry;

namespace {

// Two kernels of one type, as every attention kernel is: void(*)(Args).
struct Args {
  int x;
};
volatile int sink;
// different bodies, so that no identical-code folding can give them one address
void kernel_a(Args a) { sink = a.x; }
void kernel_b(Args a) { sink = a.x + 1; }

const void* addr(void (*k)(Args)) { return reinterpret_cast<const void*>(k); }

constexpr int kBig = 80 * 1024;  // above the 48 KiB default

}  // namespace

TEST(two_kernels_of_one_type_each_get_their_opt_in) {
  CHECK(addr(kernel_a) != addr(kernel_b));
  SmemOptInRegistry r;
  std::vector<const void*> called;
  r.ensure(addr(kernel_a), 0, kBig, [&] { called.push_back(addr(kernel_a)); });
  r.ensure(addr(kernel_b), 0, kBig, [&] { called.push_back(addr(kernel_b)); });
  CHECK_EQ(called.size(), size_t{2});
  CHECK(called.size() == 2 && called[0] == addr(kernel_a) && called[1] == addr(kernel_b));
}

TEST(one_kernel_on_two_devices_gets_it_on_each) {
  SmemOptInRegistry r;
  std::vector<int> devices;
  for (int dev : {0, 1, 0, 1}) r.ensure(addr(kernel_a), dev, kBig, [&] { devices.push_back(dev); });
  CHECK_EQ(devices, (std::vector<int>{0, 1}));
}

TEST(a_repeat_does_not_call_again) {
  SmemOptInRegistry r;
  int calls = 0;
  for (int i = 0; i < 5; ++i) r.ensure(addr(kernel_a), 3, kBig, [&] { ++calls; });
  CHECK_EQ(calls, 1);
  r.ensure(addr(kernel_a), 3, kBig - 1024, [&] { ++calls; });  // less than already granted
  CHECK_EQ(calls, 1);
}

TEST(a_larger_size_calls_again) {
  SmemOptInRegistry r;
  std::vector<int> sizes;
  for (int bytes : {kBig, kBig + 16 * 1024, kBig + 16 * 1024, kBig})
    r.ensure(addr(kernel_a), 0, bytes, [&] { sizes.push_back(bytes); });
  CHECK_EQ(sizes, (std::vector<int>{kBig, kBig + 16 * 1024}));
}

TEST(default_sizes_need_no_opt_in) {
  SmemOptInRegistry r;
  int calls = 0;
  r.ensure(addr(kernel_a), 0, 48 * 1024, [&] { ++calls; });
  r.ensure(addr(kernel_a), 0, 1024, [&] { ++calls; });
  CHECK_EQ(calls, 0);
}

TEST(a_failed_call_is_not_recorded) {
  SmemOptInRegistry r;
  int calls = 0;
  CHECK_THROWS(r.ensure(addr(kernel_a), 0, kBig, [&] { ++calls; throw std::runtime_error("launch failed"); }),
               std::runtime_error, "launch failed");
  r.ensure(addr(kernel_a), 0, kBig, [&] { ++calls; });
  CHECK_EQ(calls, 2);
}

TEST(concurrent_first_launches_call_once_per_key) {
  SmemOptInRegistry r;
  std::atomic<int> calls_a{0}, calls_b{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 1000; ++i) {
        if ((t + i) % 2 == 0) {
          r.ensure(addr(kernel_a), 0, kBig, [&] { ++calls_a; });
        } else {
          r.ensure(addr(kernel_b), 0, kBig, [&] { ++calls_b; });
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  CHECK_EQ(calls_a.load(), 1);
  CHECK_EQ(calls_b.load(), 1);
}

TEST_MAIN()
