// The CPU's feature flags and model name (pyengine/cpu_isa.h), detected from the CPU itself: on
// Linux they must agree with what the kernel reports in /proc/cpuinfo (which the library does
// not read), and the instruction-set levels must follow from them.
#include <algorithm>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "pyengine/cpu_isa.h"
#include "test_harness.h"

using namespace pyengine;

namespace {

#if defined(__x86_64__)
const std::vector<std::string> kKnown = {"sse4_2",      "avx",      "avx2",     "fma",      "f16c",
                                         "avx512f",     "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
                                         "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16"};
const char* kFlagsKey = "flags";
#elif defined(__aarch64__)
const std::vector<std::string> kKnown = {"asimd", "fphp", "asimdhp", "asimddp", "sve", "bf16", "i8mm"};
const char* kFlagsKey = "Features";
#else
const std::vector<std::string> kKnown = {};
const char* kFlagsKey = "";
#endif

// The value of the first "key : value" line of /proc/cpuinfo ("" if none).
std::string cpuinfo_value(const std::string& key) {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string k = line.substr(0, colon);
    k.erase(k.find_last_not_of(" \t") + 1);
    if (k != key) continue;
    const size_t v = line.find_first_not_of(' ', colon + 1);
    return v == std::string::npos ? "" : line.substr(v);
  }
  return "";
}

}  // namespace

TEST(flags_are_known_names_in_the_documented_order_without_duplicates) {
  const std::vector<std::string>& flags = cpu_feature_flags();
  size_t pos = 0;
  for (const std::string& f : flags) {
    const auto it = std::find(kKnown.begin() + pos, kKnown.end(), f);
    CHECK(it != kKnown.end());  // a known name, after the previous one
    if (it != kKnown.end()) pos = static_cast<size_t>(it - kKnown.begin()) + 1;
  }
  CHECK(&cpu_feature_flags() == &flags);  // detected once
}

TEST(flags_agree_with_proc_cpuinfo) {
  const std::string line = cpuinfo_value(kFlagsKey);
  if (line.empty()) {
    std::cerr << "  (no /proc/cpuinfo " << kFlagsKey << " line: not compared)\n";
    return;
  }
  std::set<std::string> kernel;
  std::istringstream words(line);
  for (std::string w; words >> w;) kernel.insert(w);
  for (const std::string& name : kKnown)
    CHECK_EQ(name + (cpu_has_feature(name) ? " present" : " absent"),
             name + (kernel.count(name) ? " present" : " absent"));
}

TEST(model_name_matches_proc_cpuinfo) {
#if defined(__x86_64__)
  const std::string expected = cpuinfo_value("model name");
  if (!expected.empty()) CHECK_EQ(cpu_model_name(), expected);
  CHECK(!cpu_model_name().empty() || expected.empty());
#else
  CHECK_EQ(cpu_model_name(), std::string(""));
#endif
}

TEST(vendor_matches_proc_cpuinfo) {
#if defined(__x86_64__)
  const std::string expected = cpuinfo_value("vendor_id");
  if (!expected.empty()) CHECK_EQ(cpu_vendor(), expected);
  CHECK_EQ(cpu_vendor().size(), size_t{12});  // cpuid leaf 0's three registers
  CHECK(&cpu_vendor() == &cpu_vendor());       // detected once
#else
  CHECK_EQ(cpu_vendor(), std::string(""));
#endif
}

TEST(family_matches_proc_cpuinfo) {
#if defined(__x86_64__)
  // /proc/cpuinfo's "cpu family" is the same display family (base + extended where base is 15)
  const std::string expected = cpuinfo_value("cpu family");
  if (!expected.empty()) CHECK_EQ(cpu_family(), std::stoi(expected));
  CHECK(cpu_family() >= 3);
#else
  CHECK_EQ(cpu_family(), 0);
#endif
}

TEST(levels_follow_from_the_flags) {
  const std::vector<CpuIsa> levels = supported_cpu_isas();
  auto has_level = [&](CpuIsa l) { return std::find(levels.begin(), levels.end(), l) != levels.end(); };
#if defined(__x86_64__)
  const bool avx2 = cpu_has_feature("avx2") && cpu_has_feature("fma") && cpu_has_feature("f16c");
  CHECK_EQ(has_level(CpuIsa::kAvx2), avx2);
  CHECK_EQ(has_level(CpuIsa::kAvx512), avx2 && cpu_has_feature("avx512f") && cpu_has_feature("avx512bw") &&
                                           cpu_has_feature("avx512vl") && cpu_has_feature("avx512dq"));
  CHECK(cpu_has_feature("sse4_2") || !cpu_has_feature("avx"));  // every AVX CPU has SSE4.2
#elif defined(__aarch64__)
  CHECK(cpu_has_feature("asimd"));  // part of every armv8-a CPU
  CHECK(has_level(CpuIsa::kNeon));
#endif
  CHECK(!cpu_has_feature("no_such_flag"));
}

int main() { return test::run_all(); }
