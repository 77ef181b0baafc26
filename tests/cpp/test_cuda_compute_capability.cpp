// Which GPUs the CUDA kernels accept (csrc/kernels/cuda/compute_capability.h), on the host.
#include <string>

#include "kernels/cuda/compute_capability.h"
#include "test_harness.h"

using namespace pyengine::kernels::cuda::detail;

TEST(ampere_and_newer_are_supported) {
  CHECK(compute_capability_supported(8, 0));
  CHECK(compute_capability_supported(8, 6));
  CHECK(compute_capability_supported(8, 9));
  CHECK(compute_capability_supported(9, 0));
  CHECK(compute_capability_supported(10, 0));
  CHECK(compute_capability_supported(12, 0));
}

TEST(older_gpus_are_not) {
  CHECK(!compute_capability_supported(7, 5));
  CHECK(!compute_capability_supported(7, 0));
  CHECK(!compute_capability_supported(6, 1));
}

TEST(the_error_names_the_device_and_its_capability) {
  CHECK_EQ(compute_capability_error(0, "NVIDIA A100", 8, 0), std::string());
  const std::string e = compute_capability_error(1, "Tesla T4", 7, 5);
  CHECK(e.find("CUDA device 1 (Tesla T4) has compute capability 7.5") != std::string::npos);
  CHECK(e.find("compute capability 8.0 or newer") != std::string::npos);
}

TEST_MAIN()
