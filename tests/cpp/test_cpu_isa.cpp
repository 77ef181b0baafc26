// The run-time instruction-set level of the CPU kernels (pyengine/cpu_isa.h). The first argument,
// when given, is put in PYENGINE_CPU_ISA before the level is first read, as a user would set it:
//   test_cpu_isa            -> the highest supported level, for the stated reason
//   test_cpu_isa generic    -> generic, reason "PYENGINE_CPU_ISA=generic"
//   test_cpu_isa bogus      -> every call throws, naming the value and the CPU's levels
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "pyengine/cpu_isa.h"
#include "pyengine/cpu_linear.h"
#include "test_harness.h"

using namespace pyengine;

namespace {
std::string env_value;  // what main() put in PYENGINE_CPU_ISA ("" = unset)
}

TEST(names_round_trip_and_unknown_names_are_refused) {
  for (CpuIsa l : {CpuIsa::kGeneric, CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kNeon})
    CHECK(parse_cpu_isa(cpu_isa_name(l)) == l);
  CHECK_THROWS(parse_cpu_isa("sse4"), std::invalid_argument, "'sse4' (known: generic, avx2, avx512, neon)");
}

TEST(supported_levels_start_with_generic_and_match_the_architecture) {
  const auto levels = supported_cpu_isas();
  CHECK(!levels.empty() && levels.front() == CpuIsa::kGeneric);
  for (CpuIsa l : levels) {
#if defined(__x86_64__)
    CHECK(l != CpuIsa::kNeon);
#elif defined(__aarch64__)
    CHECK(l == CpuIsa::kGeneric || l == CpuIsa::kNeon);
#endif
  }
}

TEST(the_level_follows_the_environment) {
  const auto levels = supported_cpu_isas();
  if (env_value.empty()) {
    CHECK(cpu_isa() == levels.back());
    CHECK_EQ(cpu_isa_reason(), std::string("the highest level this CPU supports"));
  } else if (env_value == "generic") {
    CHECK(cpu_isa() == CpuIsa::kGeneric);
    CHECK_EQ(cpu_isa_reason(), std::string("PYENGINE_CPU_ISA=generic"));
  } else {  // an invalid value: every kernel call refuses, naming the value and the levels
    CHECK_THROWS(cpu_isa(), std::invalid_argument, "PYENGINE_CPU_ISA=" + env_value);
    CHECK_THROWS(cpu_isa(), std::invalid_argument, "this CPU has generic");
    float y = 0, x = 1, w = 1;
    CHECK_THROWS(kernels::linear_f32(&y, &x, &w, nullptr, 1, 1, 1, 1), std::invalid_argument,
                 "PYENGINE_CPU_ISA=" + env_value);
    CHECK(y == 0.0f);  // nothing was written
    set_cpu_isa(CpuIsa::kGeneric);  // a valid choice clears the error
    CHECK(cpu_isa() == CpuIsa::kGeneric);
    CHECK_EQ(cpu_isa_reason(), std::string("set_cpu_isa()"));
  }
}

TEST(set_cpu_isa_refuses_a_level_the_cpu_lacks) {
  const auto levels = supported_cpu_isas();
  for (CpuIsa l : {CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kNeon}) {
    bool have = false;
    for (CpuIsa s : levels) have = have || s == l;
    if (!have)
      CHECK_THROWS(set_cpu_isa(l), std::invalid_argument,
                   std::string("this CPU does not support ") + cpu_isa_name(l));
  }
  const CpuIsa before = cpu_isa();
  set_cpu_isa(levels.back());
  CHECK(cpu_isa() == levels.back());
  set_cpu_isa(before);
}

int main(int argc, char** argv) {
  if (argc > 1) {
    env_value = argv[1];
    setenv("PYENGINE_CPU_ISA", argv[1], 1);
  } else {
    unsetenv("PYENGINE_CPU_ISA");
  }
  return test::run_all();
}
